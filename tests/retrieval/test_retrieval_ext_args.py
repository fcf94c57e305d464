"""The retrieval entry points of rapo_fast._C called directly (below the Python op) with a wrong tensor: each argument
of retrieval_search_cpu, retrieval_merge_splits_host and (in CUDA builds; no GPU needed) retrieval_search_cuda, given
the wrong dtype, rank, shape, device or strides (overlapping rows too), raises TypeError (dtype, not a tensor) or
ValueError (the rest) naming the entry point and the argument, before any kernel: the outputs are left as they were.
Also the DLPack side: legacy and versioned capsules and __dlpack__ objects are read, a capsule is consumed once and its
deleter called once, a read-only output or another major version is refused. The checks live in
csrc/retrieval_bindings.cpp and csrc/include/rapo/tensor_arg.h (docs/extension.md). Not here: the search's results
(test_retrieval.py), the op's checks above the extension (test_retrieval_op.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.dlpack_capsules import KDL_CUDA, FakeTensor, inner_strided, on_cuda

from rapo_fast import _ext

pytestmark = pytest.mark.skipif(not _ext.has_extension(), reason="rapo_fast._C not built")
C_, D_, Q_, K_ = 6, 8, 3, 2
SCALARS = dict(k=K_, metric=0, min_score=float("-inf"))
CPU_OPTS = dict(num_threads=1, isa=-1)
NAMES = ["keys", "key_aux", "groups", "queries", "exclude", "centre", "out_scores", "out_slots"]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return dict(
        keys=torch.randn(C_, D_, generator=g),
        key_aux=torch.ones(C_),
        groups=torch.arange(C_),
        queries=torch.randn(Q_, D_, generator=g),
        exclude=torch.full((Q_,), -1),
        centre=None,
        out_scores=torch.full((Q_, K_), 7.0),
        out_slots=torch.full((Q_, K_), 7),
    )


def _search_cpu(ts, **over):
    C = _ext.extension()
    args = {n: over.get(n, _ext.dlpack(ts[n])) for n in NAMES}
    C.retrieval_search_cpu(**args, **SCALARS, **CPU_OPTS)


# (argument, replacement, error, message after "retrieval_search_cpu: <argument>")
BAD = [
    ("keys", lambda t: t.long(), TypeError, ": expected float32, float16 or bfloat16, got int64"),
    ("keys", lambda t: t[0], ValueError, r": expected 2-d \[C, D\], got shape \[8\]"),
    ("keys", inner_strided, ValueError, ": expected a contiguous last dimension"),
    ("queries", lambda t: t.half(), TypeError, r": expected the dtype of keys \(float32\), got float16"),
    ("queries", lambda t: t[None], ValueError, r": expected 2-d \[Q, D\], got shape \[1, 3, 8\]"),
    ("queries", inner_strided, ValueError, ": expected a contiguous last dimension"),
    ("key_aux", lambda t: t.double(), TypeError, ": expected float32, got float64"),
    ("key_aux", lambda t: t[None], ValueError, r": expected 1-d \[C\]"),
    ("key_aux", inner_strided, ValueError, r": expected a contiguous \(row-major\) tensor"),
    ("groups", lambda t: t.int(), TypeError, ": expected int64, got int32"),
    ("groups", lambda t: t[:, None], ValueError, r": expected 1-d \[C\]"),
    ("groups", inner_strided, ValueError, ": expected a contiguous"),
    ("exclude", lambda t: t.float(), TypeError, ": expected int64, got float32"),
    ("exclude", lambda t: t[None], ValueError, r": expected 1-d \[Q\]"),
    ("exclude", inner_strided, ValueError, ": expected a contiguous"),
    ("centre", lambda t: torch.zeros(D_, dtype=torch.float16), TypeError, ": expected float32, got float16"),
    ("centre", lambda t: torch.zeros(D_ + 1), ValueError, r": expected D = 8 in dim 0, got shape \[9\]"),
    ("out_scores", lambda t: t.double(), TypeError, ": expected float32, got float64"),
    ("out_scores", lambda t: torch.zeros(Q_, K_ + 1), ValueError, r": expected k = 2 in dim 1, got shape \[3, 3\]"),
    ("out_scores", lambda t: torch.zeros(K_, Q_).T, ValueError, ": expected a contiguous"),
    ("out_slots", lambda t: t.int(), TypeError, ": expected int64, got int32"),
    ("out_slots", lambda t: torch.zeros(Q_ + 1, K_, dtype=torch.int64), ValueError, r": expected Q = 3 in dim 0"),
    ("out_slots", lambda t: torch.zeros(K_, Q_, dtype=torch.int64).T, ValueError, ": expected a contiguous"),
]


@pytest.mark.parametrize(("name", "make", "error", "message"), BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_search_cpu_refuses_each_wrong_tensor_naming_it(name, make, error, message):
    ts = _tensors()
    base = ts[name] if ts[name] is not None else torch.zeros(D_)
    out_s, out_i = ts["out_scores"].clone(), ts["out_slots"].clone()
    bad = make(base)
    with pytest.raises(error, match=f"^retrieval_search_cpu: {name}{message}"):
        _search_cpu(ts, **{name: _ext.dlpack(bad)})
    assert torch.equal(ts["out_scores"], out_s) and torch.equal(ts["out_slots"], out_i), "written before the check"


@pytest.mark.parametrize("name", NAMES)
def test_search_cpu_refuses_a_tensor_on_another_device(name):
    ts = _tensors()
    fake = on_cuda(ts[name] if ts[name] is not None else torch.zeros(D_))
    with pytest.raises(ValueError, match=f"^retrieval_search_cpu: {name}: expected device cpu, got cuda:0"):
        _search_cpu(ts, **{name: fake.capsule()})
    assert fake.deleted == 1, "a consumed capsule's deleter runs once, on the error path too"
    assert torch.all(ts["out_slots"] == 7)


@pytest.mark.parametrize("name", ["keys", "key_aux", "groups", "queries", "out_scores", "out_slots"])
def test_search_cpu_refuses_what_is_not_a_tensor(name):
    ts = _tensors()
    with pytest.raises(TypeError, match=f"^retrieval_search_cpu: {name}: expected a tensor"):
        _search_cpu(ts, **{name: ts[name].tolist()})
    with pytest.raises(TypeError, match=f"^retrieval_search_cpu: {name}: expected a tensor, got None"):
        _search_cpu(ts, **{name: None})


def test_search_cpu_names_the_argument_with_overlapping_rows():
    ts = _tensors()
    for name, n in (("queries", Q_), ("keys", C_)):
        with pytest.raises(ValueError, match=rf"{name}: row stride 0 is smaller than D = 8 \(overlapping rows\)"):
            _search_cpu(ts, **{name: _ext.dlpack(ts[name][:1].expand(n, D_))})


def test_versioned_capsules_and_dlpack_objects_give_the_same_result():
    ts = _tensors()
    _search_cpu(ts)
    want = ts["out_scores"].clone(), ts["out_slots"].clone()
    for make in (lambda t: t.__dlpack__(max_version=(1, 0)), lambda t: t):  # versioned capsule; object (__dlpack__)
        ts["out_scores"].fill_(7.0), ts["out_slots"].fill_(7)
        _search_cpu(ts, **{n: make(ts[n]) for n in NAMES if ts[n] is not None})
        assert torch.equal(ts["out_scores"], want[0]) and torch.equal(ts["out_slots"], want[1])


def test_capsule_protocol_read_only_output_other_major_version_reuse():
    ts = _tensors()
    shape, dtype, cpu = tuple(ts["out_scores"].shape), torch.float32, (1, 0)
    ro = FakeTensor(shape, dtype, cpu, versioned=True, flags=1)  # DLPACK_FLAG_BITMASK_READ_ONLY
    with pytest.raises(
        ValueError,
        match=r"^retrieval_search_cpu: out_scores: expected a writable tensor .*, got one exported read-only",
    ):
        _search_cpu(ts, out_scores=ro.capsule())
    v2 = FakeTensor(shape, dtype, cpu, versioned=True, major=2)
    with pytest.raises(
        ValueError, match=r"^retrieval_search_cpu: out_scores: expected DLPack major version 1 \(this build's\), got 2"
    ):
        _search_cpu(ts, out_scores=v2.capsule())
    assert ro.deleted == 1 and v2.deleted == 1
    cap = _ext.dlpack(ts["keys"])
    _search_cpu(ts, keys=cap)
    with pytest.raises(
        ValueError,
        match=r"^retrieval_search_cpu: keys: expected a fresh DLPack capsule .*, got one consumed already",
    ):
        _search_cpu(ts, keys=cap)


def test_scalars_are_checked_ints():
    ts = _tensors()
    C = _ext.extension()
    args = {n: _ext.dlpack(ts[n]) for n in NAMES}
    with pytest.raises(TypeError, match="^retrieval_search_cpu: k: expected an int, got float"):
        C.retrieval_search_cpu(**args, **{**SCALARS, "k": 2.0}, **CPU_OPTS)
    args = {n: _ext.dlpack(ts[n]) for n in NAMES}
    with pytest.raises(TypeError, match="^retrieval_search_cpu: metric: expected an int that fits int32"):
        C.retrieval_search_cpu(**args, **{**SCALARS, "metric": 2**40}, **CPU_OPTS)


def _merge(ws_s, ws_i, out_s, out_i):
    _ext.extension().retrieval_merge_splits_host(*(_ext.dlpack(t) for t in (ws_s, ws_i, out_s, out_i)))


MERGE_BAD = [
    ("ws_scores", 0, lambda t: t.double(), TypeError, ": expected float32, got float64"),
    ("ws_scores", 0, lambda t: t[0], ValueError, r": expected 3-d \[n_splits, Q, k\]"),
    ("ws_scores", 0, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), ValueError, ": expected a contiguous"),
    ("ws_slots", 1, lambda t: t.long(), TypeError, ": expected int32, got int64"),
    ("ws_slots", 1, lambda t: t[:, :1].contiguous(), ValueError, r": expected the shape of ws_scores \(\[2, 3, 4\]\)"),
    ("out_scores", 2, lambda t: t.half(), TypeError, ": expected float32, got float16"),
    ("out_scores", 2, lambda t: t[:2], ValueError, ": expected Q = 3 in dim 0"),
    ("out_slots", 3, lambda t: t.int(), TypeError, ": expected int64, got int32"),
    ("out_slots", 3, lambda t: t.T.contiguous().T, ValueError, ": expected a contiguous"),
]


@pytest.mark.parametrize(("name", "i", "make", "error", "message"), MERGE_BAD)
def test_merge_host_refuses_each_wrong_tensor_naming_it(name, i, make, error, message):
    ts = [torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int32), torch.full((3, 4), 7.0)]
    ts.append(torch.full((3, 4), 7))
    ts[i] = make(ts[i])
    with pytest.raises(error, match=f"^retrieval_merge_splits_host: {name}{message}"):
        _merge(*ts)
    assert i == 2 or torch.all(ts[2] == 7)


needs_cuda_build = pytest.mark.skipif(
    not (_ext.has_extension() and hasattr(_ext.extension(), "retrieval_search_cuda")), reason="no CUDA backend"
)


def _cuda_args(ts, device=0):
    """Capsules of ts's shapes on cuda:device with null data (refused before any kernel), and the workspace."""
    fakes = {n: on_cuda(t, device) for n, t in ts.items() if t is not None}
    fakes["ws_scores"] = FakeTensor((1, Q_, K_), torch.float32, (KDL_CUDA, device))
    fakes["ws_slots"] = FakeTensor((1, Q_, K_), torch.int32, (KDL_CUDA, device))
    return fakes


@needs_cuda_build
@pytest.mark.parametrize("name", NAMES[:4] + ["exclude", "out_scores", "out_slots", "ws_scores", "ws_slots"])
def test_search_cuda_refuses_a_tensor_on_another_device(name):
    ts = _tensors()
    fakes = _cuda_args(ts)
    args = {n: f.capsule() for n, f in fakes.items()}
    if name in ts:
        args[name], want = _ext.dlpack(ts[name]), "cpu"
    else:
        dtype = torch.int32 if name == "ws_slots" else torch.float32
        args[name], want = on_cuda(torch.zeros(1, Q_, K_, dtype=dtype), 1).capsule(), "cuda:1"
    with pytest.raises(ValueError, match=f"^retrieval_search_cuda: {name}: expected device cuda:0, got {want}"):
        _ext.extension().retrieval_search_cuda(**args, centre=None, **SCALARS, device=0, stream=0)


@needs_cuda_build
def test_search_cuda_refuses_a_wrong_workspace():
    ts = _tensors()
    C = _ext.extension()
    for name, fake, message in [
        ("ws_scores", FakeTensor((1, Q_, K_ + 1), torch.float32), r": expected k = 2 in dim 2"),
        ("ws_slots", FakeTensor((1, Q_, K_), torch.int64), ": expected int32, got int64"),
        ("ws_slots", FakeTensor((2, Q_, K_), torch.int32), r": expected the shape of ws_scores"),
    ]:
        args = {n: f.capsule() for n, f in _cuda_args(ts).items()}
        args[name] = fake.capsule()
        with pytest.raises((TypeError, ValueError), match=f"^retrieval_search_cuda: {name}{message}"):
            C.retrieval_search_cuda(**args, centre=None, **SCALARS, device=0, stream=0)
