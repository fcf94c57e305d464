"""Soak tests of the memory bound: every long-lived structure of StepTraces, its StepBuffer and its StepKVStore stays
within the buffer's capacity however many steps pass through (thousands of add/evict cycles past a small capacity).

What this is: per cycle, each structure counted directly (len of the payload table, of the K/V store's maps and free
list, the bytes of the pools and of the buffer's tensors) against the bound docs/retrieval.md ("Memory bounds") and
docs/kv_splice.md ("Memory bound") state; after the soak, searches and cached K/V compared with a brute-force
reference over the live steps, refresh_kv's work counted, and a save/load round trip that keeps exactly the live
state. What it is not: a measurement of the process's RSS (the structures are counted instead) or of speed.
"""

from __future__ import annotations

import json

import pytest
import torch

from rapo_fast import StepBuffer
from rapo_fast.demo.tasks import ChainArithmeticTask
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.kv.store import StepKVStore
from rapo_fast.retrieval.step_traces import StepTraces

D, CAP, N_OFF, BATCH, CYCLES = 8, 12, 4, 2, 1000


def _step(i: int) -> str:
    # lengths vary from step to step, so that freed K/V ranges come in sizes that do not fit the next segment
    return " ".join(["<think>"] + ["add 7"] * (1 + i % 5) + ["<tool> 7 + 7 </tool> <obs> 14 </obs>"])


def _tensor_bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _buffer_bytes(buf: StepBuffer) -> int:
    return _tensor_bytes(buf._keys, buf._aux, buf._payload, buf._group, buf._score, buf._seq, buf._pinned)


def _seg_len(tok, i: int) -> int:
    return len(tok.encode(f"<retrieve> {_step(i)} </retrieve>"))


def _token_kv(store: StepKVStore, pids: list[int], segs: list[list[int]]) -> None:
    """A segment's K/V made of its token ids (keys) and their negation (values), in place of a model's."""
    kv = [torch.tensor(s, dtype=torch.float32).view(1, -1, 1, 1).expand(1, -1, 1, 2) for s in segs]
    store.add(pids, kv, [-x for x in kv], tokens=segs, replace=True)


class _TokenKV(StepTraces):
    """StepTraces with _token_kv for K/V: the same store, eviction and refresh paths at a cost that lets the soak run
    thousands of cycles in seconds (the model's path is the `real` case below, with fewer cycles)."""

    def _store_kv(self, pids, segs):
        _token_kv(self.kv_store, pids, segs)


@pytest.fixture(scope="module")
def world():
    tok = ChainArithmeticTask().tokenizer()
    model = build_tiny_policy(tok.vocab_size, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, seed=0).eval()
    return tok, model


def _new_store(model, real: bool) -> StepKVStore:
    """An empty store of 8 tokens: for the model's K/V (real), else for _token_kv's."""
    if real:
        return StepKVStore.for_model(model, capacity_tokens=8)
    return StepKVStore(1, 1, 2, dtype=torch.float32, capacity_tokens=8)


def _traces(tok, model, eviction: str, real: bool) -> StepTraces:
    buf = StepBuffer(CAP, D, dtype=torch.float32, metric="cosine", eviction=eviction)
    store = _new_store(model, real)
    tr = (StepTraces if real else _TokenKV)(buf, lambda t: torch.zeros(len(t), D), tok, kv_store=store, model=model)
    # off-policy steps the way from_jsonl stores them: the first ids, pinned
    tr._add(torch.randn(N_OFF, D), [_step(i) for i in range(N_OFF)], [1 << 40] * N_OFF, [1.0] * N_OFF)
    tr.num_offpolicy = N_OFF
    tr.pin_offpolicy_steps()
    return tr


def _check_bounds(tr: StepTraces, buffer_bytes: int, max_tokens: int) -> None:
    """Every structure against its bound (docs/retrieval.md, "Memory bounds")."""
    store = tr.kv_store
    assert len(tr.buffer) <= CAP and _buffer_bytes(tr.buffer) <= buffer_bytes
    assert len(tr) == len(tr.payloads) <= CAP and len(store) <= CAP and len(store._tokens) <= CAP
    assert len(store._free) <= CAP + 1  # the gaps between the payloads
    # pools: at most max(initial capacity_tokens, 2 x the most tokens stored at once, counting a batch in flight)
    per_token = 2 * _tensor_bytes(store.keys_pool[:, :1])
    assert _tensor_bytes(store.keys_pool, store.values_pool) <= max(8, 2 * (CAP + BATCH) * max_tokens) * per_token


def _counted_refresh(tr: StepTraces, model) -> tuple[list[int], int]:
    """tr.refresh_kv(); returns (the payload ids whose K/V it stored, the model's forward passes)."""
    seen, calls = [], []
    add = tr.kv_store.add

    def counting(pids, *a, **kw):
        seen.extend(pids)
        return add(pids, *a, **kw)

    hook = model.register_forward_hook(lambda *a: calls.append(1))
    tr.kv_store.add = counting
    try:
        tr.refresh_kv()
    finally:
        hook.remove()
        del tr.kv_store.add
    return seen, len(calls)


@pytest.mark.parametrize(
    ("eviction", "real", "cycles"), [("fifo", False, CYCLES), ("lowest_score", False, CYCLES), ("fifo", True, 60)]
)
def test_step_traces_soak_stays_within_capacity(world, tmp_path, eviction, real, cycles):
    """cycles adds of BATCH steps past CAP slots (N_OFF of them pinned off-policy steps); real: the K/V computed by
    the tiny model (fewer cycles: a forward pass each), else by _TokenKV."""
    tok, model = world
    g = torch.Generator().manual_seed(0)
    tr = _traces(tok, model, eviction, real)
    buffer_bytes = _buffer_bytes(StepBuffer(CAP, D, dtype=torch.float32))  # the storage of all CAP slots
    max_tokens = max(_seg_len(tok, i) for i in range(5))
    # the reference: the key of every step ever added (the test's memory, not the object's)
    keys = dict(zip(range(N_OFF), tr.buffer.embeddings.clone()))
    for c in range(cycles):
        k = torch.randn(BATCH, D, generator=g)
        i0 = N_OFF + c * BATCH
        pids = tr.add_encoded(k, [_step(i0 + j) for j in range(BATCH)], [c % 7] * BATCH, torch.rand(BATCH, generator=g))
        keys.update(zip(pids.tolist(), k))
        _check_bounds(tr, buffer_bytes, max_tokens)
    assert tr.num_onpolicy == BATCH * cycles and len(keys) == N_OFF + BATCH * cycles  # >> CAP steps passed through
    live = sorted(tr.buffer.payload_ids.tolist())
    # what is held is exactly the live steps' (the sizes alone would allow stale entries in place of live ones)
    assert set(tr.payloads) == set(tr.kv_store._where) == set(tr.kv_store._tokens) == set(live)
    assert set(range(N_OFF)) <= set(live)  # the pinned off-policy steps survived the soak

    # search results = float64 brute force over the live steps
    q = torch.randn(32, D, generator=g)
    segs, got, _ = tr.search(q)
    lk = torch.stack([keys[p] for p in live]).double()
    cos = torch.nn.functional.normalize(q.double(), dim=1) @ torch.nn.functional.normalize(lk, dim=1).T
    assert got.tolist() == [live[j] for j in cos.argmax(1).tolist()]
    assert all(seg == tr.payloads[p] for seg, p in zip(segs, got.tolist()))

    # splice payloads: the cached K/V of each live step = its segment's K/V computed afresh
    if real:
        fresh = StepKVStore.for_model(model)
        fresh.add_from_model(model, live, [tr.payloads[p] for p in live])
    else:
        fresh = _new_store(model, False)
        _token_kv(fresh, live, [tr.payloads[p] for p in live])
    for p in live:
        assert tr.kv_store.tokens(p) == tr.payloads[p]
        for a, b in zip(tr.kv_store.get(p), fresh.get(p)):
            torch.testing.assert_close(a, b)

    # refresh_kv recomputes the live payloads only: each once (with the model: in ceil(len(live) / 64) forward passes)
    seen, calls = _counted_refresh(tr, model)
    assert sorted(seen) == live and calls == (-(-len(live) // 64) if real else 0)
    _check_bounds(tr, buffer_bytes, max_tokens)

    # save/load keeps exactly the live state, and traces.json lists the live payloads only
    tr.save(tmp_path / "tr")
    (traces_json,) = (tmp_path / "tr").rglob("traces.json")
    meta = json.loads(traces_json.read_text())
    assert meta["payload_ids"] == live and meta["payloads"] == [tr.payloads[p] for p in live]
    store = _new_store(model, real)
    back = type(tr).load(tmp_path / "tr", tr.encoder, tok, kv_store=store, model=model)
    assert back.payloads == tr.payloads and (back.num_offpolicy, back.num_onpolicy) == (N_OFF, BATCH * cycles)
    assert torch.equal(back.buffer.payload_ids, tr.buffer.payload_ids) and torch.equal(
        back.buffer.pinned, tr.buffer.pinned
    )
    assert store.payload_ids() == live
    for p in live:
        assert store.tokens(p) == tr.payloads[p]
        for a, b in zip(store.get(p), tr.kv_store.get(p)):
            assert torch.equal(a, b)
    # and both go on alike: the next add evicts the same steps and gets the same payload ids
    k = torch.randn(BATCH, D, generator=g)
    steps = [_step(j) for j in range(BATCH)]
    assert torch.equal(tr.add_encoded(k, steps, [0] * BATCH), back.add_encoded(k, steps, [0] * BATCH))
    assert back.payloads == tr.payloads and store.payload_ids() == tr.kv_store.payload_ids()
    for c in range(2 * CAP):  # the loaded copy keeps the bounds as it goes on
        back.add_encoded(torch.randn(BATCH, D, generator=g), steps, [c % 7] * BATCH)
        _check_bounds(back, buffer_bytes, max_tokens)


def test_kv_store_soak_pools_stay_bounded():
    """StepKVStore alone: payloads of varying lengths added and evicted BATCH * CYCLES times, at most CAP stored at
    once; the pools stay within max(initial, 2 x the most tokens stored at once) and hold what a dict reference
    holds."""
    g = torch.Generator().manual_seed(1)
    store = StepKVStore(1, 1, 2, dtype=torch.float32, capacity_tokens=4)
    ref: dict[int, torch.Tensor] = {}
    peak = 0
    for pid in range(BATCH * CYCLES):
        if len(ref) == CAP:  # evict a random live payload, as lowest_score eviction would
            victim = sorted(ref)[int(torch.randint(CAP, (1,), generator=g))]
            store.evict([victim])
            del ref[victim]
        n = 1 + int(torch.randint(9, (1,), generator=g))
        kv = torch.randn(1, n, 1, 2, generator=g)
        peak = max(peak, sum(t.shape[1] for t in ref.values()) + n)
        store.add([pid], [kv], [kv + 1], tokens=[[0] * n])
        ref[pid] = kv
        assert len(store) == len(ref) <= CAP and len(store._tokens) <= CAP and len(store._free) <= CAP + 1
        assert store.capacity_tokens <= max(4, 2 * peak)
    assert store.payload_ids() == sorted(ref)
    for pid, kv in ref.items():
        k, v = store.get(pid)
        assert torch.equal(k, kv) and torch.equal(v, kv + 1)
