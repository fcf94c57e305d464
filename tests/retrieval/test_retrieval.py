"""Exactness of StepBuffer.search (C++ CPU backend, every SIMD micro-kernel) against the float64 brute force
rapo_fast.reference.retrieval.search_ref, and of that reference against a direct float64 loop.

Not here: eviction, persistence, argument fuzzing (test_retrieval_buffer.py), torch.compile (test_retrieval_op.py),
l2 far from the origin (test_retrieval_l2.py), distributed (test_retrieval_dist.py), CUDA (test_retrieval_gpu.py).
`check_search` lives in tests/helpers/retrieval_cases.py.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from helpers.retrieval_cases import check_search, cpu_isas, filled_buffer, force_isa

from rapo_fast import StepBuffer
from rapo_fast.reference.retrieval import search_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
METRICS = ["ip", "cosine", "l2"]


@pytest.fixture(params=cpu_isas())
def isa(request, monkeypatch):
    """Every CPU micro-kernel: the packed tiles (dot mode off), and the few-query row-walking dot kernel forced on for
    any Q (one query group up to Q = 6, groups of 4 beyond), chosen under each ISA setting that allows it."""
    return force_isa(monkeypatch, request.param)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("C", "D", "Q", "k"),
    [
        (1000, 37, 33, 7),
        (301, 64, 1, 64),
        (150, 16, 4096, 1),
        # few queries: one group of the dot kernels (Q <= 6), D with a tail past the 8/16-wide loops, and two groups
        (301, 37, 2, 5),
        (200, 100, 3, 3),
        (64, 7, 5, 3),
        (301, 64, 6, 9),
        (257, 45, 7, 9),
        # D past the AVX2 tile's L1 block (232): two D blocks by default, partial scores carried between them
        (203, 300, 40, 5),
    ],
)
def test_matches_fp64(isa, metric, dtype, C, D, Q, k):
    buf = filled_buffer(C, D, dtype, metric)
    q = torch.randn(Q, D)
    s, p = buf.search(q, k)
    check_search(buf, q, k, s, p)


@pytest.mark.parametrize("metric", METRICS)
def test_filters_match_fp64(isa, metric):
    buf = filled_buffer(777, 29, torch.float16, metric, groups=3)
    q = torch.randn(40, 29)
    ex = torch.randint(-1, 3, (40,))
    min_score = {"ip": 0.0, "cosine": 0.05, "l2": -60.0}[metric]
    for kwargs in ({"exclude_groups": ex}, {"min_score": min_score}, {"exclude_groups": ex, "min_score": min_score}):
        s, p = buf.search(q, 64, **kwargs)
        check_search(buf, q, 64, s, p, exclude=kwargs.get("exclude_groups"), min_score=kwargs.get("min_score"))


def test_k1024_partial_fill_and_padding(isa):
    buf = filled_buffer(2000, 24, torch.float32, "ip", n=1500)
    q = torch.randn(9, 24)
    s, p = buf.search(q, 1024)
    check_search(buf, q, 1024, s, p)
    small = filled_buffer(50, 24, torch.float32, "l2", n=13)
    s, p = small.search(q, 20)
    check_search(small, q, 20, s, p)
    assert torch.all(p[:, 13:] == -1) and torch.all(s[:, 13:] == float("-inf"))


def test_filters_that_exclude_everything():
    buf = StepBuffer(100, 8, metric="cosine")
    buf.add(torch.randn(100, 8), torch.arange(100), torch.full((100,), 4))
    q = torch.randn(5, 8)
    s, p = buf.search(q, 3, exclude_groups=torch.full((5,), 4))
    assert torch.all(p == -1) and torch.all(s == float("-inf"))
    s, p = buf.search(q, 3, min_score=1.5)  # cosine never exceeds 1
    assert torch.all(p == -1) and torch.all(s == float("-inf"))
    empty = StepBuffer(10, 8)
    s, p = empty.search(q, 4)
    assert torch.all(p == -1) and torch.all(s == float("-inf")) and s.dtype == torch.float32


@pytest.mark.parametrize("metric", METRICS)
def test_duplicates_break_ties_to_smaller_slot(isa, metric):
    base = torch.randn(10, 40)
    x = base[torch.randint(0, 10, (500,))]  # exact duplicates: bitwise equal scores in every backend
    buf = StepBuffer(500, 40, dtype=torch.bfloat16, metric=metric)
    buf.add(x, torch.arange(500) + 7, torch.zeros(500, dtype=torch.int64))
    q = torch.cat([base[:3], torch.randn(4, 40)])
    s, p = buf.search(q, 60)
    ref_s, ref_i = search_ref(buf.embeddings, q.to(torch.bfloat16), 60, metric)
    assert torch.equal(p - 7, ref_i)
    for row in range(q.shape[0]):  # within each run of equal scores, slots ascend
        for a, b in itertools.pairwise(range(60)):
            if s[row, a] == s[row, b]:
                assert p[row, a] < p[row, b]


def test_reference_against_loop():
    torch.manual_seed(1)
    keys, q = torch.randn(23, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    groups, ex = torch.randint(0, 3, (23,)), torch.tensor([0, -1, 2, 1])
    for metric in METRICS:
        s, i = search_ref(keys, q, 30, metric, groups, ex, min_score=-5.0)
        for r in range(4):
            cand = []
            for j in range(23):
                a, b = q[r], keys[j]
                val = {
                    "ip": float(a @ b),
                    "cosine": float(a @ b / (a.norm() * b.norm())),
                    "l2": -float(((a - b) ** 2).sum()),
                }[metric]
                if val >= -5.0 and not (ex[r] >= 0 and groups[j] == ex[r]):
                    cand.append((-val, j))
            cand.sort()
            assert i[r, : len(cand)].tolist() == [j for _, j in cand]
            torch.testing.assert_close(s[r, : len(cand)], torch.tensor([-v for v, _ in cand], dtype=torch.float64))
            assert torch.all(i[r, len(cand) :] == -1) and torch.all(s[r, len(cand) :] == float("-inf"))


def test_threads_do_not_change_results(isa):
    buf = filled_buffer(5000, 33, torch.float16, "ip")
    q = torch.randn(70, 33)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        s1, p1 = buf.search(q, 9)
        torch.set_num_threads(max(2, n))
        s2, p2 = buf.search(q, 9)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(s1, s2) and torch.equal(p1, p2)


def test_isa_env_rejects_unknown(monkeypatch):
    monkeypatch.setenv("RAPO_FAST_CPU_ISA", "sse9")
    buf = filled_buffer(10, 4, torch.float32, "ip")
    with pytest.raises(ValueError, match="RAPO_FAST_CPU_ISA"):
        buf.search(torch.randn(2, 4), 1)
    monkeypatch.delenv("RAPO_FAST_CPU_ISA")
    assert os.environ.get("RAPO_FAST_CPU_ISA") is None


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_block_env_rejects_non_positive(monkeypatch, value):
    monkeypatch.setenv("RAPO_FAST_CPU_ISA", "scalar")
    monkeypatch.setenv("RAPO_FAST_CPU_DOT", "0")
    monkeypatch.setenv("RAPO_FAST_CPU_KC", value)
    buf = filled_buffer(10, 4, torch.float32, "ip")
    with pytest.raises(ValueError, match="RAPO_FAST_CPU_KC"):
        buf.search(torch.randn(2, 4), 1)
