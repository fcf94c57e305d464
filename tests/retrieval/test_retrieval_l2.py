"""Exactness of metric="l2" for keys far from the origin relative to their spread: the expanded form
|q|^2 - 2 q.k + |k|^2 cancels there (2,000 keys 1000 + 0.01 randn(32): 49 of 50 top-1 ids were wrong), so the
backends score l2 about the stored keys' mean. Checked against the float64 brute force (check_search, whose l2
tolerance is measured about the keys' mean, so it does not widen with the offset) under every CPU micro-kernel.

Not here: the other metrics and filters (test_retrieval.py), CUDA (test_retrieval_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.retrieval_cases import check_search, cpu_isas, force_isa

from rapo_fast import StepBuffer
from rapo_fast.reference.retrieval import search_ref


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
