"""l2 search is exact on far-apart clusters.

Two clusters at +-1e4 put the keys' mean near the origin again, so centring on it (docs/retrieval.md) no longer saves
the fp32 expanded form |q'|^2 + |k'|^2 - 2 q'.k': the scores cancelled to 0.0, were clamped, and ties went to the
smallest slot: 24 of 25 neighbours were wrong. The search now certifies the fp32 answer per query against float64
distances and falls back to a float64 brute force where it cannot (rapo_fast/retrieval/l2_exact.py). Checked against
the float64 brute force of the spec (search_ref): the same slots, scores equal to the exact ones rounded to fp32, on
the clusters, on a hypothesis family of offsets and spreads, with exclusion and min_score, and under every CPU
micro-kernel. Not here: the single far cluster (test_retrieval_l2.py), CUDA (no device here: the same Python wraps
the CUDA backend's chunked search).
"""

from __future__ import annotations

import pytest
import torch
from helpers.retrieval_cases import cpu_isas, force_isa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapo_fast import StepBuffer
from rapo_fast.reference.retrieval import search_ref


@pytest.fixture(params=cpu_isas())
def isa(request, monkeypatch):
    return force_isa(monkeypatch, request.param)


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
    from rapo_fast.retrieval import l2_exact

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
    from rapo_fast.retrieval import l2_exact
    from rapo_fast.retrieval.op import METRIC_CODES, retrieval_search

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
