"""StepBuffer semantics besides search exactness: slot assignment and eviction (fifo, lowest_score, with and without
pinned steps) against a sequential model; the faiss-like conveniences (automatic ids, NumPy arrays, a 1-D query,
reset, the l2 score's sign against faiss); save/load (round trip, pins not saved, a missing or newer save);
argument checks of the constructor, add, search and the pins (hypothesis-fuzzed for add and search).

Not here: search exactness (test_retrieval.py), the op below StepBuffer (test_retrieval_op.py), crashes and corruption
of saves (tests/reliability/), distributed (test_retrieval_dist.py), CUDA (test_retrieval_gpu.py).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapo_fast import StepBuffer
from rapo_fast.retrieval.buffer import StepBufferFormatError

# ---- slot assignment and eviction ------------------------------------------------------------------------------------


def _sim(C, eviction, batches):
    """Sequential model, one step at a time. Full: a new step evicts among the unpinned steps by the policy (fifo: the
    oldest; lowest_score: the lowest score, oldest among equals, and only if the new score is >= it, except that a
    pinned newcomer always takes it); with no unpinned step left, an unpinned newcomer is dropped and a pinned one
    applies the policy to all. Returns (slot -> (payload, pinned), the slot of every step in order, -1 = dropped)."""
    store, seq, placed = {}, 0, []  # slot -> (score, seq, payload, pinned)
    fifo = eviction == "fifo"

    def key(j):
        return store[j][1] if fifo else (store[j][0], store[j][1])

    for payloads, scores, pins in batches:
        for p, s, pin in zip(payloads, scores, pins):
            new, slot = (s, seq, p, pin), -1
            if len(store) < C:
                slot = len(store)
            else:
                unpinned = [j for j in store if not store[j][3]]
                if unpinned:
                    j = min(unpinned, key=key)
                    slot = j if fifo or pin or s >= store[j][0] else -1
                elif pin:
                    j = min(store, key=key)
                    slot = j if fifo or s >= store[j][0] else -1
            if slot >= 0:
                store[slot] = new
            placed.append(slot)
            seq += 1
    return {j: (v[2], v[3]) for j, v in store.items()}, placed


def _batches(seed, sizes, p_pin):
    g = torch.Generator().manual_seed(seed)
    out, pid = [], 0
    for m in sizes:
        pins = (torch.rand(m, generator=g) < p_pin).tolist()
        scores = torch.randint(0, 4, (m,), generator=g).float().tolist()  # equal scores: the age tie-break
        out.append((list(range(pid, pid + m)), scores, pins))
        pid += m
    return out


def _add(buf, payloads, scores, pins):
    m = len(payloads)
    return buf.add(
        torch.randn(m, 3),
        torch.tensor(payloads, dtype=torch.int64),
        torch.zeros(m, dtype=torch.int64),
        torch.tensor(scores),
        torch.tensor(pins, dtype=torch.bool),
    )


@pytest.mark.parametrize("p_pin", [0.0, 0.35])
@pytest.mark.parametrize("eviction", ["fifo", "lowest_score"])
@pytest.mark.parametrize("C", [1, 4, 9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eviction_matches_the_sequential_model(p_pin, eviction, C, seed):
    """Batched adds (some past the capacity, some empty) keep exactly the model's steps with their pin flags, fifo
    without pins in the model's slots (all-False pins are no pins: the plain ring); one-by-one adds take the model's
    slots."""
    batches = _batches(seed + 10 * C, [3, 0, 5, 1, 12, 2, 7, 4], p_pin)
    want, placed = _sim(C, eviction, batches)
    buf = StepBuffer(C, 3, dtype=torch.float32, eviction=eviction)
    for payloads, scores, pins in batches:
        slots = _add(buf, payloads, scores, pins)
        kept = slots[slots >= 0]
        assert len(set(kept.tolist())) == kept.numel()
        assert buf.payload_ids[kept].tolist() == [p for p, s in zip(payloads, slots.tolist()) if s >= 0]
    assert {int(p): bool(f) for p, f in zip(buf.payload_ids, buf.pinned)} == dict(want.values())
    if eviction == "fifo" and p_pin == 0:
        assert {j: (int(buf.payload_ids[j]), False) for j in range(len(buf))} == want
    one = StepBuffer(C, 3, dtype=torch.float32, eviction=eviction)
    slots = [int(_add(one, [p], [s], [f])[0]) for b in batches for p, s, f in zip(*b)]
    assert slots == placed
    assert {j: (int(one.payload_ids[j]), bool(one.pinned[j])) for j in range(len(one))} == want


def test_every_slot_pinned_drops_a_new_unpinned_step():
    buf = StepBuffer(3, 2, dtype=torch.float32, eviction="fifo")
    buf.add(torch.randn(3, 2), torch.arange(3), torch.zeros(3, dtype=torch.int64), pinned=True)
    slots = buf.add(torch.randn(2, 2), torch.arange(10, 12), torch.zeros(2, dtype=torch.int64))
    assert slots.tolist() == [-1, -1] and buf.payload_ids.tolist() == [0, 1, 2]
    # a pinned newcomer evicts the oldest pinned step (plain fifo among them)
    one = buf.add(torch.randn(1, 2), torch.tensor([20]), torch.zeros(1, dtype=torch.int64), pinned=True)
    assert one.tolist() == [0]
    assert buf.payload_ids.tolist() == [20, 1, 2] and bool(buf.pinned.all())


def test_unpinned_steps_cycle_around_the_pinned_ones():
    """The StepTraces case at buffer level: a pinned source, then unpinned steps added past capacity in batches."""
    C, n_src = 10, 4
    buf = StepBuffer(C, 4, dtype=torch.float32, metric="l2", eviction="fifo")
    src = torch.randn(n_src, 4)
    buf.add(src, torch.arange(n_src), torch.zeros(n_src, dtype=torch.int64), pinned=True)
    pid = n_src
    for m in (5, 3, 9, 1, 6):
        buf.add(torch.randn(m, 4), torch.arange(pid, pid + m), torch.ones(m, dtype=torch.int64))
        pid += m
        ids = sorted(buf.payload_ids.tolist())
        assert ids[:n_src] == list(range(n_src))  # the source stays
        assert ids[n_src:] == list(range(n_src, pid))[-(len(buf) - n_src) :]  # the newest unpinned ones
    _, p = buf.search(src, 1)
    assert p.flatten().tolist() == list(range(n_src))  # and stays retrievable


def test_slots_stable_and_embeddings_searchable_after_eviction():
    buf = StepBuffer(8, 6, dtype=torch.float32, metric="l2", eviction="fifo")
    x = torch.randn(20, 6)
    for i in range(0, 20, 4):
        buf.add(x[i : i + 4], torch.arange(i, i + 4), torch.zeros(4, dtype=torch.int64))
    s, p = buf.search(x[12:20], 1)  # each of the last 8 steps finds itself at distance 0 (up to fp32 rounding)
    assert p.flatten().tolist() == list(range(12, 20))
    assert torch.all(s <= 0) and torch.all(s.flatten() >= -1e-5 * x[12:20].norm(dim=1) ** 2)


# ---- conveniences ----------------------------------------------------------------------------------------------------


def _buf(metric="ip", capacity=8, dim=4, **kw):
    return StepBuffer(capacity, dim, dtype=torch.float32, metric=metric, **kw)


def test_add_without_ids_numbers_the_steps_and_gives_each_its_own_group():
    buf = _buf()
    x = torch.randn(3, 4)
    assert buf.add(x).tolist() == [0, 1, 2]
    assert buf.payload_ids.tolist() == [0, 1, 2] and buf.group_ids.tolist() == [0, 1, 2]
    buf.add(torch.randn(2, 4))  # the numbering goes on across adds
    assert buf.payload_ids.tolist() == [0, 1, 2, 3, 4] and buf.group_ids.tolist() == [0, 1, 2, 3, 4]
    # own group: excluding a step's group skips exactly that step (e.g. a query's own entry)
    _, ids = buf.search(x[1:2], k=5, exclude_groups=torch.tensor([1]))
    assert 1 not in ids[0].tolist() and sorted(ids[0].tolist()) == [-1, 0, 2, 3, 4]
    # given payload ids, no group ids: the group is the payload id; given group ids, automatic payload ids
    buf.add(torch.randn(1, 4), payload_ids=torch.tensor([40]))
    buf.add(torch.randn(1, 4), group_ids=torch.tensor([7]))
    assert buf.payload_ids.tolist()[-2:] == [40, 6] and buf.group_ids.tolist()[-2:] == [40, 7]
    # the insertion number of a step the eviction policy dropped is not reused (ids stay unique)
    buf = _buf(capacity=2, eviction="lowest_score")
    buf.add(torch.randn(2, 4), scores=torch.tensor([1.0, 1.0]))
    assert buf.add(torch.randn(1, 4), scores=torch.tensor([0.0])).tolist() == [-1]  # dropped: id 2 is spent
    buf.add(torch.randn(1, 4), scores=torch.tensor([5.0]))
    assert sorted(buf.payload_ids.tolist()) == [1, 3]


def test_numpy_arrays_in_add_and_search():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4))  # float64, as NumPy makes them: rounded to the buffer's dtype
    a, b = _buf("l2"), _buf("l2")
    a.add(x, payload_ids=np.arange(10, 16), group_ids=np.zeros(6, dtype=np.int64), scores=np.ones(6))
    b.add(torch.from_numpy(x), torch.arange(10, 16), torch.zeros(6, dtype=torch.int64), torch.ones(6))
    q = rng.standard_normal((3, 4)).astype(np.float32)
    got, want = a.search(q, k=2, exclude_groups=np.full(3, -1)), b.search(torch.from_numpy(q), k=2)
    assert isinstance(got[0], torch.Tensor) and got[0].shape == (3, 2) and got[1].shape == (3, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(TypeError, match="payload_ids"):  # a list is not an array: its dtype would be a guess
        a.add(x[:1], payload_ids=[1])


def test_numpy_views_with_negative_strides_are_copied():
    """A reversed NumPy view (negative strides, which torch tensors cannot have) as queries, embeddings or ids is
    copied: the results equal those of the same values given contiguous."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    a, b = _buf("cosine"), _buf("cosine")
    a.add(x[::-1], payload_ids=np.arange(6)[::-1], group_ids=np.arange(6)[::-1], scores=np.ones(6)[::-1])
    b.add(np.ascontiguousarray(x[::-1]), payload_ids=np.arange(5, -1, -1), group_ids=np.arange(5, -1, -1))
    q = rng.standard_normal((3, 4)).astype(np.float32)
    for view in (q[::-1], q[:, ::-1], q[::-1, ::-1], q[0][::-1]):
        assert any(s < 0 for s in view.strides)
        got, want = a.search(view, k=3), b.search(torch.from_numpy(np.ascontiguousarray(view)), k=3)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    excl = np.array([0, 1, 2])[::-1]
    got = a.search(q, k=6, exclude_groups=excl)[1]
    assert all(int(excl[i]) not in got[i].tolist() for i in range(3))


@pytest.mark.parametrize("as_numpy", [False, True], ids=["tensor", "numpy"])
def test_a_1d_query_is_one_query(as_numpy):
    buf = _buf("cosine")
    buf.add(torch.randn(5, 4))
    q = torch.randn(4)
    scores, ids = buf.search(q.numpy() if as_numpy else q, k=3)
    assert scores.shape == (3,) and ids.shape == (3,) and scores.dtype == torch.float32 and ids.dtype == torch.int64
    rows = buf.search(q[None], k=3)
    assert torch.equal(scores, rows[0][0]) and torch.equal(ids, rows[1][0])
    # its exclusion: an int, or a 0-d tensor
    best = int(ids[0])
    for ex in (best, torch.tensor(best)):
        assert best not in buf.search(q, k=3, exclude_groups=ex)[1].tolist()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_reset_empties_and_keeps_the_configuration(metric):
    buf = _buf(metric, capacity=4, eviction="fifo")
    far = torch.randn(6, 4) + 1000.0  # l2: the running key sum (centring) must restart too
    buf.add(far, pinned=torch.tensor([True, False, False, False, False, False]))
    buf.reset()
    assert len(buf) == 0 and not buf.pinned.any()
    assert (buf.capacity, buf.dim, buf.dtype, buf.metric, buf.eviction) == (4, 4, torch.float32, metric, "fifo")
    scores, ids = buf.search(torch.randn(1, 4), k=2)
    assert ids.tolist() == [[-1, -1]] and torch.isinf(scores).all()
    x = torch.randn(5, 4)
    assert buf.add(x[:4]).tolist() == [0, 1, 2, 3]  # slots from 0 again
    assert buf.add(x[4:]).tolist() == [0]  # and the fifo ring from its start: the 5th step overwrites slot 0
    assert buf.payload_ids.tolist() == [4, 1, 2, 3]  # automatic ids from 0 again
    scores, ids = buf.search(x[2], k=1)
    assert ids.tolist() == [2]
    if metric == "l2":
        assert scores.tolist() == [0.0]


def test_l2_scores_are_faiss_distances_negated():
    """The l2 score is the negative squared distance (tests/helpers/retrieval_cases.py checks it against the float64
    spec): the opposite of faiss's IndexFlatL2 distances, with the same ids."""
    faiss = pytest.importorskip("faiss")
    buf = _buf("l2")
    keys = torch.randn(6, 4)
    buf.add(keys)
    q = torch.randn(2, 4)
    scores, ids = buf.search(q, k=6)
    index = faiss.IndexFlatL2(4)
    index.add(keys.numpy())
    dist, fids = index.search(q.numpy(), 6)
    assert torch.equal(torch.from_numpy(fids), ids)
    torch.testing.assert_close(torch.from_numpy(dist), -scores, atol=1e-5, rtol=1e-5)


# ---- save / load -----------------------------------------------------------------------------------------------------


def _config(b: StepBuffer) -> tuple:
    return b.capacity, b.dim, b.dtype, b.metric, b.eviction, len(b)


@pytest.mark.parametrize("eviction", ["fifo", "lowest_score"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_save_load_round_trip(tmp_path, eviction, dtype):
    buf = StepBuffer(30, 9, dtype=dtype, metric="cosine", eviction=eviction)
    buf.add(torch.randn(40, 9), torch.arange(40), torch.randint(0, 3, (40,)), torch.randn(40))
    buf.save(tmp_path / "b")
    back = StepBuffer.load(tmp_path / "b")
    assert _config(back) == _config(buf) == (30, 9, dtype, "cosine", eviction, 30)
    for name in ("embeddings", "payload_ids", "group_ids", "scores"):
        assert torch.equal(getattr(back, name), getattr(buf, name)), name
    q = torch.randn(5, 9)
    assert all(torch.equal(a, b) for a, b in zip(back.search(q, 4), buf.search(q, 4)))
    more = (torch.randn(7, 9), torch.arange(100, 107), torch.zeros(7, dtype=torch.int64), torch.randn(7))
    assert torch.equal(back.add(*more), buf.add(*more))  # eviction state (head, ages) survived
    assert torch.equal(back.payload_ids, buf.payload_ids)


def test_pins_are_not_saved_and_set_pinned_restores_them(tmp_path):
    buf = StepBuffer(4, 3, dtype=torch.float32, eviction="fifo")
    g1 = torch.zeros(1, dtype=torch.int64)
    buf.add(torch.randn(2, 3), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int64), pinned=True)
    for p in range(2, 7):  # unpinned 2..6 cycle through slots 2 and 3: slot 2 ends newer than slot 3
        buf.add(torch.randn(1, 3), torch.tensor([p]), g1)
    assert buf.payload_ids.tolist() == [0, 1, 6, 5]
    buf.save(tmp_path / "b")
    back = StepBuffer.load(tmp_path / "b")
    assert not bool(back.pinned.any())  # the snapshot has no pin flags
    same = StepBuffer.load(tmp_path / "b")
    same.set_pinned(buf.pinned.clone())
    more = (torch.randn(3, 3), torch.tensor([7, 8, 9]), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(same.add(*more), buf.add(*more)) and torch.equal(same.payload_ids, buf.payload_ids)
    # without pins, fifo evicts by age (0, 1, then 5 in slot 3), not by the ring from slot 0 (0, 1, then 6 in slot 2)
    assert back.add(*more).tolist() == [0, 1, 3]
    assert back.payload_ids.tolist() == [7, 8, 6, 9]


def test_missing_save_and_newer_format_version(tmp_path):
    """Corrupted and edited saves: tests/reliability/test_save_formats.py."""
    with pytest.raises(StepBufferFormatError, match="expected a saved StepBuffer"):
        StepBuffer.load(tmp_path / "missing")
    buf = StepBuffer(10, 4, dtype=torch.float16)
    buf.add(torch.randn(5, 4), torch.arange(5), torch.zeros(5, dtype=torch.int64))
    d = tmp_path / "b"
    buf.save(d)
    snap = d / (d / "CURRENT").read_text().split()[0]
    meta = json.loads((snap / "meta.json").read_text())
    meta["format_version"] = 99
    (snap / "meta.json").write_text(json.dumps(meta))
    # as a newer rapo_fast would write it: CURRENT names the new meta.json's checksum
    (d / "CURRENT").write_text(f"{snap.name} {hashlib.sha256((snap / 'meta.json').read_bytes()).hexdigest()}\n")
    with pytest.raises(StepBufferFormatError, match="'format_version': expected 2 .*got 99"):
        StepBuffer.load(d)
    assert issubclass(StepBufferFormatError, ValueError)


# ---- argument checks -------------------------------------------------------------------------------------------------


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
    with pytest.raises(ValueError, match="embeddings: expected finite values"):  # overflows float16
        buf.add(torch.tensor([[1e5, 0.0]]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="group_ids"):
        buf.add(torch.ones(1, 2), torch.tensor([0]), torch.tensor([-2]))
    assert len(buf) == 0


def test_pin_argument_checks():
    buf = StepBuffer(4, 2, dtype=torch.float32)
    x, pid, g = torch.randn(2, 2), torch.arange(2), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(TypeError, match="pinned"):
        buf.add(x, pid, g, pinned=torch.ones(2))
    with pytest.raises(TypeError, match="pinned"):
        buf.add(x, pid, g, pinned=[True, False])
    with pytest.raises(ValueError, match="pinned"):
        buf.add(x, pid, g, pinned=torch.ones(3, dtype=torch.bool))
    assert len(buf) == 0  # nothing stored by a refused add
    buf.add(x, pid, g)
    with pytest.raises(TypeError, match="mask"):
        buf.set_pinned(torch.ones(2))
    with pytest.raises(ValueError, match="mask"):
        buf.set_pinned(torch.ones(3, dtype=torch.bool))
    buf.set_pinned(torch.tensor([True, False]))
    assert buf.pinned.tolist() == [True, False]


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
    q = torch.zeros(q_shape, dtype=q_dtype)
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
