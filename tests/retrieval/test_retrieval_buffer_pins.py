"""StepBuffer's pinned steps (add(..., pinned=...), set_pinned): eviction among the unpinned steps only, for fifo and
lowest_score, against a sequential model of the rule (batches keep exactly the steps of one-by-one adds; one-by-one
adds take the model's slots); a new unpinned step dropped when every slot is pinned; pins absent from snapshots, and
fifo by insertion number after a load whose slots left the ring order; argument checks.

Not here: eviction without pins (test_retrieval_buffer.py), StepTraces' use of pins (test_step_traces.py).
"""

from __future__ import annotations

import pytest
import torch

from rapo_fast import StepBuffer


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


def _batches(seed, sizes, p_pin=0.35):
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


@pytest.mark.parametrize("eviction", ["fifo", "lowest_score"])
@pytest.mark.parametrize("C", [1, 4, 9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pinned_eviction_matches_the_sequential_model(eviction, C, seed):
    batches = _batches(seed + 10 * C, [3, 0, 5, 1, 12, 2, 7, 4])
    want, placed = _sim(C, eviction, batches)
    # batched adds keep exactly the model's steps, with their pin flags
    buf = StepBuffer(C, 3, dtype=torch.float32, eviction=eviction)
    for payloads, scores, pins in batches:
        slots = _add(buf, payloads, scores, pins)
        kept = slots[slots >= 0]
        assert len(set(kept.tolist())) == kept.numel()
        assert buf.payload_ids[kept].tolist() == [p for p, s in zip(payloads, slots.tolist()) if s >= 0]
    got = {int(p): bool(f) for p, f in zip(buf.payload_ids, buf.pinned)}
    assert got == dict(want.values())
    # one step at a time: the model's slots too
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


def test_no_pins_keeps_the_ring():
    """All-False pins are no pins: the plain fifo ring, slot for slot."""
    a = StepBuffer(5, 2, dtype=torch.float32)
    b = StepBuffer(5, 2, dtype=torch.float32)
    for m in (3, 4, 7):
        x, pid = torch.randn(m, 2), torch.arange(m)
        g = torch.zeros(m, dtype=torch.int64)
        assert torch.equal(a.add(x, pid, g), b.add(x, pid, g, pinned=torch.zeros(m, dtype=torch.bool)))
    assert not bool(b.pinned.any())


def test_pins_are_not_saved_and_set_pinned_restores_them(tmp_path):
    C = 4
    buf = StepBuffer(C, 3, dtype=torch.float32, eviction="fifo")
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
