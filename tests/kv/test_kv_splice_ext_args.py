"""The KV-splice entry points of rapo_fast._C called directly (below the registered op) with a wrong tensor: each
argument of kv_splice_cpu and (in CUDA builds; no GPU needed) kv_splice_cuda, given the wrong dtype, rank, shape,
device or strides, raises TypeError (dtype, not a tensor) or ValueError (the rest) naming the entry point and the
argument (a cache layer by its index), before any write: the caches are left as they were. The checks live in
csrc/kv_splice_bindings.cpp and csrc/include/rapo/tensor_arg.h (docs/extension.md). Not here: the splice's results
(test_kv_splice.py) or the index checks of the requests (test_kv_splice_op.py)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.dlpack_capsules import KDL_CUDA, FakeTensor, inner_strided, on_cuda

from rapo_fast import _ext

pytestmark = pytest.mark.skipif(
    not (_ext.has_extension() and hasattr(_ext.extension(), "kv_splice_cpu")), reason="rapo_fast._C without kv_splice"
)
L, H, D, CAP, B, S = 2, 2, 8, 10, 2, 6
TENSORS = ["k_pool", "v_pool", "requests", "inv_freq", "block_table"]


def _case(paged: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    shape = (4, 3, H, D) if paged else (B, H, S, D)  # paged: 4 blocks of 3 slots
    return dict(
        keys=[torch.zeros(shape) for _ in range(L)],
        values=[torch.zeros(shape) for _ in range(L)],
        k_pool=torch.randn(L, CAP, H, D, generator=g),
        v_pool=torch.randn(L, CAP, H, D, generator=g),
        requests=torch.tensor([[0, 3, 1, 2, 5]]),  # pool offset, tokens, row, slot, rope delta
        inv_freq=torch.tensor([1.0, 0.01]),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32) if paged else None,
    )


def _splice_cpu(case: dict, **over) -> None:
    args = {n: _ext.dlpack(case[n]) for n in TENSORS}
    args.update(keys=[_ext.dlpack(t) for t in case["keys"]], values=[_ext.dlpack(t) for t in case["values"]])
    args.update(over)
    _ext.extension().kv_splice_cpu(**args, interleaved=False, max_tokens=3)


def _over(case: dict, name: str, make) -> dict:
    """The keyword arguments replacing argument `name` ("keys[1]": one cache layer) by make(its tensor) (a tensor is
    passed as a capsule, anything else as it is)."""
    kind, i = name.rstrip("]").split("[") if name.endswith("]") else (name, None)
    bad = make(case[kind] if i is None else case[kind][int(i)])
    bad = _ext.dlpack(bad) if isinstance(bad, torch.Tensor) else bad
    if i is None:
        return {kind: bad}
    layers = [_ext.dlpack(t) for t in case[kind]]
    layers[int(i)] = bad
    return {kind: layers}


def _strides_swapped(t):
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# (paged, argument as named in the message, maker of the bad argument from the good one, error, message after the name)
BAD = [
    (False, "k_pool", lambda t: t.long(), TypeError, ": expected float32, float16 or"),
    (False, "k_pool", lambda t: t[0], ValueError, ": expected 4-d"),
    (False, "k_pool", inner_strided, ValueError, ": expected a contiguous"),
    (False, "v_pool", lambda t: t.half(), TypeError, r": expected the dtype of k_p"),
    (False, "v_pool", lambda t: t[:, :5], ValueError, ": expected the shape of k_p"),
    (
        False,
        "v_pool",
        _strides_swapped,
        ValueError,
        r": expected the strides of k_pool \(\[160, 16, 8, 1\]\), got \[160, 8, 80, 1\]",
    ),
    (False, "keys[1]", lambda t: t.half(), TypeError, ": expected the d"),
    (False, "keys[1]", lambda t: t[:1], ValueError, ": expected the sha"),
    (False, "keys[0]", inner_strided, ValueError, ": expected a"),
    (False, "keys[1]", _strides_swapped, ValueError, r": expected the strides of keys\[0\]"),
    (False, "values[0]", lambda t: t[0], ValueError, ": expected 4-d"),
    (False, "values[1]", lambda t: [1.0], TypeError, ": expected a tensor"),
    (False, "keys", lambda ts: ts[0], TypeError, ": expected a list of tensors"),
    (False, "keys", lambda ts: [_ext.dlpack(ts[0])], ValueError, "/values: expected one tensor"),
    (False, "requests", lambda t: t.int(), TypeError, ": expected int64, got int32"),
    (False, "requests", lambda t: torch.cat([t] * 2).T.contiguous().T, ValueError, ": expected a contiguous"),
    (False, "requests", lambda t: t[:, :4].contiguous(), ValueError, ": expected fields per request = 5 in dim 1"),
    (False, "inv_freq", lambda t: t.double(), TypeError, ": expected float32"),
    (False, "inv_freq", lambda t: t[None], ValueError, ": expected 1-d"),
    (True, "block_table", lambda t: t.long(), TypeError, ": expected int32"),
    (True, "block_table", lambda t: t[0], ValueError, ": expected 2-d"),
    (True, "block_table", lambda t: t.T, ValueError, ": expected a cont"),
]


@pytest.mark.parametrize(
    ("paged", "name", "make", "error", "message"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)]
)
def test_splice_cpu_refuses_each_wrong_tensor_naming_it(paged, name, make, error, message):
    case = _case(paged)
    _splice_cpu(case)  # the good call writes
    assert any(bool(t.abs().sum()) for t in case["keys"])
    for t in case["keys"] + case["values"]:
        t.fill_(3.0)
    with pytest.raises(error, match="^kv_splice_cpu: " + re.escape(name) + message):
        _splice_cpu(case, **_over(case, name, make))
    assert all(bool((t == 3.0).all()) for t in case["keys"] + case["values"]), "written before the check"


@pytest.mark.parametrize("name", TENSORS + ["keys[1]", "values[1]"])
def test_splice_cpu_refuses_a_tensor_on_another_device(name):
    case = _case(paged=True)
    with pytest.raises(ValueError, match="^kv_splice_cpu: " + re.escape(name) + ": expected device cpu, got cuda:0"):
        _splice_cpu(case, **_over(case, name, lambda t: on_cuda(t).capsule()))
    assert all(bool((t == 0).all()) for t in case["keys"] + case["values"])


needs_cuda_build = pytest.mark.skipif(
    not (_ext.has_extension() and hasattr(_ext.extension(), "kv_splice_cuda")), reason="no CUDA backend"
)


def _cuda_args(case: dict) -> dict:
    """Capsules of the case's tensors on cuda:0 with null data (refused before any kernel), real host copies."""
    fakes = {n: on_cuda(case[n]) for n in TENSORS}
    args = {n: f.capsule() for n, f in fakes.items()}
    args.update(
        keys=[on_cuda(t).capsule() for t in case["keys"]], values=[on_cuda(t).capsule() for t in case["values"]]
    )
    args.update(requests_host=_ext.dlpack(case["requests"]), block_table_host=_ext.dlpack(case["block_table"]))
    args.update(dst_ptrs=FakeTensor((2, L), torch.int64, (KDL_CUDA, 0)).capsule())
    return args


@needs_cuda_build
@pytest.mark.parametrize(
    ("name", "bad", "error", "message"),
    [
        ("k_pool", lambda c: _ext.dlpack(c["k_pool"]), ValueError, ": expected device cuda:0, got cpu"),
        ("inv_freq", lambda c: on_cuda(c["inv_freq"], 1).capsule(), ValueError, ": expected device cuda:0, got cuda:1"),
        ("requests_host", lambda c: on_cuda(c["requests"]).capsule(), ValueError, r": expected host memory \(cpu\)"),
        ("requests_host", lambda c: _ext.dlpack(c["requests"].int()), TypeError, ": expected int64, got int32"),
        ("block_table_host", lambda c: _ext.dlpack(c["block_table"][:1]), ValueError, ": expected the shape of"),
        ("block_table_host", lambda c: None, ValueError, ": expected exactly when block_table is given"),
        ("dst_ptrs", lambda c: FakeTensor((2, L + 1), torch.int64).capsule(), ValueError, ": expected num_layers = 2"),
        ("dst_ptrs", lambda c: FakeTensor((2, L), torch.int32).capsule(), TypeError, ": expected int64, got int32"),
    ],
)
def test_splice_cuda_refuses_each_wrong_tensor_naming_it(name, bad, error, message):
    case = _case(paged=True)
    args = _cuda_args(case)
    args[name] = bad(case)
    with pytest.raises(error, match=f"^kv_splice_cuda: {name}{message}"):
        _ext.extension().kv_splice_cuda(**args, interleaved=False, max_tokens=3, device=0, stream=0)
