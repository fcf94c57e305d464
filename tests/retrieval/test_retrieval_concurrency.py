"""Concurrent use of the step buffer: searches from several threads while one thread adds past the ring's
wrap. Every returned (score, payload id) pair must be one the buffer held at some moment: payload ids encode their key
(key = TABLE[payload id]), so a score paired with the wrong payload id is caught exactly. Before StepBuffer took a
reader-writer lock, a search paired a slot's old score with its new payload id once the ring wrapped. On a small
loaded machine the threads rarely interleave inside that window, so the `widen_windows` fixture makes each search
(and each key-aux computation inside add) sleep briefly: a search-then-lookup or a half-written add is then overlapped
by the other thread on every run, and only the lock keeps the pairs consistent.

Not here: single-threaded exactness (test_retrieval.py), persistence (test_retrieval_buffer.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import rapo_fast.retrieval.buffer as buffer_module
from rapo_fast import StepBuffer
from rapo_fast.retrieval.step_traces import StepTraces

D, CAP, N_KEYS, N_ADDED, READERS = 16, 64, 3000, 1500, 4
TABLE = torch.randn(N_KEYS, D, generator=torch.Generator().manual_seed(0))


ADDS = {"done": 0}  # adds completed by the writer of the running test, under ADDED
ADDED = threading.Condition()


def _count_add():
    with ADDED:
        ADDS["done"] += 1
        ADDED.notify_all()


@pytest.fixture(autouse=True)
def widen_windows(monkeypatch):
    """Widen the two windows a writer must not be able to enter. After the search op returns (before its slots are
    mapped to payload ids) the reader waits, up to 40 ms, until the writer has completed two more adds, so at least
    one add lies wholly between the search and the lookup; inside add, 1 ms passes between the key and the aux writes.
    With the lock the writer cannot add during the wait (it times out); without it the interleaving happens on every
    run, even on a loaded 2-core machine where threads otherwise rarely meet inside these windows."""
    search, aux = buffer_module.retrieval_search, buffer_module.key_aux_ref

    def slow_search(*args, **kwargs):
        out = search(*args, **kwargs)
        with ADDED:  # a wait that holds no GIL while it waits, so the writer runs at full speed
            start = ADDS["done"]
            ADDED.wait_for(lambda: ADDS["done"] >= start + 2, timeout=0.04)
        return out

    def slow_aux(*args):
        time.sleep(1e-3)
        return aux(*args)

    monkeypatch.setattr(buffer_module, "retrieval_search", slow_search)
    monkeypatch.setattr(buffer_module, "key_aux_ref", slow_aux)
    ADDS["done"] = 0


def _run_threads(write, read, readers=READERS):
    """Runs `write()` once in one thread while `readers` threads call `read()` until it is done; returns the
    readers' error messages (empty when every pair was consistent) and how many searches ran."""
    done, errors, counts = threading.Event(), [], []

    def reader():
        n = 0
        try:
            while not done.is_set() or n == 0:
                read()
                n += 1
        except AssertionError as exc:
            errors.append(str(exc))
        counts.append(n)

    read()  # warm up first (the op's first call imports modules for seconds): the readers must overlap the writer
    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for t in threads:
        t.start()
    try:
        write()
    finally:
        done.set()
        for t in threads:
            t.join(timeout=120)
    return errors, sum(counts)


def _check_pairs(q, scores, pids, metric):
    """Every (score, id) pair is the score of q against TABLE[id] (the key that id was stored with), rows sorted,
    padding last."""
    valid = pids >= 0
    assert torch.all(scores[~valid] == float("-inf"))
    assert torch.all((pids >= -1) & (pids < N_KEYS)), "a payload id that was never stored"
    keys = TABLE[pids.clamp_min(0)].double()
    if metric == "ip":
        want, rtol = torch.einsum("qd,qkd->qk", q.double(), keys), 1e-4
    else:
        want, rtol = -(q[:, None, :].double() - keys).square().sum(-1), 1e-3
    err = (scores.double() - want).abs()[valid]
    bad = int((err > rtol * (1 + want.abs()[valid])).sum())
    assert bad == 0, f"{bad} of {int(valid.sum())} (score, payload id) pairs do not belong together"
    assert torch.all(scores[:, :-1] >= scores[:, 1:]), "a row is not sorted best first"


@pytest.mark.parametrize(("metric", "eviction"), [("ip", "fifo"), ("l2", "lowest_score")])
def test_search_while_adding_past_the_wrap(metric, eviction):
    """l2: the centre (a running key sum) and lowest_score eviction under the same concurrency."""
    buf = StepBuffer(CAP, D, dtype=torch.float32, metric=metric, eviction=eviction)
    q = torch.randn(8, D)

    def write():
        for start in range(0, N_ADDED, 16):  # wraps the 64-slot ring about 23 times
            ids = torch.arange(start, min(start + 16, N_ADDED))
            buf.add(TABLE[ids], ids, torch.zeros(len(ids), dtype=torch.int64), torch.rand(len(ids)))
            _count_add()

    def read():
        s, p = buf.search(q, 16)
        _check_pairs(q, s, p, metric)

    errors, searches = _run_threads(write, read)
    assert not errors, f"{len(errors)} inconsistent searches of {searches}; first: {errors[0]}"
    assert len(buf) == CAP and searches > 0
    key_sum = getattr(buf, "_key_sum", None)  # the running sum the l2 centre comes from, when there is one
    assert key_sum is None or torch.allclose(key_sum, buf.embeddings.double().sum(0), rtol=1e-9, atol=1e-6)


class _Tok:
    """Step text "s<i>" -> segment [i]: a payload's segment names the key it was stored with."""

    def encode(self, text):
        return [int(w[1:]) for w in text.split() if w.startswith("s")]


def _encoder(texts):
    return TABLE[torch.tensor([int(t.split()[-1][1:]) for t in texts])]


_encoder.dim = D


def test_step_traces_retrieve_while_adding_steps():
    traces = StepTraces(StepBuffer(CAP, D, dtype=torch.float32, metric="ip"), _encoder, _Tok())
    traces.add_steps(["h0"], ["s0"], [0])  # one step before the readers start: every retrieval finds a segment
    hist = ["h3", "h77", "h1000", "h2500"]
    q = _encoder(hist)

    def write():
        for start in range(0, N_ADDED, 16):
            ids = range(start, min(start + 16, N_ADDED))
            traces.add_steps([f"h{i}" for i in ids], [f"s{i}" for i in ids], [0] * len(ids))
            _count_add()

    def read():
        segs, pids, scores = traces.retrieve(hist)
        for r, seg in enumerate(segs):
            # payload id p holds step s<p - 1> (id 0: the first s0); not read back from traces.payloads, which
            # forgets the steps the ring evicted, maybe already this one
            assert seg is not None and seg == [max(int(pids[r]) - 1, 0)]
            want = float(q[r].double() @ TABLE[seg[0]].double())
            assert abs(float(scores[r]) - want) <= 1e-4 * (1 + abs(want)), "a segment paired with another's score"

    errors, searches = _run_threads(write, read)
    assert not errors, f"{len(errors)} inconsistent retrievals of {searches}; first: {errors[0]}"
