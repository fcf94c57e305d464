"""CUDA backend of StepBuffer.search against the float64 brute force (every metric, dtype, k in {1, 7, 64, 1024},
Q in {1, 33, 4096}, capacities that are not a multiple of the 64-key tile, filters, duplicates), plus stream ordering,
torch.compile, and agreement of the CPU and CUDA backends. Few-query searches (Q in {1, 3, 64}) against 100k keys run
the split rule and the parallel merge of many splits, and forced split counts (1 to 4096, empty splits included) must
give bitwise the same result. Marked gpu: skipped without a CUDA device.

Not here: CPU exactness (test_retrieval.py). They have not yet run on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers.retrieval_cases import check_search, filled_buffer

from rapo_fast import StepBuffer
from rapo_fast._ext import extension
from rapo_fast.reference.retrieval import search_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
METRICS = ["ip", "cosine", "l2"]


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("C", "D", "Q", "k"),
    [
        (1000, 37, 33, 7),
        (3001, 64, 1, 64),
        (200, 16, 4096, 1),
        (2500, 40, 33, 1024),
        (130, 384, 5, 64),
    ],
)
def test_cuda_matches_fp64(metric, dtype, C, D, Q, k):
    buf = filled_buffer(C, D, dtype, metric, device="cuda")
    q = torch.randn(Q, D, device="cuda")
    s, p = buf.search(q, k)
    assert s.device.type == "cuda" and p.device.type == "cuda"
    check_search(buf, q, k, s, p)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("k", [1, 64, 1024])
def test_cuda_filters(metric, k):
    buf = filled_buffer(5000, 48, torch.float16, metric, groups=3, device="cuda")
    q = torch.randn(70, 48, device="cuda")
    ex = torch.randint(-1, 3, (70,), device="cuda")
    thr = {"ip": 0.0, "cosine": 0.05, "l2": -100.0}[metric]
    s, p = buf.search(q, k, exclude_groups=ex, min_score=thr)
    check_search(buf, q, k, s, p, exclude=ex, min_score=thr)
    s, p = buf.search(q, k, exclude_groups=torch.full((70,), 99, device="cuda"), min_score=1e9)
    assert torch.all(p == -1) and torch.all(s == float("-inf"))


def test_cuda_duplicates_ties_and_cpu_agreement():
    base = torch.randn(10, 64)
    x = base[torch.randint(0, 10, (3000,))]
    gpu = StepBuffer(3000, 64, dtype=torch.float16, device="cuda")
    cpu = StepBuffer(3000, 64, dtype=torch.float16)
    for b in (gpu, cpu):
        zeros = torch.zeros(3000, dtype=torch.int64, device=b.device)
        b.add(x.to(b.device), torch.arange(3000, device=b.device), zeros)
    q = torch.cat([base[:3], torch.randn(5, 64)])
    sg, pg = gpu.search(q.cuda(), 500)
    ref_s, ref_i = search_ref(cpu.embeddings, q.half(), 500, "ip")
    assert torch.equal(pg.cpu(), ref_i)  # bitwise-equal duplicate scores: slots ascend within each tie
    sc, pc = cpu.search(q, 500)
    assert torch.equal(pc, pg.cpu())


def test_cuda_empty_and_partial_buffer():
    buf = StepBuffer(100, 8, device="cuda")
    s, p = buf.search(torch.randn(3, 8, device="cuda"), 5)
    assert torch.all(p == -1) and torch.all(s == float("-inf"))
    buf.add(
        torch.randn(3, 8, device="cuda"),
        torch.arange(3, device="cuda"),
        torch.zeros(3, dtype=torch.int64, device="cuda"),
    )
    q = torch.randn(4, 8, device="cuda")
    s, p = buf.search(q, 5)
    check_search(buf, q, 5, s, p)


def test_cuda_runs_on_current_stream_and_compiles():
    buf = filled_buffer(4000, 64, torch.bfloat16, "cosine", device="cuda")
    q = torch.randn(16, 64, device="cuda")
    q_side = torch.zeros_like(q)
    default, side = torch.cuda.current_stream(), torch.cuda.Stream()
    # The buffer, q and q_side were written on the default stream: the side stream waits for them before reading.
    side.wait_stream(default)
    with torch.cuda.stream(side):
        # The queries land on the side stream long after the host has enqueued the search: a search that ran on any
        # stream but the current one would read the zeros and fail check_search below.
        torch.cuda._sleep(50_000_000)
        q_side.copy_(q)
        s, p = buf.search(q_side, 8)
    # s, p were written on the side stream and are read on the default one: order the default stream after side, and
    # tell the caching allocator that these side-stream blocks are in use on the default stream (and q_side's
    # default-stream block on side) so that neither is reused before the other stream is done with it.
    default.wait_stream(side)
    for t in (s, p):
        t.record_stream(default)
    q_side.record_stream(side)
    check_search(buf, q, 8, s, p)
    fn = torch.compile(lambda x: buf.search(x, 8), fullgraph=True)
    s2, p2 = fn(q)
    assert torch.equal(s2, s) and torch.equal(p2, p)


# ---- few queries: the split rule and the parallel merge (csrc/include/rapo/retrieval_cuda_plan.h) ----------------

FEW_C, FEW_D, FEW_GROUPS = 100_000, 48, 7  # 1563 key tiles: more than one wave of splits on any current GPU


def _split_counts(monkeypatch, force=None):
    """Route CUDA searches to the CUDA backend (not the Triton path) and record the split count of each from here on
    (the real rule's, or `force`): a test that asserts on it knows that its searches ran the CUDA backend with that
    many splits."""
    monkeypatch.setenv("RAPO_FAST_RETRIEVAL_BACKEND", "cuda")
    ext = extension()
    real = ext.retrieval_cuda_splits
    seen = []

    def splits(**kw):
        n = real(**kw) if force is None else force
        seen.append(n)
        return n

    monkeypatch.setattr(ext, "retrieval_cuda_splits", splits)
    return seen


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Q", [1, 3, 64])
@pytest.mark.parametrize("k", [1, 3, 64, 1024])
def test_cuda_few_queries_many_splits(monkeypatch, metric, dtype, Q, k):
    buf = filled_buffer(FEW_C, FEW_D, dtype, metric, groups=FEW_GROUPS, device="cuda")
    q = torch.randn(Q, FEW_D, device="cuda")
    ex = torch.randint(-1, FEW_GROUPS, (Q,), device="cuda")
    seen = _split_counts(monkeypatch)
    s, p = buf.search(q, k, exclude_groups=ex)
    assert len(seen) == 1 and 1 <= seen[0] <= 4096
    check_search(buf, q, k, s, p, exclude=ex)
    # about 3 sigma: tens to hundreds of keys eligible per row, so k=1024 rows end in padding after the merge
    thr = {"ip": 25.0, "cosine": 0.5, "l2": -35.0}[metric]
    s, p = buf.search(q, k, exclude_groups=ex, min_score=thr)
    check_search(buf, q, k, s, p, exclude=ex, min_score=thr)


@pytest.mark.parametrize("k", [1, 3, 64, 1024])
@pytest.mark.parametrize("n_splits", [1, 2, 3, 129, 660, 1056, 1563, 4096])
def test_cuda_merge_any_split_count(monkeypatch, k, n_splits):
    buf = filled_buffer(FEW_C, FEW_D, torch.float16, "cosine", groups=FEW_GROUPS, device="cuda")
    q = torch.randn(3, FEW_D, device="cuda")
    ex = torch.tensor([-1, 2, 5], device="cuda")
    natural = _split_counts(monkeypatch)
    want_s, want_p = buf.search(q, k, exclude_groups=ex, min_score=0.1)
    assert len(natural) == 1
    seen = _split_counts(monkeypatch, force=n_splits)  # 4096 > 1563 tiles: some splits are empty
    s, p = buf.search(q, k, exclude_groups=ex, min_score=0.1)
    assert seen == [n_splits]
    check_search(buf, q, k, s, p, exclude=ex, min_score=0.1)
    # a key's score does not depend on its split (splits start on 64-key tiles), so neither does the result
    assert torch.equal(s, want_s) and torch.equal(p, want_p)


def test_cuda_split_rule_on_device():
    ext = extension()
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for Q, C, D, k in [(1, 170_000, 384, 3), (64, 4_000_000, 768, 64), (3, 100, 48, 1024), (4096, 10_000, 64, 8)]:
        for dtype in (0, 1, 2):
            n = ext.retrieval_cuda_splits(Q=Q, C=C, k=k, device=dev, D=D, dtype=dtype)
            assert 1 <= n <= min(4096, -(-C // 64), 32 * sms), (Q, C, D, k, dtype, n)
