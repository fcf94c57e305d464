"""The build itself: the extension loads, reports its backends, and, wherever nvcc is on PATH (every machine of this
project, CI included), its CUDA backend was compiled for the default architectures, so CI proves every .cu file builds;
and each op's parameter class follows the binding convention (docs/extension.md). Not a test of any op."""

import os
import shutil

import pytest

import rapo_fast
from rapo_fast._ext import build_info, extension, has_extension, make_params


def test_extension_loads_with_cpu_backend():
    info = build_info()
    assert info["extension"], info["extension_error"]
    assert info["cpu"]


@pytest.mark.skipif(
    shutil.which("nvcc") is None or os.environ.get("RAPO_FAST_CUDA") == "0", reason="no nvcc, or CUDA build skipped"
)
def test_cuda_backend_compiled_when_nvcc_present():
    info = build_info()
    assert info["cuda"], "nvcc is on PATH but the CUDA backend was not built"
    expected = os.environ.get("RAPO_FAST_CUDA_ARCHS", "80;90a").split(";")
    assert info["cuda_archs"] == expected


def test_public_api_resolves():
    for name in rapo_fast.__all__:
        assert getattr(rapo_fast, name) is not None, name


@pytest.mark.skipif(not has_extension(), reason="rapo_fast._C not built")
@pytest.mark.parametrize("cls_name", ["RetrievalSearchParams", "KVSpliceParams"])
def test_params_classes_are_filled_by_keyword_only_with_every_field(cls_name):
    cls = getattr(extension(), cls_name)
    fields = {name: 0 for name in cls.FIELDS}
    params = make_params(cls, **fields)
    assert all(not getattr(params, name) for name in cls.FIELDS)
    with pytest.raises(TypeError, match="unknown field.*'bogus'"):
        make_params(cls, **fields, bogus=1)
    first = cls.FIELDS[0]
    with pytest.raises(TypeError, match=f"missing field.*'{first}'"):
        make_params(cls, **{k: v for k, v in fields.items() if k != first})
    int_field = next(name for name in cls.FIELDS if name not in ("interleaved", "aligned16", "min_score"))
    with pytest.raises(TypeError, match=f"{cls_name}.{int_field}"):
        make_params(cls, **{**fields, int_field: "x"})


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
    assert seen["package_dir"]["rapo_fast"] == "rapo_fast"
