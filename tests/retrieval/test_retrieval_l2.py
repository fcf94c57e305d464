"""Exactness of metric="l2" where the expanded form |q|^2 - 2 q.k + |k|^2 cancels in fp32, under every CPU
micro-kernel. Keys far from the origin relative to their spread (2,000 keys 1000 + 0.01 randn(32): 49 of 50 top-1 ids
were wrong): the backends score l2 about the stored keys' mean, checked against the float64 brute force (check_search,
whose l2 tolerance is measured about the keys' mean, so it does not widen with the offset). Far-apart clusters at
+-1e4, whose mean is near the origin again (24 of 25 neighbours were wrong): the search certifies the fp32 answer per
query against float64 distances and falls back to a float64 brute force where it cannot
(rapo_fast/retrieval/l2_exact.py): the same slots as the spec (search_ref), scores equal to the exact ones rounded to
fp32, with exclusion and min_score, and on a hypothesis family of offsets and spreads; the certificate's error bound.

Not here: the other metrics and filters (test_retrieval.py), the chunked search (test_retrieval_l2_memory.py), CUDA
(test_retrieval_gpu.py; the same Python wraps the CUDA backend's chunked search).
"""

from __future__ import annotations

import pytest
import torch
from helpers.retrieval_cases import check_search, cpu_isas, force_isa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapo_fast import StepBuffer
from rapo_fast.reference.retrieval import search_ref
from rapo_fast.retrieval import l2_exact
from rapo_fast.retrieval.op import METRIC_CODES, retrieval_search


@pytest.fixture(params=cpu_isas())
def isa(request, monkeypatch):
    return force_isa(monkeypatch, request.param)


def _far_buffer(n=2000, d=32, offset=1000.0, spread=0.01, dtype=torch.float32, capacity=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = offset + spread * torch.randn(n, d, generator=g)
    buf = StepBuffer(capacity or n, d, dtype=dtype, metric="l2")
    buf.add(keys, torch.arange(n) + 10, torch.zeros(n, dtype=torch.int64))
    return buf, keys, g


@pytest.mark.parametrize("Q", [50, 3])  # the tiled kernels and (Q <= 6) the few-query mode
def test_far_from_origin_top1_is_exact(isa, Q):
    """Queries near 50 of the keys must find them."""
    buf, keys, g = _far_buffer()
    near = torch.randperm(2000, generator=g)[:Q]
    q = keys[near] + 1e-4 * torch.randn(Q, 32, generator=g)
    s, p = buf.search(q, 5)
    ref_s, ref_i = search_ref(buf.embeddings, q, 5, "l2")
    assert torch.equal(p[:, 0] - 10, near), f"{int((p[:, 0] - 10 != near).sum())} of {Q} top-1 ids wrong"
    assert torch.equal(p[:, 0] - 10, ref_i[:, 0])
    check_search(buf, q, 5, s, p)


@pytest.mark.parametrize(
    ("dtype", "offset", "spread"),
    [
        (torch.float32, 1e4, 0.1),
        (torch.float32, -300.0, 1e-3),
        (torch.float16, 10.0, 0.05),
        (torch.bfloat16, 4.0, 0.25),
    ],
)
def test_offset_data_matches_fp64(isa, dtype, offset, spread):
    buf, keys, g = _far_buffer(n=700, d=40, offset=offset, spread=spread, dtype=dtype)
    q = offset + spread * torch.randn(33, 40, generator=g)
    s, p = buf.search(q, 9)
    check_search(buf, q, 9, s, p)


def test_centre_follows_adds_evictions_and_wraps(isa):
    """The running key sum the centre comes from stays right as fifo overwrites slots (and after a load-style
    reset of the sum): results stay exact while the data drifts far from where it started."""
    buf = StepBuffer(300, 16, dtype=torch.float32, metric="l2")
    g = torch.Generator().manual_seed(1)
    for step, offset in enumerate([0.0, 50.0, 500.0, 5000.0]):
        x = offset + 0.05 * torch.randn(220, 16, generator=g)
        buf.add(x, torch.arange(220) + 1000 * step, torch.zeros(220, dtype=torch.int64))
        q = x[:20] + 1e-3 * torch.randn(20, 16, generator=g)
        s, p = buf.search(q, 4)
        check_search(buf, q, 4, s, p)
        torch.testing.assert_close(buf._key_sum, buf.embeddings.double().sum(0), rtol=1e-12, atol=1e-6)
    buf._key_sum = None  # as after a load: recomputed at the next search
    s, p = buf.search(q, 4)
    check_search(buf, q, 4, s, p)


def test_l2_tolerance_is_not_widened_by_the_offset():
    """The helper's l2 tolerance is measured about the keys' mean: shifting every key and query by the same offset
    does not change it (a tolerance about the origin would grow by ~offset^2 and accept any ranking)."""
    from helpers.retrieval_cases import _tolerance

    g = torch.Generator().manual_seed(2)
    keys, q = 0.01 * torch.randn(100, 32, generator=g).double(), 0.01 * torch.randn(5, 32, generator=g).double()
    t0, t1 = _tolerance(keys, q, "l2"), _tolerance(keys + 1000.0, q + 1000.0, "l2")
    torch.testing.assert_close(t0, t1, rtol=1e-6, atol=0)
    gaps = torch.cdist(q, keys).square()
    assert t1.max() < 1e-3 * gaps.min(), "the tolerance must be far below the distances it ranks"


# ---- far-apart clusters: the certified fp32 search and its float64 fallback -----------------------------------------


def _clusters(n=200, d=16, offset=1e4, spread=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)[:, None]
    return sign * offset + spread * torch.randn(n, d, generator=g), g


def _check(buf, keys, queries, k, groups=None, exclude=None, min_score=None):
    scores, payload = buf.search(queries, k, exclude_groups=exclude, min_score=min_score)
    ref_s, ref_i = search_ref(keys, queries, k, "l2", groups=groups, exclude_groups=exclude, min_score=min_score)
    want = torch.where(ref_i >= 0, ref_i + 10, -1)  # payload = slot + 10
    wrong = int((payload != want).sum())
    assert wrong == 0, f"{wrong} of {payload.numel()} neighbours differ from the float64 brute force"
    torch.testing.assert_close(scores, ref_s.float(), rtol=0, atol=0)


def test_far_apart_clusters_top25_exact(isa):
    keys, g = _clusters()
    buf = StepBuffer(len(keys), keys.shape[1], metric="l2", dtype=torch.float32)
    buf.add(keys, torch.arange(len(keys)) + 10, torch.arange(len(keys)) % 7)
    queries = keys[:40] + 0.5 * torch.randn(40, keys.shape[1], generator=g)
    _check(buf, keys, queries, 25)
    _check(buf, keys, queries, 1)
    groups, exclude = torch.arange(len(keys)) % 7, torch.arange(40) % 7 - 1  # -1: no exclusion
    _check(buf, keys, queries, 25, groups=groups, exclude=exclude)
    _check(buf, keys, queries, 25, min_score=-40.0)


def test_certified_path_takes_no_brute_force_on_ordinary_data(monkeypatch):
    """Where the fp32 answer is provably right (keys near their mean), no query pays the float64 brute force."""
    calls = []
    real = l2_exact.brute_force_l2
    monkeypatch.setattr(l2_exact, "brute_force_l2", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(1)
    keys = 1000 + torch.randn(500, 24, generator=g)
    buf = StepBuffer(500, 24, metric="l2", dtype=torch.float32)
    buf.add(keys, torch.arange(500) + 10, torch.zeros(500, dtype=torch.int64))
    _check(buf, keys, torch.randn(30, 24, generator=g) + 1000, 10)
    assert not calls


def test_error_bound_covers_the_fp32_scores():
    """The bound the certificate uses holds for the fp32 search's own scores on cancelling data (a test of the bound:
    |fp32 score + exact distance| <= B for every candidate returned)."""
    keys, g = _clusters(n=100, d=32, offset=3e3, spread=0.3)
    buf = StepBuffer(100, 32, metric="l2", dtype=torch.float32)
    buf.add(keys, torch.arange(100) + 10, torch.zeros(100, dtype=torch.int64))
    centre = keys.double().mean(0).float()
    q = keys[:20] + torch.randn(20, 32, generator=g)
    s32, slots = retrieval_search(
        keys, buf._aux[:100], buf._group[:100], q, None, 30, METRIC_CODES["l2"], float("-inf"), centre
    )
    d = ((q.double()[:, None] - keys.double()[slots]) ** 2).sum(-1)
    q_sq = ((q.double() - centre.double()) ** 2).sum(1)
    r = ((keys.double()[slots] - centre.double()) ** 2).sum(-1).sqrt()
    bound = l2_exact.l2_error_bound(32, q_sq[:, None], r)
    assert bool(((s32.double() + d).abs() <= bound).all())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.sampled_from([0.0, 10.0, 1e3, 1e4, 1e5]),
    spread=st.sampled_from([1e-2, 1.0, 10.0]),
    k=st.integers(1, 30),
    seed=st.integers(0, 1000),
)
def test_property_matches_float64_brute_force(offset, spread, k, seed):
    keys, g = _clusters(n=120, d=8, offset=offset, spread=spread, seed=seed)
    buf = StepBuffer(len(keys), 8, metric="l2", dtype=torch.float32)
    buf.add(keys, torch.arange(len(keys)) + 10, torch.zeros(len(keys), dtype=torch.int64))
    queries = keys[torch.randint(0, len(keys), (7,), generator=g)] + spread * torch.randn(7, 8, generator=g)
    _check(buf, keys, queries, k)
