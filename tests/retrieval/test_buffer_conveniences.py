"""StepBuffer as a faiss user reaches for it: `add(x)` with automatic ids, NumPy arrays in `add`
and `search`, a 1-D query as one query, `reset()`, and the l2 score's sign (the negative squared distance, so the
opposite of faiss's IndexFlatL2 distances; checked against faiss where it is installed).

Not here: eviction, persistence and argument fuzzing (test_retrieval_buffer.py), search exactness (test_retrieval.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rapo_fast import StepBuffer


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


def test_automatic_ids_count_dropped_steps_too():
    """The insertion number of a step the eviction policy dropped is not reused (ids stay unique)."""
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


def test_l2_scores_are_negative_squared_distances():
    buf = _buf("l2")
    keys = torch.randn(6, 4)
    buf.add(keys)
    q = torch.randn(2, 4)
    scores, ids = buf.search(q, k=6)
    d2 = torch.cdist(q.double(), keys.double()) ** 2
    assert (scores <= 0).all()
    torch.testing.assert_close(scores.double(), -d2.gather(1, ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(ids[:, 0], d2.argmin(1))  # the best score is the nearest key
    faiss = pytest.importorskip("faiss")
    index = faiss.IndexFlatL2(4)
    index.add(keys.numpy())
    dist, fids = index.search(q.numpy(), 6)
    assert torch.equal(torch.from_numpy(fids), ids)
    torch.testing.assert_close(torch.from_numpy(dist), -scores, atol=1e-5, rtol=1e-5)
