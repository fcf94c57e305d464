"""Tests of `splice_kv` backends against the reference, on HF-layout and paged caches, and of its argument checks.

Checks: the C++ CPU backend equals the float64 reference within the tolerance rule of docs/testing.md (rule 1), for
fp32/fp16/bf16, both pair layouts, partial rotary, GQA, odd head dims, many requests per call, strided (cropped) caches
and paged block tables; values are copied bit-exactly and nothing outside the target slots is written; StepKVStore
add/get/evict/grow; bad requests (out of range, overlapping, float or bool integers, paged slots shared by two writes)
raise ValueError/TypeError before any write. Not here: models (tests/kv/test_kv_splice_hf.py), the CUDA kernel
(tests/kv/test_kv_splice_gpu.py), the op called directly (test_kv_splice_op.py), fuzzed requests
(tests/fuzz/test_fuzz_kv.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_within_ref_error
from transformers import DynamicCache

from rapo_fast import _ext
from rapo_fast.kv.splice import PagedKVCache, RopeSpec, StepKVStore, splice_kv
from rapo_fast.reference.kv_splice import rotate_keys_ref

needs_ext = pytest.mark.skipif(not _ext.has_extension(), reason="rapo_fast._C not built")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _store(n_layers, heads, d, dtype, lengths, capacity=8):
    st_ = StepKVStore(n_layers, heads, d, dtype=dtype, capacity_tokens=capacity)
    ks = [torch.randn(n_layers, n, heads, d).to(dtype) for n in lengths]
    vs = [torch.randn(n_layers, n, heads, d).to(dtype) for n in lengths]
    st_.add(list(range(100, 100 + len(lengths))), ks, vs)
    return st_, ks, vs


def _dyn_cache(n_layers, b, heads, s, d, dtype):
    return DynamicCache(
        ddp_cache_data=[
            (torch.randn(b, heads, s, d).to(dtype), torch.randn(b, heads, s, d).to(dtype)) for _ in range(n_layers)
        ]
    )


def _expected_hf(before, ks, vs, reqs, rope, pids, dtype64=False):
    """Expected per-layer keys/values of an HF cache after the requests, built with the reference rotation."""
    out_k = [k.clone().double() if dtype64 else k.clone() for k in before[0]]
    out_v = [v.clone() for v in before[1]]
    for pid, row, pos in reqs:
        i = pids.index(pid)
        n = ks[i].shape[1]
        for layer in range(len(out_k)):
            src = ks[i][layer].double() if dtype64 else ks[i][layer]
            k = rotate_keys_ref(
                src,
                pos,
                rope.inv_freq,
                rotary_dim=rope.rotary_dim,
                layout=rope.layout,
                compute_dtype=torch.float64 if dtype64 else torch.float32,
            )
            out_k[layer][row, :, pos : pos + n] = k.transpose(0, 1)
            out_v[layer][row, :, pos : pos + n] = vs[i][layer].transpose(0, 1)
    return out_k, out_v


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("d,rd,heads", [(16, 16, 2), (24, 8, 3), (59, 58, 1), (64, 32, 4)])
def test_cpu_backend_hf_layout(dtype, layout, d, rd, heads):
    n_layers, b, s = 3, 4, 40
    lengths = [5, 1, 13, 7]
    store, ks, vs = _store(n_layers, heads, d, dtype, lengths)
    rope = RopeSpec.from_theta(d, 1000.0, rotary_dim=rd, layout=layout)
    pids = list(range(100, 104))
    reqs = [(100, 0, 3), (101, 0, 9), (102, 1, 20), (103, 3, 33), (100, 2, 0)]
    cache = _dyn_cache(n_layers, b, heads, s, d, dtype)
    before = ([layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers])
    new_len = splice_kv(cache, store, reqs, rope, backend="cpu")
    assert new_len == s == cache.get_seq_length()
    want_k, want_v = _expected_hf(before, ks, vs, reqs, rope, pids)
    want64, _ = _expected_hf(before, ks, vs, reqs, rope, pids, dtype64=True)
    for layer in range(n_layers):
        assert_within_ref_error(cache.layers[layer].keys, want_k[layer], want64[layer], dtype, name=f"keys {layer}")
        assert torch.equal(cache.layers[layer].values, want_v[layer]), "values must be copied bit-exactly"


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_backend_equals_reference_backend_paged(dtype):
    n_layers, heads, d, bs, nb = 2, 2, 32, 4, 24
    store, _, _ = _store(n_layers, heads, d, dtype, [6, 9, 3])
    rope = RopeSpec.from_theta(d, 10000.0, rotary_dim=16, layout="rotate_half")
    table = torch.randperm(nb)[:18].view(3, 6).to(torch.int32)
    reqs = [(100, 0, 2), (101, 1, 5), (102, 2, 21), (102, 0, 8)]
    base_k = torch.randn(n_layers, nb, bs, heads, d).to(dtype)
    base_v = torch.randn(n_layers, nb, bs, heads, d).to(dtype)
    out = {}
    for backend in ("reference", "cpu"):
        cache = PagedKVCache(list(base_k.clone()), list(base_v.clone()), table)
        assert splice_kv(cache, store, reqs, rope, backend=backend, rope_positions=[2, 5, 1000, 8]) == 0
        out[backend] = (torch.stack(list(cache.keys)), torch.stack(list(cache.values)))
    store64 = StepKVStore(n_layers, heads, d, dtype=torch.float32)
    for pid in (100, 101, 102):
        k, v = store.get(pid)
        store64.add([pid], [k.float()], [v.float()])
    # fp32 copies (clone: .float() of an fp32 tensor is the tensor itself) hold the high-precision answer
    ref64 = PagedKVCache([k.float().clone() for k in base_k], [v.float().clone() for v in base_v], table)
    splice_kv(ref64, store64, reqs, rope, backend="reference", rope_positions=[2, 5, 1000, 8])
    assert_within_ref_error(out["cpu"][0], out["reference"][0], torch.stack(list(ref64.keys)), dtype, name="paged K")
    assert torch.equal(out["cpu"][1], out["reference"][1])
    assert not torch.equal(out["cpu"][1], base_v), "the splice wrote nothing"


@needs_ext
def test_strided_cache_and_growth():
    # A cropped DynamicCache holds views with the old strides; splicing past its end grows it.
    dtype, d = torch.bfloat16, 16
    store, ks, vs = _store(2, 2, d, dtype, [6])
    cache = _dyn_cache(2, 2, 2, 12, d, dtype)
    cache.crop(-5)  # transformers 5.x: a negative count of tokens to drop
    assert not cache.layers[0].keys.is_contiguous()
    rope = RopeSpec.from_theta(d)
    before = ([layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers])
    assert splice_kv(cache, store, [(100, 1, 7)], rope, backend="cpu") == 13
    assert cache.get_seq_length() == 13
    for layer in range(2):
        assert torch.equal(cache.layers[layer].keys[:, :, :7], before[0][layer])
        assert torch.equal(cache.layers[layer].values[1, :, 7:], vs[0][layer].transpose(0, 1))


def test_store_add_get_evict_and_grow():
    store = StepKVStore(2, 1, 4, dtype=torch.float32, capacity_tokens=4)
    segs = {pid: torch.randn(2, n, 1, 4) for pid, n in [(1, 3), (2, 5), (3, 2)]}
    store.add(list(segs), list(segs.values()), [s * 2 for s in segs.values()], tokens=[[1] * 3, [2] * 5, [3] * 2])
    # what get returns after adds, evictions and replacements: tests/fuzz/test_fuzz_kv.py
    assert store.capacity_tokens >= 10 and len(store) == 3 and store.tokens(2) == [2] * 5
    store.evict([2, 99])
    assert 2 not in store and store.tokens(2) is None
    store.add([4], [torch.ones(2, 4, 1, 4)], [torch.ones(2, 4, 1, 4)])  # reuses the freed range first-fit
    assert store.locate(4)[0] == store.locate(1)[1] + store.locate(1)[0] or store.locate(4)[1] == 4
    with pytest.raises(ValueError, match="already stored"):
        store.add([1], [segs[1]], [segs[1]])
    with pytest.raises(ValueError, match="num_layers"):
        store.add([5], [torch.randn(3, 2, 1, 4)], [torch.randn(3, 2, 1, 4)])


def test_store_state_dict_round_trip(tmp_path):
    store = StepKVStore(2, 1, 4, dtype=torch.bfloat16, capacity_tokens=4)
    segs = {pid: torch.randn(2, n, 1, 4, dtype=torch.bfloat16) for pid, n in [(1, 3), (2, 5), (3, 2), (7, 4)]}
    tokens = [[p] * s.shape[1] for p, s in segs.items()]
    store.add(list(segs), list(segs.values()), [-s for s in segs.values()], tokens=tokens)
    store.evict([2])  # a hole: the restored free list must keep it
    torch.save(store.state_dict(), tmp_path / "kv.pt")
    back = StepKVStore(2, 1, 4, dtype=torch.bfloat16)
    back.load_state_dict(torch.load(tmp_path / "kv.pt", weights_only=True))
    assert back.payload_ids() == store.payload_ids() == [1, 3, 7]
    for pid in (1, 3, 7):
        assert back.locate(pid) == store.locate(pid) and back.tokens(pid) == [pid] * segs[pid].shape[1]
        assert torch.equal(back.get(pid)[0], segs[pid]) and torch.equal(back.get(pid)[1], -segs[pid])
    # both stores place the next payload in the same place (same free list), and the restored one still grows
    new = [torch.ones(2, 5, 1, 4, dtype=torch.bfloat16)] * 2
    store.add([9], new[:1], new[1:])
    back.add([9], new[:1], new[1:])
    assert back.locate(9) == store.locate(9)
    back.add([10], [torch.ones(2, 40, 1, 4, dtype=torch.bfloat16)], [torch.ones(2, 40, 1, 4, dtype=torch.bfloat16)])
    assert back.capacity_tokens >= 40 and torch.equal(back.get(7)[0], segs[7])
    with pytest.raises(ValueError, match="head dim"):
        StepKVStore(2, 1, 8, dtype=torch.bfloat16).load_state_dict(store.state_dict())
    with pytest.raises(ValueError, match="float16"):
        StepKVStore(2, 1, 4, dtype=torch.float16).load_state_dict(store.state_dict())


def _bad_setup():
    store, _, _ = _store(2, 2, 16, torch.float16, [4, 6])
    return store, _dyn_cache(2, 3, 2, 10, 16, torch.float16), RopeSpec.from_theta(16)


@pytest.mark.parametrize(
    "reqs,kw,exc,match",
    [
        ([(7, 0, 0)], {}, ValueError, "payload_id: expected one in the StepKVStore"),
        ([(100, 3, 0)], {}, ValueError, r"batch_row: expected an int in \[0, 3\), got 3"),
        ([(100, -1, 0)], {}, ValueError, "batch_row: expected an int in"),
        ([(100, 0, 11)], {}, ValueError, "position: expected <= the cache's length"),
        ([(100, 0, -2)], {}, ValueError, r"requests\[0\] position: expected >= 0"),
        ([(100, 0, 2), (101, 0, 4)], {}, ValueError, "overlap"),
        ([(100, 0, 2)], {"lengths": [9]}, ValueError, "lengths"),
        ([(100, 0, 2, 5)], {}, ValueError, "payload_id, batch_row, position"),
    ],
)
def test_bad_requests_raise_before_writing(reqs, kw, exc, match):
    store, cache, rope = _bad_setup()
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(exc, match=match):
        splice_kv(cache, store, reqs, rope, **kw)
    assert all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before))


def test_mismatches_raise():
    store, cache, rope = _bad_setup()
    with pytest.raises(ValueError, match="head_dim"):
        splice_kv(cache, store, [(100, 0, 0)], RopeSpec.from_theta(32))
    with pytest.raises(TypeError, match="RopeSpec"):
        splice_kv(cache, store, [(100, 0, 0)], {"theta": 1e4})
    bf = _dyn_cache(2, 3, 2, 10, 16, torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        splice_kv(bf, store, [(100, 0, 0)], rope)
    heads = _dyn_cache(2, 3, 4, 10, 16, torch.float16)
    with pytest.raises(ValueError, match="KV heads"):
        splice_kv(heads, store, [(100, 0, 0)], rope)
    with pytest.raises(ValueError, match="layers"):
        splice_kv(_dyn_cache(3, 3, 2, 10, 16, torch.float16), store, [(100, 0, 0)], rope)
    with pytest.raises(TypeError, match="transformers Cache"):
        splice_kv([torch.zeros(1)], store, [(100, 0, 0)], rope)
    paged = PagedKVCache(
        [torch.zeros(4, 4, 2, 16, dtype=torch.float16)] * 2,
        [torch.zeros(4, 4, 2, 16, dtype=torch.float16)] * 2,
        torch.tensor([[0, 1], [2, 9]]),
    )
    with pytest.raises(ValueError, match="expected slots within the block table"):
        splice_kv(paged, store, [(101, 0, 4)], rope)
    with pytest.raises(ValueError, match=r"block_table\[1\]: expected block ids in \[0, 4\)"):
        splice_kv(paged, store, [(100, 1, 1)], rope)


@pytest.mark.parametrize(
    ("reqs", "kw", "match"),
    [
        ([(100, 0, 2.7)], {}, r"requests\[0\] position"),
        ([(100, 0, False)], {}, r"requests\[0\] position"),
        ([(100.0, 0, 2)], {}, r"requests\[0\] payload_id"),
        ([(True, 0, 2)], {}, r"requests\[0\] payload_id"),
        ([(100, 1.0, 2)], {}, r"requests\[0\] batch_row"),
        ([(100, True, 2)], {}, r"requests\[0\] batch_row"),
        (torch.tensor([[100.0, 0.0, 2.5]]), {}, "integer tensor"),
        ([(100, 0, 2)], {"lengths": [2.9]}, r"lengths\[0\]"),
        ([(100, 0, 2)], {"lengths": [True]}, r"lengths\[0\]"),
        ([(100, 0, 2)], {"lengths": [torch.tensor(2.0)]}, r"lengths\[0\]"),
        ([(100, 0, 2)], {"rope_positions": [5.5]}, r"rope_positions\[0\]"),
    ],
)
def test_float_or_bool_integer_arguments_are_refused(reqs, kw, match):
    store, cache, rope = _bad_setup()
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(TypeError, match=match):
        splice_kv(cache, store, reqs, rope, **kw)
    assert all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before))


def test_integer_types_are_accepted():
    import numpy as np

    store, cache, rope = _bad_setup()
    reqs = [(np.int64(100), torch.tensor(0), 2), (101, 1, np.int32(3))]
    assert splice_kv(cache, store, reqs, rope, lengths=[torch.tensor(3), 4], rope_positions=[2, np.int64(5)]) == 10
    assert splice_kv(cache, store, torch.tensor([[100, 2, 1]], dtype=torch.int32), rope) == 10


def _paged(table):
    ks = [torch.zeros(4, 4, 2, 16, dtype=torch.float16) for _ in range(2)]
    vs = [torch.zeros(4, 4, 2, 16, dtype=torch.float16) for _ in range(2)]
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
    store, _, rope = _bad_setup()
    cache = _paged(table)
    with pytest.raises(ValueError, match="same physical slots"):
        splice_kv(cache, store, reqs, rope, lengths=[4, 4])
    assert all(not k.any() for k in cache.keys)


def test_paged_shared_block_with_disjoint_slots_is_accepted():
    store, _, rope = _bad_setup()
    cache = _paged([[0, 1], [0, 3]])  # rows 0 and 1 share block 0 but write disjoint slots of it
    splice_kv(cache, store, [(100, 0, 4), (101, 1, 0)], rope, lengths=[4, 2])
    assert cache.keys[0][0, :2].any() and not cache.keys[0][0, 2:].any()
