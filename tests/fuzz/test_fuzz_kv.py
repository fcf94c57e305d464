"""Property tests of the K/V entry points: `StepKVStore` and `splice_kv` (hypothesis; budget in
tests/helpers/strategies.py).

Properties: after any sequence of adds and evictions the store returns exactly what was added last for each live id,
and state_dict/load_state_dict round-trips it; a state whose offsets leave the pools is refused; splice_kv with the
compiled CPU backend equals the reference backend (values bit-exact, keys within the tolerance rule of the float64
rotation, docs/testing.md rule 1) and writes nothing outside the target slots; an out-of-range request gets a
ValueError before any write. Not here: models and RoPE variants (tests/kv/).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_within_ref_error
from helpers.strategies import float_dtypes, fuzz_settings, seeds
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

from rapo_fast import RopeSpec, StepKVStore, _ext, splice_kv

needs_ext = pytest.mark.skipif(not _ext.has_extension(), reason="rapo_fast._C not built")
L, H, D = 2, 2, 8  # layers, KV heads, head dim: tiny, the properties do not depend on size


def _segment(g: torch.Generator, n: int, dtype) -> torch.Tensor:
    return torch.randn(L, n, H, D, generator=g).to(dtype)


@fuzz_settings(30)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "evict"]), st.integers(0, 5), st.integers(1, 7)), max_size=12),
    dtype=float_dtypes,
    cap=st.integers(1, 8),
    seed=seeds,
)
def test_store_holds_what_was_added_and_round_trips(ops, dtype, cap, seed):
    g = torch.Generator().manual_seed(seed)
    store = StepKVStore(L, H, D, dtype=dtype, capacity_tokens=cap)
    model: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
    for op, pid, n in ops:
        if op == "add":
            k, v = _segment(g, n, dtype), _segment(g, n, dtype)
            toks = list(range(n))
            store.add([pid], [k], [v], tokens=[toks], replace=True)
            model[pid] = (k, v, toks)
        else:
            store.evict([pid])
            model.pop(pid, None)
    back = StepKVStore(L, H, D, dtype=dtype, capacity_tokens=1)
    back.load_state_dict(store.state_dict())
    for s in (store, back):
        assert sorted(s.payload_ids()) == sorted(model)
        for pid, (k, v, toks) in model.items():
            gk, gv = s.get(pid)
            assert torch.equal(gk, k) and torch.equal(gv, v) and s.tokens(pid) == toks
        offsets = sorted(s.locate(pid) for pid in model)  # live ranges never overlap
        assert all(a[0] + a[1] <= b[0] for a, b in zip(offsets, offsets[1:]))


@fuzz_settings(30)
@given(field=st.sampled_from(["offset", "length"]), value=st.integers(max_value=-1) | st.integers(min_value=10))
def test_store_state_with_offsets_outside_the_pools_is_refused(field, value):
    store = StepKVStore(L, H, D, dtype=torch.float32, capacity_tokens=4)
    store.add([7], [torch.randn(L, 3, H, D)], [torch.randn(L, 3, H, D)])
    state = store.state_dict()
    off, n = state["where"][7]
    state["where"] = {7: (value, n) if field == "offset" else (off, value)}
    with pytest.raises((ValueError, TypeError), match="where|offset|length"):
        StepKVStore(L, H, D, dtype=torch.float32).load_state_dict(state)


def _cache(g: torch.Generator, B: int, S: int, dtype) -> DynamicCache:
    shape = (B, H, S, D)
    layers = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)) for _ in range(L)]
    return DynamicCache(ddp_cache_data=layers)


@st.composite
def splice_cases(draw):
    """A store of 1-3 segments, an HF cache [B, H, S, D] per layer and non-overlapping in-range requests."""
    dtype = draw(float_dtypes)
    g = torch.Generator().manual_seed(draw(seeds))
    lens = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    store = StepKVStore(L, H, D, dtype=dtype, capacity_tokens=4)
    pids = list(range(100, 100 + len(lens)))
    store.add(pids, [_segment(g, n, dtype) for n in lens], [_segment(g, n, dtype) for n in lens])
    B, S = draw(st.integers(1, 3)), 12
    reqs, used = [], {}
    for _ in range(draw(st.integers(1, 4))):
        i, row, pos = draw(st.integers(0, len(lens) - 1)), draw(st.integers(0, B - 1)), draw(st.integers(0, 7))
        if all(pos + lens[i] <= a or b <= pos for a, b in used.get(row, [])):
            reqs.append((pids[i], row, pos))
            used.setdefault(row, []).append((pos, pos + lens[i]))
    layout = draw(st.sampled_from(["rotate_half", "interleaved"]))
    rope = RopeSpec.from_theta(D, draw(st.sampled_from([100.0, 10000.0])), layout=layout)
    return store, _cache(g, B, S, dtype), reqs, rope, dtype


@needs_ext
@fuzz_settings(30)
@given(case=splice_cases())
def test_splice_cpu_backend_equals_reference(case):
    store, cache, reqs, rope, dtype = case
    copy = DynamicCache(ddp_cache_data=[(lay.keys.clone(), lay.values.clone()) for lay in cache.layers])
    as32 = StepKVStore(L, H, D, dtype=torch.float32, capacity_tokens=4)
    for pid in store.payload_ids():
        k, v = store.get(pid)
        as32.add([pid], [k.float()], [v.float()])
    ref64 = DynamicCache(ddp_cache_data=[(lay.keys.float(), lay.values.float()) for lay in cache.layers])
    n1 = splice_kv(cache, store, reqs, rope, backend="cpu")
    n2 = splice_kv(copy, store, reqs, rope, backend="reference")
    splice_kv(ref64, as32, reqs, rope, backend="reference")
    assert n1 == n2
    for a, b, e in zip(cache.layers, copy.layers, ref64.layers):
        assert torch.equal(a.values, b.values), "values must be copied bit-exactly"
        assert torch.isfinite(a.keys.float()).all()
        assert_within_ref_error(a.keys, b.keys, e.keys, dtype, name="spliced keys")


@fuzz_settings(30)
@given(
    pid=st.integers(-3, 110),
    row=st.integers(-2, 4),
    pos=st.integers(-3, 14),
    n=st.integers(-2, 8),
)
def test_splice_bad_request_is_refused_before_any_write(pid, row, pos, n):
    g = torch.Generator().manual_seed(0)
    store = StepKVStore(L, H, D, dtype=torch.float32, capacity_tokens=4)
    segs = [_segment(g, n, torch.float32) for n in (3, 5, 3, 5)]
    store.add([100, 101], segs[:2], segs[2:])
    cache = _cache(g, 3, 10, torch.float32)
    before = [lay.keys.clone() for lay in cache.layers]
    rope = RopeSpec.from_theta(D)
    valid = pid in (100, 101) and 0 <= row < 3 and 0 <= pos <= 10 and 0 <= n <= store.locate(pid)[1]
    if valid:
        out = splice_kv(cache, store, [(pid, row, pos)], rope, lengths=[n])
        assert out == max(10, pos + n) == cache.get_seq_length()
    else:
        with pytest.raises(ValueError):
            splice_kv(cache, store, [(pid, row, pos)], rope, lengths=[n])
        assert all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before))
