"""Shared check of the retrieval tests: `check_search` asserts that a StepBuffer search equals the float64 brute force
(rapo_fast.reference.retrieval.search_ref) up to ties within rounding; `filled_buffer` makes the random buffer it is
run on; `cpu_isas` / `force_isa` select each CPU micro-kernel. Not a test file.

Tolerance: per query, 4 * D * 2^-23 times the score's scale (|q| max|k| for ip, 1 for cosine, (|q - m| + max|k - m|)^2
for l2, m the mean of the stored keys), plus 1e-6: a worst case of fp32 accumulation. The l2 scale is measured about
the keys' mean because the backends score l2 about it (docs/retrieval.md): a scale measured about the origin,
(|q| + max|k|)^2, would grow with the keys' offset from the origin and let any ranking of keys far from it pass.
"""

from __future__ import annotations

import torch

from rapo_fast import StepBuffer
from rapo_fast.reference.retrieval import scores_ref, search_ref


def _tolerance(keys: torch.Tensor, queries: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-query bound on |fp32-accumulated score - float64 score|: D * 2^-23 times the score's scale, a worst case."""
    D = keys.shape[1]
    k64, q64 = keys.double(), queries.double()
    if metric == "l2" and keys.shape[0]:  # about the keys' mean, as the backends score l2
        m = k64.mean(0)
        k64, q64 = k64 - m, q64 - m
    qn = q64.norm(dim=1)
    kmax = k64.norm(dim=1).max() if keys.shape[0] else torch.tensor(0.0, dtype=torch.float64)
    scale = {"ip": qn * kmax, "cosine": torch.ones_like(qn), "l2": (qn + kmax) ** 2}[metric]
    return 4 * D * 2.0**-23 * scale + 1e-6


def cpu_isas() -> list[str]:
    """Every CPU micro-kernel this machine can run, each under its own name: the packed tiles of each ISA (scalar,
    avx2, avx512), the same tiles with D split into blocks of 8 ("avx2-kc8": partial scores carried across blocks,
    RAPO_FAST_CPU_KC) and the few-query row-walking dot kernels ("avx2-dot", "avx512-dot"). Tests parametrize over
    all of them (force_isa), so the AVX2 paths get the same exactness tests as the AVX-512 ones."""
    from rapo_fast._ext import extension

    best = extension().retrieval_cpu_isa(-1)
    order = ["scalar", "avx2", "avx512"]
    isas = order[: order.index(best) + 1]
    return isas + [f"{i}-kc8" for i in isas] + [f"{i}-dot" for i in isas if i != "scalar"]


def force_isa(monkeypatch, name: str) -> str:
    """Make the CPU backend use micro-kernel `name` (one of cpu_isas()) for the rest of the test."""
    monkeypatch.setenv("RAPO_FAST_CPU_ISA", name.split("-")[0])
    monkeypatch.setenv("RAPO_FAST_CPU_DOT", "1" if name.endswith("-dot") else "0")
    if name.endswith("-kc8"):
        monkeypatch.setenv("RAPO_FAST_CPU_KC", "8")
    else:
        monkeypatch.delenv("RAPO_FAST_CPU_KC", raising=False)
    return name


def filled_buffer(C, D, dtype, metric, n=None, groups=5, device="cpu") -> StepBuffer:
    """A StepBuffer of capacity C holding n (default C) random steps on `device`: payload id = insertion number + 1000,
    random groups in [0, groups) and random scores."""
    buf = StepBuffer(C, D, dtype=dtype, metric=metric, device=device)
    n = C if n is None else n
    keys = torch.randn(n, D, device=device)
    pids, group_ids = torch.arange(n, device=device) + 1000, torch.randint(0, groups, (n,), device=device)
    buf.add(keys, pids, group_ids, torch.randn(n, device=device))
    return buf


def check_search(buf: StepBuffer, queries, k, scores, payload, exclude=None, min_score=None, slots=None):
    """Assert (scores, payload) of buf.search equal the float64 brute force up to ties within rounding."""
    keys = buf.embeddings.cpu()
    q = queries.cpu().to(buf.dtype)
    groups = buf.group_ids.cpu()
    ex = None if exclude is None else exclude.cpu()
    # k + 1 from the reference: a tie between the k-th and the (k+1)-th key is a near-tie too (either may be returned)
    ref_s1, _ = search_ref(keys, q, k + 1, buf.metric, groups, ex, min_score)
    ref_s, ref_i = search_ref(keys, q, k, buf.metric, groups, ex, min_score)
    scores, payload = scores.cpu().double(), payload.cpu()
    assert scores.shape == (q.shape[0], k) and payload.shape == (q.shape[0], k)
    # Map payload ids back to slots (tests use payload = slot + offset with unique payloads).
    pay = buf.payload_ids.cpu()
    if slots is None:
        lookup = {int(p): i for i, p in enumerate(pay.tolist())}
        slots = torch.tensor(
            [[lookup.get(int(p), -1) if p >= 0 else -1 for p in row] for row in payload.tolist()], dtype=torch.int64
        ).view(q.shape[0], k)
    pad = ref_i < 0
    assert torch.equal(slots < 0, pad), f"padding differs: got {(slots < 0).sum()} want {pad.sum()} padded entries"
    assert torch.all(scores[pad] == float("-inf")), "padding scores must be -inf"
    tol = _tolerance(keys, q, buf.metric).view(-1, 1).expand_as(ref_s)
    valid = ~pad
    err = (scores - ref_s).abs()
    assert torch.all(err[valid] <= tol[valid]), f"score error {err[valid].max():.3g} > tol {tol[valid].min():.3g}"
    if valid.any():
        S = scores_ref(keys, q, buf.metric)
        rows = torch.arange(q.shape[0]).view(-1, 1).expand_as(slots)
        own = S[rows[valid], slots[valid]]
        assert torch.all((own - scores[valid]).abs() <= tol[valid]), "a returned slot's own score differs"
        if ex is not None:
            g = groups[slots[valid]]
            e = ex.view(-1, 1).expand_as(slots)[valid]
            assert not torch.any((g == e) & (e >= 0)), "an excluded group was returned"
        for r in range(q.shape[0]):
            row = slots[r][slots[r] >= 0].tolist()
            assert len(set(row)) == len(row), f"duplicate slot in row {r}"
        # Where the reference has no near-tie, the slot must be exactly the reference's.
        gap_prev = torch.cat([torch.full_like(ref_s[:, :1], float("inf")), ref_s[:, :-1] - ref_s[:, 1:]], 1)
        beyond = ref_s1[:, k : k + 1].double()
        last = torch.where(beyond > float("-inf"), ref_s[:, -1:] - beyond, torch.full_like(beyond, float("inf")))
        gap_next = torch.cat([ref_s[:, :-1] - ref_s[:, 1:], last], 1)
        clear = valid & (gap_prev > 2 * tol) & (gap_next > 2 * tol)
        assert torch.equal(slots[clear], ref_i[clear]), "a slot without a near-tie differs from the reference"
    return ref_s, ref_i
