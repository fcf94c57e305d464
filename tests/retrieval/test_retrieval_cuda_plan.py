"""Host-side tests of the CUDA retrieval backend's GPU-free logic (csrc/include/rapo/retrieval_cuda_plan.h), which the
kernels run as written: the split rule and its cost model (_C.retrieval_cuda_plan, _C.retrieval_cuda_plan_cost), the
key ranges of the splits (_C.retrieval_cuda_split_bounds) and the merge of the splits' sorted lists
(_C.retrieval_merge_splits_host, the host instantiation of the merge kernel's tree of merge-path rounds) against a
sort of the union in the contract's order (docs/retrieval.md: higher score first, equal scores to the smaller slot,
padding -inf / -1).

Not here: the kernels on a GPU (test_retrieval_gpu.py), the CPU backend (test_retrieval.py).
"""

from __future__ import annotations

import pytest
import torch

from rapo_fast._ext import dlpack, extension
from rapo_fast.reference.retrieval import RETRIEVAL_METRICS, scores_ref

H100_SMS = 132
PAPER = dict(C=170_000, D=384)  # the paper's buffer: all-MiniLM-L6-v2 keys


@pytest.fixture(scope="module")
def ext():
    return extension()


# ---- split bounds -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("C", [1, 63, 64, 65, 1000, 170_000, 4_000_000])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 128, 1056, 4096])
def test_splits_cover_all_keys_in_whole_tiles(ext, C, n):
    tiles = -(-C // 64)
    b = torch.tensor(ext.retrieval_cuda_split_bounds(n, C))
    assert b.numel() == n + 1 and b[0] == 0 and b[-1] == C
    sizes = b[1:] - b[:-1]
    assert torch.all(sizes >= 0)
    assert torch.all(b[:-1] % 64 == 0), "a split must start on a 64-key tile"
    if n <= tiles:
        assert torch.all(sizes > 0), "every split must hold keys when there are at least as many tiles"
        t = -(-sizes // 64)
        assert t.max() - t.min() <= 1, "splits must be balanced to one tile"


# ---- the split rule ---------------------------------------------------------------------------------------------


SIZES_C = [1, 100, 64 * 128 + 1, 50_000, 170_000, 1_000_000, 4_000_000]


@pytest.mark.parametrize("Q", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("k", [1, 3, 64, 1024])
@pytest.mark.parametrize("blocks_per_sm", [1, 4, 8])
def test_split_count_bounded_for_few_queries(ext, Q, k, blocks_per_sm):
    bq = 16 if (k > 128 or Q <= 16) else 64
    q_tiles = -(-Q // bq)
    for C in SIZES_C:
        for D in [37, 384, 768]:
            n = ext.retrieval_cuda_plan(Q, C, D, k, H100_SMS, blocks_per_sm)
            tiles = -(-C // 64)
            assert 1 <= n <= min(4096, tiles), (C, D, n)
            # one wave of scoring blocks at most: more splits would not shorten the scan
            n_max = min(tiles, 4096, max(1, blocks_per_sm * H100_SMS // q_tiles))
            assert n <= n_max, (C, D, n)

            def total(m, C=C, D=D):
                return sum(ext.retrieval_cuda_plan_cost(Q, C, D, k, H100_SMS, m, blocks_per_sm))

            # the least predicted scan + merge among the rule's candidates n_max, n_max / 2, ...
            t, m = total(n), n_max
            while m >= 1:
                assert t <= total(m), (C, D, n, m)
                m //= 2


@pytest.mark.parametrize("Q", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("blocks_per_sm", [1, 3, 5, 8, 16])
def test_split_count_follows_merge_and_scan_costs(ext, Q, blocks_per_sm):
    ks = [1, 2, 3, 5, 8, 16, 64, 100, 128] + ([129, 512, 1024] if Q <= 16 else [])  # one query tile size each
    for D in [37, 384, 768]:
        for C in SIZES_C:  # a costlier merge (larger k) never gets more splits
            n = [ext.retrieval_cuda_plan(Q, C, D, k, H100_SMS, blocks_per_sm) for k in ks]
            assert all(a >= b for a, b in zip(n, n[1:])), (C, D, n)
        for k in [1, 3, 64, 100]:  # a longer scan (more keys) never gets fewer
            n = [ext.retrieval_cuda_plan(Q, C, D, k, H100_SMS, blocks_per_sm) for C in SIZES_C + [20_000_000]]
            assert all(a <= b for a, b in zip(n, n[1:])), (k, D, n)


def test_split_count_headline_shapes(ext):
    # RAPO's per-step search at paper scale: a small k makes the merge cheap, so the scan gets many splits
    n = ext.retrieval_cuda_plan(1, PAPER["C"], PAPER["D"], 3, H100_SMS, 5)
    assert 330 <= n <= 660
    scan, merge = ext.retrieval_cuda_plan_cost(1, PAPER["C"], PAPER["D"], 3, H100_SMS, n, 5)
    assert merge <= 0.15 * scan
    # Q=64 against 4M keys, k=64: one wave of 3 blocks per SM, well under the old 1056 splits
    n = ext.retrieval_cuda_plan(64, 4_000_000, 768, 64, H100_SMS, 3)
    assert 128 <= n <= 3 * H100_SMS
    scan, merge = ext.retrieval_cuda_plan_cost(64, 4_000_000, 768, 64, H100_SMS, n, 3)
    assert merge <= 0.01 * scan
    # a large k with a short scan: few splits, the merge of k=1024 lists being what costs
    n = ext.retrieval_cuda_plan(1, 50_000, 64, 1024, H100_SMS, 1)
    assert n <= 64
    # many queries: one split per wave slot at most, and at least one
    assert ext.retrieval_cuda_plan(4096, 4_000_000, 768, 64, H100_SMS, 3) >= 1
    assert ext.retrieval_cuda_plan(100_000, 1000, 64, 8, H100_SMS, 3) == 1


def test_split_count_edges(ext):
    assert ext.retrieval_cuda_plan(0, 1000, 64, 3, H100_SMS) == 1
    assert ext.retrieval_cuda_plan(5, 0, 64, 3, H100_SMS) == 1
    assert ext.retrieval_cuda_plan(5, 1, 64, 3, H100_SMS) == 1
    # the [n, Q, k] workspace stays under 1 GiB
    Q, k = 60_000, 1024
    n = ext.retrieval_cuda_plan(Q, 4_000_000, 768, k, H100_SMS, 8)
    assert n == 1 or n * Q * k * 8 <= 1 << 30
    with pytest.raises(ValueError):
        ext.retrieval_cuda_plan_cost(1, 100, 8, 3, H100_SMS, 0)


# ---- the merge --------------------------------------------------------------------------------------------------


def _ordered(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Indices putting (scores, ids) in the contract's order: higher score first, equal scores to the smaller id."""
    by_id = torch.argsort(ids, stable=True)
    by_score = torch.argsort(scores[by_id], descending=True, stable=True)
    return by_id[by_score]


def _top(scores, ids, k):
    """The first k eligible entries in order, padded with (-inf, -1): a split's list or the expected result."""
    o = _ordered(scores, ids)[:k]
    s = torch.full((k,), float("-inf"))
    i = torch.full((k,), -1, dtype=torch.int64)
    s[: o.numel()] = scores[o]
    i[: o.numel()] = ids[o]
    return s, i


def _run_merge(ext, scores, eligible, n, k):
    """scores [Q, C] with eligible [Q, C]: the per-split lists as the scoring kernel writes them ([n, Q, k] fp32 /
    int32 over the split bounds), merged on the host; returns the merge and the expected top-k."""
    Q, C = scores.shape
    bounds = ext.retrieval_cuda_split_bounds(n, C)
    ws_s = torch.empty(n, Q, k, dtype=torch.float32)
    ws_i = torch.empty(n, Q, k, dtype=torch.int32)
    want_s = torch.empty(Q, k)
    want_i = torch.empty(Q, k, dtype=torch.int64)
    ids = torch.arange(C)
    for q in range(Q):
        for s in range(n):
            sel = torch.arange(bounds[s], bounds[s + 1])
            sel = sel[eligible[q, sel]]
            ls, li = _top(scores[q, sel], ids[sel], k)
            ws_s[s, q], ws_i[s, q] = ls, li.to(torch.int32)
        want_s[q], want_i[q] = _top(scores[q, eligible[q]], ids[eligible[q]], k)
    out_s = torch.full((Q, k), 7.0)
    out_i = torch.full((Q, k), 7, dtype=torch.int64)
    ext.retrieval_merge_splits_host(dlpack(ws_s), dlpack(ws_i), dlpack(out_s), dlpack(out_i))
    return out_s, out_i, want_s, want_i


@pytest.mark.parametrize(
    ("C", "n", "k"),
    [
        (1, 1, 1),
        (200, 1, 5),  # one split: the merge only converts and pads
        (300, 2, 9),  # k not a multiple of the 8-output chunk
        (640, 3, 64),  # an odd list copied through a round
        (2000, 31, 3),
        (5000, 79, 64),  # one group of 79 lists (G=128 at k=64): 7 rounds, odd counts on the way
        (20_000, 200, 64),  # two levels: 2 groups of 128 / 72, then 2 lists
        (9000, 100, 1024),  # G=8 at k=1024: 13 groups, then 2, then 1 (three levels)
        (700, 11, 1024),  # k > C: padding
        (4000, 2, 100),  # k = 100 over 2, 13 and 63 splits: each the sort of the union, so the same result for every n
        (4000, 13, 100),
        (4000, 63, 100),
        (64 * 4096, 4096, 1),  # the most splits, k=1 (G=4096 fits one group)
    ],
)
def test_merge_equals_sort_of_union(ext, C, n, k):
    Q = 3
    # few distinct values: many equal scores across splits, so ties must go to the smaller slot
    scores = torch.randint(-20, 20, (Q, C)).float() / 4
    scores[1] = torch.randn(C)
    eligible = torch.ones(Q, C, dtype=torch.bool)
    eligible[2] = torch.rand(C) < 0.3  # an excluded group / min_score: some splits hold fewer than k, some none
    out_s, out_i, want_s, want_i = _run_merge(ext, scores, eligible, n, k)
    assert torch.equal(out_i, want_i)
    assert torch.equal(out_s, want_s)


@pytest.mark.parametrize("metric", RETRIEVAL_METRICS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("C", "D", "Q", "k", "n"), [(1, 8, 2, 3, 1), (1000, 37, 3, 1024, 16), (5000, 40, 3, 64, 79)])
def test_merge_of_metric_scores_with_filters(ext, metric, dtype, C, D, Q, k, n):
    """The CUDA pipeline's CPU twin on real scores: each split's eligible top-k (exclusion group, min_score) as the
    scoring kernel keeps it, merged on the host, equals the top-k of all eligible keys in the contract's order."""
    keys = torch.randn(C, D).to(dtype)
    q = torch.randn(Q, D).to(dtype)
    groups = torch.randint(0, 4, (C,))
    exclude = torch.tensor([-1, 1, 3][:Q])
    scores = scores_ref(keys, q, metric).float()  # the fp32 scores the kernel lists hold
    thr = scores.median().item()
    eligible = (scores >= thr) & ~((groups[None, :] == exclude[:, None]) & (exclude[:, None] >= 0))
    out_s, out_i, want_s, want_i = _run_merge(ext, scores, eligible, n, k)
    assert torch.equal(out_i, want_i) and torch.equal(out_s, want_s)


def test_merge_nothing_eligible_pads(ext):
    scores = torch.randn(2, 3000)
    out_s, out_i, _, _ = _run_merge(ext, scores, torch.zeros(2, 3000, dtype=torch.bool), 47, 64)
    assert torch.all(out_i == -1) and torch.all(out_s == float("-inf"))


def _merge_sized(ext, n, Q, k, out_k=None):
    """The host merge on fresh tensors of [n, Q, k] lists into [Q, out_k (default k)] outputs."""
    out_k = k if out_k is None else out_k
    ws = (torch.zeros(n, Q, k), torch.zeros(n, Q, k, dtype=torch.int32))
    out = (torch.zeros(Q, out_k), torch.zeros(Q, out_k, dtype=torch.int64))
    ext.retrieval_merge_splits_host(*(dlpack(t) for t in ws + out))


def test_merge_rejects_bad_sizes(ext):
    with pytest.raises(ValueError):
        _merge_sized(ext, 0, 1, 3)
    with pytest.raises(ValueError):
        _merge_sized(ext, 1, 1, 1025)
    with pytest.raises(ValueError):
        _merge_sized(ext, 1, 1, 3, out_k=2)  # outputs that do not match the lists (was: null pointers)
