"""StepBuffer semantics besides exactness: slot assignment and eviction (fifo, lowest_score) against a sequential
simulation, save/load round trip, crash safety and corruption errors, hypothesis-fuzzed argument checks, the
registered op under opcheck and torch.compile, and the rebuild error for CUDA tensors without a CUDA build.

Not here: search exactness (test_retrieval.py), distributed (test_retrieval_dist.py), CUDA (test_retrieval_gpu.py).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rapo_fast.retrieval.io as rio
from rapo_fast import StepBuffer
from rapo_fast._ext import extension, require_backend
from rapo_fast.retrieval.buffer import StepBufferFormatError
from rapo_fast.retrieval.op import retrieval_search


def _sim_fifo(C, batches):
    """Sequential model: each step goes to the next slot in ring order; returns slot -> payload."""
    store, nxt, size = {}, 0, 0
    for payloads in batches:
        for p in payloads:
            slot = size if size < C else nxt
            if size < C:
                size += 1
            else:
                nxt = (nxt + 1) % C
            store[slot] = p
    return store


def _sim_lowest(C, batches):
    """Sequential model: when full, a step replaces the lowest-scored (oldest among equals) if its score is >= it."""
    store, seq = {}, 0  # slot -> (score, seq, payload)
    for payloads, scores in batches:
        for p, s in zip(payloads, scores):
            if len(store) < C:
                store[len(store)] = (s, seq, p)
            else:
                slot = min(store, key=lambda j: (store[j][0], store[j][1]))
                if s >= store[slot][0]:
                    store[slot] = (s, seq, p)
            seq += 1
    return {j: v[2] for j, v in store.items()}


@pytest.mark.parametrize("C", [1, 7, 16])
def test_fifo_eviction_order(C):
    buf = StepBuffer(C, 4, dtype=torch.float32, eviction="fifo")
    batches, pid = [], 0
    for m in [3, 0, 5, 1, 20, 2, 7]:
        payload = list(range(pid, pid + m))
        pid += m
        batches.append(payload)
        slots = buf.add(torch.randn(m, 4), torch.tensor(payload, dtype=torch.int64), torch.zeros(m, dtype=torch.int64))
        kept = slots[slots >= 0]
        assert len(set(kept.tolist())) == kept.numel()
        assert buf.payload_ids[kept].tolist() == [p for p, s in zip(payload, slots.tolist()) if s >= 0]
    want = _sim_fifo(C, batches)
    assert len(buf) == len(want)
    assert {j: int(buf.payload_ids[j]) for j in range(len(buf))} == want


@pytest.mark.parametrize("C", [1, 5, 12])
def test_lowest_score_eviction(C):
    buf = StepBuffer(C, 3, dtype=torch.float32, eviction="lowest_score")
    batches, pid = [], 0
    g = torch.Generator().manual_seed(C)
    for m in [4, 9, 1, 6, 15, 3]:
        payload = list(range(pid, pid + m))
        pid += m
        scores = torch.randint(0, 4, (m,), generator=g).float()  # many equal scores: exercises the age tie-break
        batches.append((payload, scores.tolist()))
        slots = buf.add(torch.randn(m, 3), torch.tensor(payload), torch.zeros(m, dtype=torch.int64), scores)
        assert buf.payload_ids[slots[slots >= 0]].tolist() == [p for p, s in zip(payload, slots.tolist()) if s >= 0]
    want = _sim_lowest(C, batches)
    # Batched adds keep exactly the sequential model's steps (kept new steps take the freed slots in ascending order).
    assert sorted(buf.payload_ids.tolist()) == sorted(want.values())
    one = StepBuffer(C, 3, dtype=torch.float32, eviction="lowest_score")
    for payloads, scores in batches:  # one step at a time: the slots match the model too
        for p, s in zip(payloads, scores):
            one.add(torch.randn(1, 3), torch.tensor([p]), torch.zeros(1, dtype=torch.int64), torch.tensor([s]))
    assert {j: int(one.payload_ids[j]) for j in range(len(one))} == want


def test_slots_stable_and_embeddings_searchable_after_eviction():
    buf = StepBuffer(8, 6, dtype=torch.float32, metric="l2", eviction="fifo")
    x = torch.randn(20, 6)
    for i in range(0, 20, 4):
        buf.add(x[i : i + 4], torch.arange(i, i + 4), torch.zeros(4, dtype=torch.int64))
    s, p = buf.search(x[12:20], 1)  # each of the last 8 steps finds itself at distance 0 (up to fp32 rounding)
    assert p.flatten().tolist() == list(range(12, 20))
    assert torch.all(s <= 0) and torch.all(s.flatten() >= -1e-5 * x[12:20].norm(dim=1) ** 2)


@pytest.mark.parametrize("eviction", ["fifo", "lowest_score"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_save_load_round_trip(tmp_path, eviction, dtype):
    buf = StepBuffer(30, 9, dtype=dtype, metric="cosine", eviction=eviction)
    buf.add(torch.randn(40, 9), torch.arange(40), torch.randint(0, 3, (40,)), torch.randn(40))
    buf.save(tmp_path / "b")
    buf.save(tmp_path / "b")  # a second save replaces the first and cleans it up
    assert len([p for p in (tmp_path / "b").iterdir() if p.name.startswith("snapshot-")]) == 1
    back = StepBuffer.load(tmp_path / "b")
    assert (back.capacity, back.dim, back.dtype, back.metric, back.eviction, len(back)) == (
        30,
        9,
        dtype,
        "cosine",
        eviction,
        30,
    )
    for name in ("embeddings", "payload_ids", "group_ids", "scores"):
        assert torch.equal(getattr(back, name), getattr(buf, name)), name
    q = torch.randn(5, 9)
    assert all(torch.equal(a, b) for a, b in zip(back.search(q, 4), buf.search(q, 4)))
    more = (torch.randn(7, 9), torch.arange(100, 107), torch.zeros(7, dtype=torch.int64), torch.randn(7))
    assert torch.equal(back.add(*more), buf.add(*more))  # eviction state (head, ages) survived
    assert torch.equal(back.payload_ids, buf.payload_ids)


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    d = tmp_path / "b"
    buf = StepBuffer(10, 4, dtype=torch.float32)
    buf.add(torch.randn(3, 4), torch.arange(3), torch.zeros(3, dtype=torch.int64))
    buf.save(d)
    buf.add(torch.randn(3, 4), torch.arange(3, 6), torch.zeros(3, dtype=torch.int64))

    def boom(*a, **k):
        raise OSError("simulated crash before CURRENT is replaced")

    monkeypatch.setattr(rio.os, "replace", boom)
    with pytest.raises(OSError, match="simulated crash"):
        buf.save(d)
    monkeypatch.undo()
    assert len(StepBuffer.load(d)) == 3  # the previous save is intact and current
    # Entries the saves did not write are harmless to a load, and a save leaves them alone (not deleting
    # every snapshot-* and .*.tmp entry of the directory).
    (d / "snapshot-deadbeef").mkdir()
    (d / ".snapshot-x.tmp").mkdir()
    assert len(StepBuffer.load(d)) == 3
    buf.save(d)
    assert len(StepBuffer.load(d)) == 6 and (d / "snapshot-deadbeef").is_dir() and (d / ".snapshot-x.tmp").is_dir()
    ours = {p.name for p in d.iterdir()} - {"snapshot-deadbeef", ".snapshot-x.tmp"}
    assert ours == {"CURRENT", "LOCK", (d / "CURRENT").read_text().split()[0]}  # the older snapshot is gone


def test_corrupt_and_wrong_version(tmp_path):
    buf = StepBuffer(10, 4, dtype=torch.float16)
    buf.add(torch.randn(5, 4), torch.arange(5), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(StepBufferFormatError, match="not a saved StepBuffer"):
        StepBuffer.load(tmp_path / "missing")
    d = tmp_path / "b"
    buf.save(d)
    snap = d / (d / "CURRENT").read_text().split()[0]
    data = bytearray((snap / "tensors.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (snap / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(StepBufferFormatError, match="corrupt"):
        StepBuffer.load(d)
    buf.save(d)
    snap = d / (d / "CURRENT").read_text().split()[0]
    meta = json.loads((snap / "meta.json").read_text())
    meta["format_version"] = 99
    (snap / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StepBufferFormatError, match="corrupt"):  # meta.json's SHA-256 is in CURRENT
        StepBuffer.load(d)
    # as a newer rapo_fast would write it: CURRENT names the new meta.json's checksum
    (d / "CURRENT").write_text(f"{snap.name} {hashlib.sha256((snap / 'meta.json').read_bytes()).hexdigest()}\n")
    with pytest.raises(StepBufferFormatError, match="format version 99"):
        StepBuffer.load(d)
    (snap / "meta.json").write_text("{not json")
    with pytest.raises(StepBufferFormatError, match="corrupt"):
        StepBuffer.load(d)
    assert issubclass(StepBufferFormatError, ValueError)


def test_constructor_checks():
    with pytest.raises(ValueError, match="capacity"):
        StepBuffer(0, 4)
    with pytest.raises(ValueError, match="dim"):
        StepBuffer(4, 0)
    with pytest.raises(TypeError, match="dtype"):
        StepBuffer(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="metric"):
        StepBuffer(4, 4, metric="dot")
    with pytest.raises(ValueError, match="eviction"):
        StepBuffer(4, 4, eviction="lru")


def test_add_rejects_nonfinite_and_negative_groups():
    buf = StepBuffer(4, 2)
    with pytest.raises(ValueError, match="finite"):
        buf.add(torch.tensor([[1.0, float("nan")]]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="finite"):  # overflows float16
        buf.add(torch.tensor([[1e6, 0.0]]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="group_ids"):
        buf.add(torch.ones(1, 2), torch.tensor([0]), torch.tensor([-2]))
    assert len(buf) == 0


_dtypes = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.int32, torch.bool, torch.float64])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    q_shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    q_dtype=_dtypes,
    k=st.one_of(st.integers(-3, 1100), st.just(True), st.just(2.0)),
    ex_len=st.one_of(st.none(), st.integers(0, 6)),
    ex_dtype=_dtypes,
    min_score=st.one_of(st.none(), st.floats(allow_nan=True), st.just("x")),
)
def test_fuzz_search_arguments(q_shape, q_dtype, k, ex_len, ex_dtype, min_score):
    buf = StepBuffer(8, 4, dtype=torch.float32)
    buf.add(torch.randn(8, 4), torch.arange(8), torch.zeros(8, dtype=torch.int64))
    q = torch.zeros(q_shape, dtype=q_dtype) if q_dtype != torch.bool else torch.zeros(q_shape, dtype=torch.bool)
    ex = None if ex_len is None else torch.zeros(ex_len, dtype=ex_dtype)
    try:
        s, p = buf.search(q, k, exclude_groups=ex, min_score=min_score)
    except (TypeError, ValueError) as exc:
        assert any(w in str(exc) for w in ("queries", "k ", "k:", "exclude_groups", "min_score")), str(exc)
        return
    # Accepted: then the arguments really were valid, and the result has the promised shapes ([Q, k]; [k] for a 1-D
    # query [D], which is one query)
    assert q.dim() in (1, 2) and q.shape[-1] == 4 and q.is_floating_point() and 1 <= k <= 1024
    want = (q.shape[0], k) if q.dim() == 2 else (k,)
    assert s.shape == want and p.shape == want


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(0, 4),
    d=st.integers(1, 6),
    e_dtype=_dtypes,
    p_len=st.integers(0, 5),
    p_dtype=_dtypes,
    g_len=st.integers(0, 5),
    g_dtype=_dtypes,
    s_len=st.one_of(st.none(), st.integers(0, 5)),
    s_dtype=_dtypes,
)
def test_fuzz_add_arguments(m, d, e_dtype, p_len, p_dtype, g_len, g_dtype, s_len, s_dtype):
    buf = StepBuffer(3, 4, dtype=torch.float16)
    emb = torch.ones(m, d, dtype=e_dtype)
    sc = None if s_len is None else torch.zeros(s_len, dtype=s_dtype)
    try:
        slots = buf.add(emb, torch.zeros(p_len, dtype=p_dtype), torch.zeros(g_len, dtype=g_dtype), sc)
    except (TypeError, ValueError) as exc:
        assert any(w in str(exc) for w in ("embeddings", "payload_ids", "group_ids", "scores")), str(exc)
        assert len(buf) == 0
        return
    assert d == 4 and p_len == m and g_len == m and emb.is_floating_point()
    assert slots.shape == (m,) and len(buf) == min(m, 3)


def test_opcheck_and_compile():
    buf = StepBuffer(300, 24, dtype=torch.float16, metric="l2")
    buf.add(torch.randn(300, 24), torch.arange(300), torch.randint(0, 4, (300,)))
    q = torch.randn(11, 24)
    ex = torch.randint(-1, 4, (11,))
    args = (buf._keys, buf._aux, buf._group, q.half(), ex, 5, 2, -100.0)
    torch.library.opcheck(retrieval_search.op, args)  # the registered op (eager calls skip the dispatcher)

    def fn(queries, exclude):
        s, p = buf.search(queries * 1.0, 5, exclude_groups=exclude, min_score=-100.0)
        return s + 0.0, p

    eager = fn(q, ex)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, ex)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_cuda_tensor_without_cuda_build_says_how_to_rebuild(monkeypatch):
    info = dict(extension().BUILD_INFO, cuda=False)
    monkeypatch.setattr(extension(), "BUILD_INFO", info)
    with pytest.raises(RuntimeError, match="pip install -e"):
        require_backend(torch.device("cuda", 0))


def test_search_is_not_differentiable():
    buf = StepBuffer(10, 4, dtype=torch.float32)
    buf.add(torch.randn(10, 4), torch.arange(10), torch.zeros(10, dtype=torch.int64))
    q = torch.randn(3, 4, requires_grad=True)
    s, p = buf.search(q, 2)
    assert not s.requires_grad and s.grad_fn is None
    torch.testing.assert_close(s, buf.search(q.detach(), 2)[0])


def test_search_on_wrong_device_is_rejected():
    buf = StepBuffer(4, 2)
    with pytest.raises(ValueError, match="device"):
        buf.search(torch.zeros(1, 2, device="meta"), 1)


def _op_inputs(C=100, D=16, Q=50):
    keys = torch.randn(C, D)
    return keys, torch.ones(C), torch.zeros(C, dtype=torch.int64), torch.randn(Q, D)


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"queries": torch.randn(50, 4096)}, ValueError, "keys have D = 16, queries D = 4096"),  # read past every key
        ({"keys": torch.randn(100, 4)}, ValueError, "keys have D = 4, queries D = 16"),
        ({"exclude": torch.zeros(1, dtype=torch.int64)}, IndexError, "exclude has 1 entries for 50 queries"),
        ({"key_aux": torch.ones(1), "metric": 1}, IndexError, "key_aux has 1 entries for 100 keys"),
        (
            {"groups": torch.zeros(3, dtype=torch.int64), "exclude": torch.zeros(50, dtype=torch.int64)},
            IndexError,
            "groups",
        ),
        ({"queries": torch.randn(50, 16).half()}, TypeError, "share a float32/float16/bfloat16 dtype"),
        (
            {"groups": torch.zeros(100, dtype=torch.int32), "exclude": torch.zeros(50, dtype=torch.int64)},
            TypeError,
            "groups",
        ),
        ({"k": 5000}, ValueError, "k must be in"),
        ({"metric": 7}, ValueError, "unknown metric"),
    ],
)
def test_search_op_called_directly_checks_every_extent(change, exc, match):
    """The registered op bypasses StepBuffer's validation: the extension itself refuses what would read out of bounds
    (a mismatched D or a short exclude list would read past the buffers)."""
    keys, aux, groups, q = _op_inputs()
    args = {"keys": keys, "key_aux": aux, "groups": groups, "queries": q, "exclude": None, "k": 5, "metric": 0}
    args.update(change)
    with pytest.raises(exc, match=match):
        retrieval_search(
            args["keys"],
            args["key_aux"],
            args["groups"],
            args["queries"],
            args["exclude"],
            args["k"],
            args["metric"],
            0.0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_search_refuses_nonfinite_queries(dtype):
    """Queries are validated as strictly as keys: NaN/inf, or a finite value that overflows the buffer's
    dtype (1e5 in fp16), is a ValueError naming queries, not an empty or garbage result."""
    buf = StepBuffer(20, 4, dtype=dtype)
    buf.add(torch.randn(20, 4), torch.arange(20), torch.zeros(20, dtype=torch.int64))
    for bad in (float("nan"), float("inf"), -float("inf")):
        q = torch.randn(3, 4)
        q[1, 2] = bad
        with pytest.raises(ValueError, match="queries: expected finite values"):
            buf.search(q, 2)
    q = torch.randn(3, 4)
    q[0, 0] = 1e5
    if dtype == torch.float16:
        with pytest.raises(ValueError, match="queries: expected finite values in torch.float16"):
            buf.search(q, 2)
        with pytest.raises(ValueError, match="embeddings: expected finite values"):  # the same value is refused by add
            buf.add(q[:1], torch.tensor([0]), torch.tensor([0]))
    else:
        assert torch.isfinite(buf.search(q, 2)[0]).all()
