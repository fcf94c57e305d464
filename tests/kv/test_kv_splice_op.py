"""Tests of the registered tensor-level op `rapo_fast::kv_splice_` (rapo_fast/kv/splice.py), on CPU tensors.

Checks: torch.library.opcheck (schema, fake, mutation declarations, autograd registration, AOT dispatch) for the HF
and paged layouts; a torch.compile(fullgraph=True) function calling the op on plain tensors leaves the same caches as
eager; the op called directly refuses every index outside the pools, the caches or the block table, and mismatched
shapes (IndexError / ValueError from the extension, which checks them itself, not a segfault), writing nothing.
Not here: the op's numerics (splice_kv's CPU backend is this op: tests/kv/test_kv_splice.py), splice_kv's own
argument checks (test_kv_splice.py), the extension's tensor checks (test_kv_splice_ext_args.py), CUDA
(tests/kv/test_kv_splice_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from rapo_fast import _ext
from rapo_fast.kv.splice import kv_splice_

pytestmark = pytest.mark.skipif(
    not (_ext.has_extension() and hasattr(_ext.extension(), "kv_splice_cpu")), reason="rapo_fast._C without kv_splice"
)

LAYERS, HEADS, D, B, S = 2, 2, 16, 3, 12


def _inputs(dtype=torch.float32, paged=False, interleaved=False):
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(LAYERS, 10, HEADS, D, generator=g).to(dtype)
    v_pool = torch.randn(LAYERS, 10, HEADS, D, generator=g).to(dtype)
    # (pool offset, tokens, batch row, slot, rope delta)
    requests = torch.tensor([[0, 4, 0, 2, 2], [4, 3, 2, 0, 5], [7, 3, 1, 5, 9]], dtype=torch.int64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12))  # partial rotary: 12 of 16
    if paged:
        bs, nb = 4, 10
        keys = [torch.randn(nb, bs, HEADS, D, generator=g).to(dtype) for _ in range(LAYERS)]
        values = [torch.randn(nb, bs, HEADS, D, generator=g).to(dtype) for _ in range(LAYERS)]
        block_table = torch.tensor([[3, 1, 7], [0, 9, 2], [5, 4, 6]], dtype=torch.int32)
    else:
        keys = [torch.randn(B, HEADS, S, D, generator=g).to(dtype) for _ in range(LAYERS)]
        values = [torch.randn(B, HEADS, S, D, generator=g).to(dtype) for _ in range(LAYERS)]
        block_table = None
    return keys, values, k_pool, v_pool, requests, inv_freq, block_table, interleaved, 4


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_opcheck(paged, interleaved):
    torch.library.opcheck(torch.ops.rapo_fast.kv_splice_.default, _inputs(paged=paged, interleaved=interleaved))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph_matches_eager(paged, dtype):
    def step(keys, values, k_pool, v_pool, requests, inv_freq, block_table):
        # Ops around the splice so that the compiled graph is more than the op alone.
        kv_splice_(keys, values, k_pool * 1, v_pool, requests, inv_freq, block_table, False, 4)
        return keys[0].float().sum() + values[-1].float().sum()

    eager = _inputs(dtype=dtype, paged=paged)
    comp = _inputs(dtype=dtype, paged=paged)
    torch._dynamo.reset()
    out_e = step(*eager[:7])
    out_c = torch.compile(step, fullgraph=True)(*comp[:7])
    for a, b in zip(eager[0] + eager[1], comp[0] + comp[1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(out_c, out_e)


def _refused(err, match, *, request, block_table=None, **change):
    """The op on _inputs with `request` after a good one (and `change`d keys/values) raises err and writes nothing."""
    keys, values, k_pool, v_pool, _, inv, _, _, _ = _inputs(paged=block_table is not None)
    keys, values = change.get("keys", keys), change.get("values", values)
    before = [t.clone() for t in keys + values]
    requests = torch.tensor([[0, 2, 1, 0, 0], request], dtype=torch.int64)
    with pytest.raises(err, match=match):
        kv_splice_(keys, values, k_pool, v_pool, requests, inv, block_table, False, 4)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, before)), "a refused call wrote"


# (pool offset, tokens, batch row, slot, rope delta); pool of 10 tokens, caches [3, H, 12, D], max_tokens 4
@pytest.mark.parametrize(
    ("req", "match"),
    [
        ([0, 4, 10**6, 0, 0], "batch row"),
        ([0, 4, -1, 0, 0], "batch row"),
        ([10**6, 4, 0, 0, 0], "pool tokens"),
        ([-3, 4, 0, 0, 0], "pool tokens"),
        ([8, 4, 0, 0, 0], "pool tokens"),  # runs past the pool's end
        ([0, 4, 0, 10, 0], "slots"),  # runs past the cache's end
        ([0, 4, 0, -5, 0], "slots"),
        ([0, 9, 0, 0, 0], "max_tokens"),
        ([0, -1, 0, 0, 0], "token count"),
    ],
)
def test_hf_indices_out_of_range_raise(req, match):
    _refused(IndexError, match, request=req)


@pytest.mark.parametrize(
    ("req", "table", "match"),
    [
        ([0, 4, 5, 0, 0], [[0, 1], [2, 3]], "batch row"),
        ([0, 4, 0, 6, 0], [[0, 1], [2, 3]], "slots"),  # past the block table's 2 blocks of 4
        ([0, 4, 1, 2, 0], [[0, 1], [2, 10**6]], "block_table"),
        ([0, 4, 0, 0, 0], [[-7, 1], [2, 3]], "block_table"),
    ],
)
def test_paged_indices_out_of_range_raise(req, table, match):
    _refused(IndexError, match, request=req, block_table=torch.tensor(table, dtype=torch.int32))


def test_shape_mismatches_raise():
    few_heads = [torch.zeros(B, 1, S, D) for _ in range(LAYERS)]
    _refused(ValueError, "heads", request=[0, 2, 0, 0, 0], keys=few_heads, values=[t.clone() for t in few_heads])
    _refused(
        ValueError,
        "keys/values: expected every layer 4-d of one shape",
        request=[0, 2, 0, 0, 0],
        values=[torch.zeros(1, HEADS, S, D)] * LAYERS,
    )
    keys, values, k_pool, v_pool, _, inv, _, _, _ = _inputs()
    with pytest.raises(TypeError, match=r"requests: expected dtype in \{int64\}, got int32"):
        kv_splice_(keys, values, k_pool, v_pool, torch.tensor([[0, 2, 0, 0, 0]]).int(), inv, None, False, 4)
