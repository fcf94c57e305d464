"""Property tests of the retrieval entry points: `StepBuffer` add/search/save/load and `ShardedStepBuffer` in a
single-process gloo group (hypothesis; budget in tests/helpers/strategies.py).

Properties: after any sequence of adds, search equals the float64 brute force up to ties within rounding
(tests/helpers/retrieval_cases.check_search); save then load gives a buffer that searches identically and keeps
adding identically; a bad query, k, min_score or exclude list gets a ValueError/TypeError naming it; a world_size-1
ShardedStepBuffer answers exactly as its StepBuffer. Not here: eviction order models
(tests/retrieval/test_retrieval_buffer.py), crash safety (tests/reliability/), 2-rank groups
(tests/retrieval/test_retrieval_dist.py).
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed as dist
from helpers.retrieval_cases import check_search
from helpers.strategies import float_dtypes, fuzz_settings, seeds
from hypothesis import given
from hypothesis import strategies as st

from rapo_fast import ShardedStepBuffer, StepBuffer
from rapo_fast.reference.retrieval import search_ref

METRICS = st.sampled_from(["ip", "cosine", "l2"])


@st.composite
def filled_buffers(draw, *, dtype=None) -> StepBuffer:
    """A StepBuffer of a drawn shape and options after 1 to 3 random adds (possibly past its capacity)."""
    C, D = draw(st.integers(1, 12)), draw(st.integers(1, 9))
    dt = dtype or draw(float_dtypes)
    buf = StepBuffer(C, D, dtype=dt, metric=draw(METRICS), eviction=draw(st.sampled_from(["fifo", "lowest_score"])))
    g = torch.Generator().manual_seed(draw(seeds))
    pid = 0
    for m in draw(st.lists(st.integers(0, 10), min_size=1, max_size=3)):
        keys = torch.randn(m, D, generator=g) * draw(st.sampled_from([0.01, 1.0, 30.0]))
        if m and draw(st.booleans()):
            keys[-1] = keys[0]  # an exact duplicate: ties go to the smaller slot
        scores = torch.randint(0, 3, (m,), generator=g).float()
        buf.add(keys, torch.arange(pid, pid + m), torch.randint(0, 3, (m,), generator=g), scores)
        pid += m
    return buf


@st.composite
def queries_for(draw, buf: StepBuffer) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw(seeds))
    q = torch.randn(draw(st.integers(0, 5)), buf.dim, generator=g)
    if len(buf) and q.shape[0] and draw(st.booleans()):
        q[0] = buf.embeddings[0].float()  # a query equal to a stored key
    return q


def _check_up_to_ties(buf: StepBuffer, q, k, scores, payload, exclude=None, min_score=None) -> None:
    """check_search over the leading columns whose boundary with the next column is no near-tie in any row, and the
    scores of the rest. check_search sees only the reference's top k, so a tie between the k-th and the (k+1)-th step
    looks clear to it (an exact float64 tie, e.g. cosine at D=1, may go either way in fp32)."""
    keys = buf.embeddings.cpu()
    ex = None if exclude is None else exclude.cpu()
    ref_s, _ = search_ref(keys, q.to(buf.dtype), k + 1, buf.metric, buf.group_ids.cpu(), ex, min_score)
    kmax = keys.double().norm(dim=1).max().item() if len(buf) else 0.0
    # per query, a bound on every metric's score scale, and a near-tie threshold far above fp32 rounding at D <= 9
    loose = (1e-4 * ((q.double().norm(dim=1) + 3 * kmax) ** 2 + 1)).view(-1, 1)
    gap = (ref_s[:, :-1] - ref_s[:, 1:]).nan_to_num(nan=math.inf)  # nan: both padding
    tie = (gap <= loose).any(0)
    j = k
    while j > 0 and bool(tie[j - 1]):
        j -= 1
    if j:
        check_search(buf, q, j, scores[:, :j].contiguous(), payload[:, :j].contiguous(), exclude, min_score)
    want = ref_s[:, :k]
    assert torch.equal(torch.isinf(scores), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.all((scores.double() - want).abs()[fin] <= loose.expand_as(want)[fin]), "scores differ beyond ties"


@fuzz_settings(40)
@given(data=st.data())
def test_search_equals_float64_brute_force(data):
    buf = data.draw(filled_buffers())
    q = data.draw(queries_for(buf))
    k = data.draw(st.integers(1, 14))
    exclude = data.draw(st.none() | st.just(torch.randint(-1, 3, (q.shape[0],))))
    min_score = data.draw(st.none() | st.sampled_from([-0.9, -0.25, 0.5]))  # not 0, +-1: reachable exactly (ties)
    scores, payload = buf.search(q, k, exclude_groups=exclude, min_score=min_score)
    assert not torch.isnan(scores).any()
    _check_up_to_ties(buf, q, k, scores, payload, exclude=exclude, min_score=min_score)


@fuzz_settings(20)
@given(data=st.data())
def test_save_load_round_trip_searches_and_adds_identically(data):
    buf = data.draw(filled_buffers())
    q = data.draw(queries_for(buf))
    more = torch.randn(data.draw(st.integers(0, 6)), buf.dim)
    with tempfile.TemporaryDirectory() as tmp:
        buf.save(tmp)
        back = StepBuffer.load(tmp)
    assert (back.capacity, back.dim, back.dtype, back.metric, back.eviction) == (
        buf.capacity,
        buf.dim,
        buf.dtype,
        buf.metric,
        buf.eviction,
    )
    for b in (buf, back):  # the same future: the same slots for the same adds
        b.add(more, torch.arange(more.shape[0]) + 500, torch.zeros(more.shape[0], dtype=torch.int64))
    assert torch.equal(back.embeddings, buf.embeddings) and torch.equal(back.payload_ids, buf.payload_ids)
    assert torch.equal(back.group_ids, buf.group_ids) and torch.equal(back.scores, buf.scores)
    for k in (1, 3):
        s1, p1 = buf.search(q, k)
        s2, p2 = back.search(q, k)
        assert torch.equal(p1, p2) and torch.equal(s1, s2)


BAD_SEARCH_ARGS = [
    ("k", {"k": 0}, ValueError),
    ("k", {"k": 1025}, ValueError),
    ("k", {"k": 2.0}, TypeError),
    ("k", {"k": True}, TypeError),
    ("min_score", {"min_score": math.nan}, ValueError),
    ("min_score", {"min_score": "0"}, TypeError),
    ("exclude_groups", {"exclude_groups": torch.zeros(7, dtype=torch.int64)}, ValueError),
    ("exclude_groups", {"exclude_groups": torch.zeros(2)}, TypeError),
    ("queries", {"queries": torch.zeros(2, 99)}, ValueError),
    ("queries", {"queries": torch.zeros(2, dtype=torch.int64)}, TypeError),
    ("queries", {"queries": [[0.0]]}, TypeError),
]


@fuzz_settings(25)
@given(case=st.sampled_from(BAD_SEARCH_ARGS), data=st.data())
def test_bad_search_argument_is_named(case, data):
    name, kw, exc = case
    buf = data.draw(filled_buffers())
    args = {"queries": torch.zeros(2, buf.dim), "k": 1, **kw}
    with pytest.raises(exc, match=name):
        buf.search(**args)


@fuzz_settings(20)
@given(
    dtype=float_dtypes,
    bad=st.sampled_from([math.nan, math.inf, -math.inf, 1e5, 1e39]) | st.floats(-1e40, 1e40),
    where=st.tuples(st.integers(0, 1), st.integers(0, 2)),
)
def test_non_finite_or_out_of_range_query_is_refused(dtype, bad, where):
    buf = StepBuffer(4, 3, dtype=dtype)
    buf.add(
        torch.randn(4, 3, generator=torch.Generator().manual_seed(0)),
        torch.arange(4),
        torch.zeros(4, dtype=torch.int64),
    )
    finite_in_dtype = bool(torch.isfinite(torch.tensor(bad, dtype=torch.float64).to(dtype)))
    q = torch.zeros(2, 3, dtype=torch.float64)  # fp64 queries: 1e39 is finite here and out of range in every key dtype
    q[where] = bad
    if finite_in_dtype:
        scores, _ = buf.search(q, 2)
        assert not torch.isnan(scores).any()
        if abs(bad) < 1e30:  # beyond, q.k may overflow the fp32 score: inf, the correct rounding, not garbage
            assert torch.isfinite(scores).all()
    else:
        with pytest.raises(ValueError, match="queries: expected finite values"):
            buf.search(q, 2)


@pytest.fixture(scope="module")
def single_rank_group():
    """A gloo group of one process (this one), torn down after the module."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@fuzz_settings(20)
@given(data=st.data())
def test_sharded_world_size_one_equals_step_buffer(single_rank_group, data):
    ref = data.draw(filled_buffers())
    sharded = ShardedStepBuffer(ref.capacity, ref.dim, ref.dtype, metric=ref.metric, eviction=ref.eviction)
    sharded.local = ref  # the same shard: the collective search must answer exactly as the local one
    q = data.draw(queries_for(ref))
    k = data.draw(st.integers(1, 14))
    exclude = data.draw(st.none() | st.just(torch.randint(-1, 3, (q.shape[0],))))
    min_score = data.draw(st.none() | st.sampled_from([-1.0, 0.5]))
    s1, p1 = ref.search(q, k, exclude_groups=exclude, min_score=min_score)
    s2, p2 = sharded.search(q, k, exclude_groups=exclude, min_score=min_score)
    assert torch.equal(p1, p2) and torch.equal(s1, s2)
    assert sharded.global_len() == len(ref)


@fuzz_settings(20)
@given(case=st.sampled_from(BAD_SEARCH_ARGS), data=st.data())
def test_sharded_bad_argument_is_named(single_rank_group, case, data):
    name, kw, exc = case
    ref = data.draw(filled_buffers())
    sharded = ShardedStepBuffer(ref.capacity, ref.dim, ref.dtype, metric=ref.metric)
    args = {"queries": torch.zeros(2, ref.dim), "k": 1, **kw}
    with pytest.raises(exc, match=name):
        sharded.search(**args)
    s, p = sharded.search(torch.zeros(1, ref.dim), 1)  # the group is still usable
    assert p.tolist() == [[-1]] and s.tolist() == [[-math.inf]]


def test_sharded_add_forwards_pins(single_rank_group):
    """ShardedStepBuffer.add(pinned=) pins in its shard as StepBuffer does: a full shard evicts the unpinned step."""
    sharded = ShardedStepBuffer(2, 3, torch.float32)
    e = torch.eye(3)[:2]
    sharded.add(e[:1], torch.tensor([7]), torch.tensor([0]), pinned=True)
    sharded.add(e[1:], torch.tensor([8]), torch.tensor([0]))
    sharded.add(e[1:], torch.tensor([9]), torch.tensor([1]))  # full: evicts 8 (unpinned), keeps the pinned 7
    _, p = sharded.search(torch.eye(3)[:1], 2)
    assert sorted(p[0].tolist()) == [7, 9]
    assert sharded.pinned.tolist().count(True) == 1
    sharded.set_pinned(torch.tensor([False, False]))
    assert not sharded.pinned.any()
