"""The build itself: the extension loads, reports its backends, and its CUDA backend is there exactly when the install's
RAPO_FAST_CUDA setting promised it (CI's CUDA stage installs with AUTO where nvcc is present, so CI proves every .cu
file builds); and the entry points follow the binding convention (docs/extension.md). Not a test of any op."""

import os
import shutil

import pytest
import torch

import rapo_fast
from rapo_fast._ext import build_info, dlpack, extension, has_extension


def test_extension_loads_with_cpu_backend():
    info = build_info()
    assert info["extension"], info["extension_error"]
    assert info["cpu"]


def _nvcc_on_this_machine() -> bool:
    """Where CMakeLists.txt looks for nvcc: PATH, then /usr/local/cuda/bin."""
    return shutil.which("nvcc") is not None or os.access("/usr/local/cuda/bin/nvcc", os.X_OK)


def test_cuda_backend_is_what_the_install_promised():
    """setup.py resolves RAPO_FAST_CUDA (unset: AUTO where a GPU is visible, else 0; tests/test_first_run.py checks
    that mapping) and the build records what it got: 0 builds no CUDA, 1 builds it (or fails the install), AUTO builds
    it exactly when nvcc was found, which on the machine that built this checkout is whether nvcc is there now."""
    info = build_info()
    switch = info["cuda_switch"]
    assert switch in ("0", "AUTO", "1"), info
    if switch == "0":
        assert not info["cuda"] and info["cuda_archs"] == []
    elif switch == "1":
        assert info["cuda"] and info["nvcc_found"]
    else:
        assert info["nvcc_found"] == _nvcc_on_this_machine(), "the build ran where nvcc was (not) found"
        assert info["cuda"] == info["nvcc_found"], info
    if info["cuda"]:
        assert info["cuda_archs"] and all(a[:2].isdigit() for a in info["cuda_archs"]), info["cuda_archs"]


def test_public_api_resolves():
    for name in rapo_fast.__all__:
        assert getattr(rapo_fast, name) is not None, name


@pytest.mark.skipif(not has_extension(), reason="rapo_fast._C not built")
def test_entry_points_take_tensors_by_dlpack_and_scalars_by_keyword():
    """The binding convention (docs/extension.md): no parameter classes with integer addresses; each backend takes its
    tensors as DLPack (capsule or __dlpack__ object) and its scalars by keyword only; a capsule is consumed once."""
    C = extension()
    assert not hasattr(C, "RetrievalSearchParams") and not hasattr(C, "KVSpliceParams")
    keys, aux, groups = torch.randn(4, 8), torch.zeros(4), torch.arange(4)
    queries, out_s, out_i = torch.randn(2, 8), torch.empty(2, 3), torch.empty(2, 3, dtype=torch.int64)
    tensors = [keys, aux, groups, queries, None, None, out_s, out_i]
    scalars = dict(k=3, metric=0, min_score=float("-inf"), num_threads=1, isa=-1)
    C.retrieval_search_cpu(*tensors, **scalars)  # torch tensors themselves: their __dlpack__ is called
    assert out_i[0].tolist() == (queries[0] @ keys.T).topk(3).indices.tolist()
    with pytest.raises(TypeError):  # scalars are keyword-only
        C.retrieval_search_cpu(*tensors, 3, 0, float("-inf"), 1, -1)
    capsules = [dlpack(t) for t in tensors]
    C.retrieval_search_cpu(*capsules, **scalars)
    with pytest.raises(
        ValueError,
        match=r"retrieval_search_cpu: keys: expected a fresh DLPack capsule \(one per call\), got one consumed already",
    ):
        C.retrieval_search_cpu(*capsules, **scalars)
    with pytest.raises(TypeError, match=r"retrieval_search_cpu: keys: expected a tensor .*got int"):
        C.retrieval_search_cpu(keys.data_ptr(), *tensors[1:], **scalars)


def test_py_typed_marker_is_in_the_package_and_its_package_data(monkeypatch):
    """PEP 561: rapo_fast/py.typed exists (type checkers then read the inline hints of an installed rapo_fast) and
    setup.py ships it as package data; setup() is replaced by a recorder, so nothing is built."""
    import runpy
    from pathlib import Path

    import setuptools

    pkg = Path(rapo_fast.__file__).parent
    assert (pkg / "py.typed").is_file()
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(pkg.parent)
    runpy.run_path(str(pkg.parent / "setup.py"), run_name="__main__")
    assert "py.typed" in seen["package_data"]["rapo_fast"]
    assert "rapo_fast.kernels" in seen["packages"] and "package_dir" not in seen  # the kernels inside the package
