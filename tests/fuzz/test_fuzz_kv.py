"""Property tests of the K/V entry points: `StepKVStore` and `splice_kv` (hypothesis; budget in
tests/helpers/strategies.py).

Properties: after any sequence of adds and evictions the store returns exactly what was added last for each live id,
and state_dict/load_state_dict round-trips it; a state whose offsets leave the pools is refused; an add mixing good
and bad arguments (negative, past-int64, bool and float ids, NaN/inf K/V, negative or non-int token ids) is refused
with ValueError/TypeError and leaves the store as it was, and whatever add accepted, load_state_dict accepts;
splice_kv with the compiled CPU backend equals the reference backend (values bit-exact, keys within the tolerance rule
of the float64 rotation, docs/testing.md rule 1) and writes nothing outside the target slots; an out-of-range request
gets a ValueError before any write. Not here: models and RoPE variants (tests/kv/).
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


# ---- StepKVStore.add is all or nothing, and its loader accepts what it accepted --------------------------------------


def _kv(n: int, bad: str | None = None) -> torch.Tensor:
    t = torch.randn(L, n, H, D)
    if bad == "nan" and n:
        t[0, 0, 0, 0] = float("nan")
    if bad == "inf" and n:
        t[-1, -1, -1, -1] = float("inf")
    if bad == "big" and n:  # finite in fp32, inf once cast to the store's fp16
        t[0, 0, 0, 0] = 1e6
    return t


_pid = st.one_of(
    st.integers(0, 20), st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=True), st.just(3.0)
)
_tok = st.one_of(st.integers(0, 1000), st.integers(-5, -1), st.floats(0, 5), st.booleans(), st.just(2**70))


@st.composite
def _store_add_args(draw):
    n = draw(st.integers(0, 3))
    pids = draw(st.lists(st.one_of(st.integers(0, 20), _pid), min_size=n, max_size=n))
    lens = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    bads = draw(st.lists(st.sampled_from([None, None, None, "nan", "inf", "big"]), min_size=n, max_size=n))
    keys = [_kv(m, b) for m, b in zip(lens, bads)]
    values = [_kv(m, draw(st.sampled_from([None, None, "nan"]))) for m in lens]
    tokens = draw(
        st.one_of(
            st.none(),
            st.tuples(*[st.lists(st.one_of(st.integers(0, 99), _tok), min_size=m, max_size=m) for m in lens]).map(list),
        )
    )
    return pids, keys, values, tokens, draw(st.booleans())


def _same_state(a: dict, b: dict) -> bool:
    """Two StepKVStore states hold the same payloads in the same places."""
    return (
        a["where"] == b["where"]
        and a["tokens"] == b["tokens"]
        and a["capacity_tokens"] == b["capacity_tokens"]
        and torch.equal(a["keys"], b["keys"])
        and torch.equal(a["values"], b["values"])
    )


@fuzz_settings(40)
@given(calls=st.lists(_store_add_args(), min_size=1, max_size=4))
def test_kv_store_add_all_or_nothing(calls):
    torch.manual_seed(0)
    store = StepKVStore(L, H, D, dtype=torch.float16, capacity_tokens=4)
    for pids, keys, values, tokens, replace in calls:
        before = store.state_dict()
        try:
            store.add(pids, keys, values, tokens=tokens, replace=replace)
        except (ValueError, TypeError):
            assert _same_state(store.state_dict(), before)
        # whatever add accepted, the loader accepts
        fresh = StepKVStore(L, H, D, dtype=torch.float16)
        fresh.load_state_dict(store.state_dict())
        assert _same_state(fresh.state_dict(), store.state_dict())


def test_kv_store_add_refuses_what_load_refuses():
    torch.manual_seed(0)
    store = StepKVStore(L, H, D, dtype=torch.float32)
    k = torch.randn(L, 2, H, D)
    for args, kw, err, name in (
        (([1.7], [k], [k]), {}, TypeError, r"payload_ids\[0\]"),
        (([True], [k], [k]), {}, TypeError, r"payload_ids\[0\]"),
        (([-1], [k], [k]), {}, ValueError, r"payload_ids\[0\]"),
        (([2**64], [k], [k]), {}, ValueError, r"payload_ids\[0\]"),
        (([1], [_kv(2, "nan")], [k]), {}, ValueError, r"keys\[0\]"),
        (([1], [k], [_kv(2, "inf")]), {}, ValueError, r"values\[0\]"),
        (([1], [k], [k]), {"tokens": [[3, -1]]}, ValueError, r"tokens\[0\]\[1\]"),
        (([1], [k], [k]), {"tokens": [[3, 2.0]]}, TypeError, r"tokens\[0\]\[1\]"),
    ):
        with pytest.raises(err, match=name):
            store.add(*args, **kw)
        assert len(store) == 0
