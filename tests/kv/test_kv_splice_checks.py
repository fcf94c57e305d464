"""Regression tests of the KV splice's input checks: the registered op `rapo_fast::kv_splice_` called
directly refuses every index outside the pools, the caches or the block table (IndexError / ValueError from the
extension, which checks them itself, not a segfault); splice_kv refuses float (truncatable) integer arguments with a
TypeError naming the argument, and paged caches whose written slots share one physical slot.

Not here: splice_kv's other argument checks and numerics (tests/kv/test_kv_splice.py), the op's opcheck and
torch.compile (tests/kv/test_kv_splice_op.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from rapo_fast import _ext
from rapo_fast.kv.splice import PagedKVCache, RopeSpec, StepKVStore, kv_splice_, splice_kv

needs_ext = pytest.mark.skipif(
    not (_ext.has_extension() and hasattr(_ext.extension(), "kv_splice_cpu")), reason="rapo_fast._C without kv_splice"
)

LAYERS, HEADS, D, B, S, POOL = 2, 2, 16, 3, 12, 10


def _op_args(paged=False):
    k_pool = torch.randn(LAYERS, POOL, HEADS, D)
    v_pool = torch.randn(LAYERS, POOL, HEADS, D)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    if paged:
        keys = [torch.zeros(4, 4, HEADS, D) for _ in range(LAYERS)]
        values = [torch.zeros(4, 4, HEADS, D) for _ in range(LAYERS)]
        bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    else:
        keys = [torch.zeros(B, HEADS, S, D) for _ in range(LAYERS)]
        values = [torch.zeros(B, HEADS, S, D) for _ in range(LAYERS)]
        bt = None
    return keys, values, k_pool, v_pool, inv_freq, bt


# (pool offset, tokens, batch row, slot, rope delta); max_tokens 4
HF_BAD = [
    ([0, 4, 10**6, 0, 0], "batch row"),
    ([0, 4, -1, 0, 0], "batch row"),
    ([10**6, 4, 0, 0, 0], "pool tokens"),
    ([-3, 4, 0, 0, 0], "pool tokens"),
    ([8, 4, 0, 0, 0], "pool tokens"),  # runs past the pool's end
    ([0, 4, 0, 10, 0], "slots"),  # runs past the cache's end
    ([0, 4, 0, -5, 0], "slots"),
    ([0, 9, 0, 0, 0], "max_tokens"),
    ([0, -1, 0, 0, 0], "token count"),
]


@needs_ext
@pytest.mark.parametrize(("req", "match"), HF_BAD)
def test_op_direct_hf_indices_out_of_range_raise(req, match):
    keys, values, k_pool, v_pool, inv, _ = _op_args()
    before = [k.clone() for k in keys]
    good = [0, 2, 1, 0, 0]
    requests = torch.tensor([good, req], dtype=torch.int64)
    with pytest.raises(IndexError, match=match):
        kv_splice_(keys, values, k_pool, v_pool, requests, inv, None, False, 4)
    assert all(torch.equal(a, b) for a, b in zip(keys, before)), "a refused call must write nothing"


@needs_ext
@pytest.mark.parametrize(
    ("req", "table", "match"),
    [
        ([0, 4, 5, 0, 0], [[0, 1], [2, 3]], "batch row"),
        ([0, 4, 0, 6, 0], [[0, 1], [2, 3]], "slots"),  # past the block table's 2 blocks of 4
        ([0, 4, 1, 2, 0], [[0, 1], [2, 10**6]], "block_table"),
        ([0, 4, 0, 0, 0], [[-7, 1], [2, 3]], "block_table"),
    ],
)
def test_op_direct_paged_indices_out_of_range_raise(req, table, match):
    keys, values, k_pool, v_pool, inv, _ = _op_args(paged=True)
    bt = torch.tensor(table, dtype=torch.int32)
    with pytest.raises(IndexError, match=match):
        kv_splice_(keys, values, k_pool, v_pool, torch.tensor([req]), inv, bt, False, 4)
    assert all(not k.any() for k in keys)


@needs_ext
def test_op_direct_shape_mismatches_raise():
    keys, values, k_pool, v_pool, inv, _ = _op_args()
    req = torch.tensor([[0, 2, 0, 0, 0]])
    few_heads = [torch.zeros(B, 1, S, D) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="heads"):
        kv_splice_(few_heads, [torch.zeros(B, 1, S, D)] * LAYERS, k_pool, v_pool, req, inv, None, False, 4)
    small_values = [torch.zeros(1, HEADS, S, D) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="share one 4-d shape"):
        kv_splice_(keys, small_values, k_pool, v_pool, req, inv, None, False, 4)
    with pytest.raises(ValueError, match="requests"):
        kv_splice_(keys, values, k_pool, v_pool, req.int(), inv, None, False, 4)


def _setup():
    store = StepKVStore(2, 2, 16, dtype=torch.float32, capacity_tokens=16)
    store.add([100, 101], [torch.randn(2, 4, 2, 16)] * 2, [torch.randn(2, 4, 2, 16)] * 2)
    cache = DynamicCache(
        ddp_cache_data=[(torch.zeros(3, 2, 10, 16), torch.zeros(3, 2, 10, 16)) for _ in range(2)],
    )
    return store, cache, RopeSpec.from_theta(16)


@pytest.mark.parametrize(
    ("reqs", "kw", "match"),
    [
        ([(100, 0, 2.7)], {}, r"requests\[0\] position"),
        ([(100.0, 0, 2)], {}, r"requests\[0\] payload_id"),
        ([(100, 1.0, 2)], {}, r"requests\[0\] batch_row"),
        ([(100, True, 2)], {}, r"requests\[0\] batch_row"),
        (torch.tensor([[100.0, 0.0, 2.5]]), {}, "integer tensor"),
        ([(100, 0, 2)], {"lengths": [2.9]}, r"lengths\[0\]"),
        ([(100, 0, 2)], {"lengths": [torch.tensor(2.0)]}, r"lengths\[0\]"),
        ([(100, 0, 2)], {"rope_positions": [5.5]}, r"rope_positions\[0\]"),
    ],
)
def test_float_integer_arguments_are_refused(reqs, kw, match):
    store, cache, rope = _setup()
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(TypeError, match=match):
        splice_kv(cache, store, reqs, rope, **kw)
    assert all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before))


def test_integer_types_still_accepted():
    store, cache, rope = _setup()
    import numpy as np

    reqs = [(np.int64(100), torch.tensor(0), 2), (101, 1, np.int32(3))]
    assert splice_kv(cache, store, reqs, rope, lengths=[torch.tensor(3), 4], rope_positions=[2, np.int64(5)]) == 10
    assert splice_kv(cache, store, torch.tensor([[100, 2, 1]], dtype=torch.int32), rope) == 10


def _paged(table):
    ks = [torch.zeros(4, 4, 2, 16) for _ in range(2)]
    vs = [torch.zeros(4, 4, 2, 16) for _ in range(2)]
    return PagedKVCache(ks, vs, torch.tensor(table, dtype=torch.int32))


@pytest.mark.parametrize(
    ("table", "reqs"),
    [
        ([[0, 1], [0, 3]], [(100, 0, 0), (101, 1, 1)]),  # rows 0 and 1 share physical block 0, slots overlap
        ([[2, 2], [1, 3]], [(100, 0, 0), (101, 0, 4)]),  # row 0 maps logical blocks 0 and 1 to physical block 2
        ([[0, 1, 3], [2, 1, 3]], [(100, 0, 4), (101, 1, 6)]),  # block 1 shared, offsets [0, 4) and [2, 4) overlap
    ],
)
def test_paged_shared_physical_slots_are_refused(table, reqs):
    store, _, rope = _setup()
    cache = _paged(table)
    with pytest.raises(ValueError, match="same physical slots"):
        splice_kv(cache, store, reqs, rope)
    assert all(not k.any() for k in cache.keys)


def test_paged_shared_block_with_disjoint_slots_is_accepted():
    store, _, rope = _setup()
    cache = _paged([[0, 1], [0, 3]])  # rows 0 and 1 share block 0 but write disjoint slots of it
    splice_kv(cache, store, [(100, 0, 4), (101, 1, 0)], rope, lengths=[4, 2])
    assert cache.keys[0][0, :2].any() and not cache.keys[0][0, 2:].any()
