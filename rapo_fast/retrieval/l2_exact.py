"""Exact l2 top-k whatever the keys' layout: the fp32 search's answer, certified per query, else a float64 search.

Why the fp32 expanded form fails, the certificate's bound and the scores returned: docs/retrieval.md, "l2 certified,
else float64".
What this is not: a kernel (the fp32 search is the backends'), or argument validation (StepBuffer does it first).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CERT_MAX_K", "certified_l2_search", "rescored_l2_search", "l2_error_bound", "brute_force_l2"]

CERT_MAX_K = 256  # the most candidates asked of the fp32 search before a query goes to the float64 brute force
_U32 = 2.0**-24
_TIE = 2.0**-20  # relative margin below d_k: fp32 roundings of the exact scores may tie
_BRUTE_BYTES = 64 << 20  # float64 temporaries of one brute-force block

# fn(queries, exclude, kk) -> (scores [Q, kk] fp32, slots [Q, kk] int64): the fp32 search without min_score, best
# first, -inf / -1 padding
RawSearch = Callable[[torch.Tensor, torch.Tensor | None, int], tuple[torch.Tensor, torch.Tensor]]


def l2_error_bound(dim: int, q_sq: torch.Tensor, r: torch.Tensor, u: float = _U32) -> torch.Tensor:
    """The bound B on |fp32 expanded-form score - exact score| for a key with |k'| <= r, queries with |q'|^2 = q_sq."""
    return (4 * dim + 32) * u * (q_sq + r * r)


def _exact_d(keys: torch.Tensor, q64: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Exact squared distances [Q, m] (float64 direct differences) of queries to the keys at slots (inf at -1).

    One candidate column at a time: a temporary of [Q, D] float64, the size of q64 itself, and a loop over the m
    candidates (k, a call's constant) rather than over query chunks, whose count would depend on Q (under
    torch.compile a Python loop over Q specialises Q: one recompile per query count)."""
    out = torch.full(slots.shape, float("inf"), dtype=torch.float64, device=q64.device)
    for j in range(slots.shape[1]):
        s = slots[:, j]
        d = (keys[s.clamp_min(0)].to(torch.float64) - q64).square_().sum(-1)
        out[:, j] = torch.where(s >= 0, d, out[:, j])
    return out


def _top_exact(d: torch.Tensor, slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of candidates by exact distance, ties to the smaller slot: (scores fp32 = -d rounded, slots)."""
    s32 = (-d).to(torch.float32)
    key_slot = torch.where(slots >= 0, slots, torch.iinfo(torch.int64).max)
    order = torch.sort(key_slot, dim=1, stable=True).indices  # slot order, then a stable sort by score keeps it
    s32, slots = torch.gather(s32, 1, order), torch.gather(slots, 1, order)
    order = torch.sort(s32, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(s32, 1, order), torch.gather(slots, 1, order)


def brute_force_l2(keys, groups, q64, exclude, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 brute-force l2 top-k (direct differences, blocks of _BRUTE_BYTES): (scores fp32, slots), best first,
    ties to the smaller slot, excluded groups dropped, -inf / -1 padding. The spec's formula (search_ref)."""
    nq, c, dim = q64.shape[0], keys.shape[0], q64.shape[1]
    best_d = torch.full((nq, 0), float("inf"), dtype=torch.float64, device=q64.device)
    best_s = torch.full((nq, 0), -1, dtype=torch.int64, device=q64.device)
    rows = max(1, _BRUTE_BYTES // (8 * dim * max(1, nq)))
    for a in range(0, c, rows):
        kc = keys[a : a + rows].to(torch.float64)
        d = (q64[:, None, :] - kc[None]).square_().sum(-1)
        sl = torch.arange(a, a + kc.shape[0], device=q64.device).expand(nq, -1)
        if exclude is not None:
            ex = exclude.view(-1, 1)
            d = torch.where((groups[a : a + rows].view(1, -1) == ex) & (ex >= 0), float("inf"), d)
        sl = torch.where(torch.isinf(d), -1, sl)
        d, sl = torch.cat([best_d, d], 1), torch.cat([best_s, sl], 1)
        order = torch.sort(d, dim=1, stable=True).indices[:, :k]  # earlier slots first among equal d
        best_d, best_s = torch.gather(d, 1, order), torch.gather(sl, 1, order)
    return _pad(*_top_exact(best_d, best_s, k), k)


def _pad(scores: torch.Tensor, slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.where(slots >= 0, scores, float("-inf"))
    if scores.shape[1] < k:
        extra = k - scores.shape[1]
        scores = torch.cat([scores, scores.new_full((scores.shape[0], extra), float("-inf"))], 1)
        slots = torch.cat([slots, slots.new_full((slots.shape[0], extra), -1)], 1)
    return scores, slots


def certified_l2_search(
    keys: torch.Tensor,
    groups: torch.Tensor,
    queries: torch.Tensor,
    exclude: torch.Tensor | None,
    k: int,
    min_score: float,
    centre: torch.Tensor,
    raw: RawSearch,
    max_k: int = CERT_MAX_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact l2 top-k (scores [Q, k] fp32, slots [Q, k] int64) of queries [Q, D] (already in the keys' dtype) against
    keys [C, D], from the fp32 search `raw` certified per query (docs/retrieval.md), else the float64 brute force.
    centre [D]: the mean the fp32 search centres on; groups / exclude as in the search op; min_score applied to the
    exact scores. max_k: the most candidates `raw` can return (the op's MAX_K), capped at CERT_MAX_K."""
    nq, dim, c = queries.shape[0], queries.shape[1], keys.shape[0]
    kmax = max(1, min(max_k, CERT_MAX_K, c))
    q64 = queries.to(torch.float64)
    q_sq = (q64 - centre.to(torch.float64)).square().sum(1)
    out_s = torch.full((nq, k), float("-inf"), dtype=torch.float32, device=queries.device)
    out_i = torch.full((nq, k), -1, dtype=torch.int64, device=queries.device)
    todo = torch.ones(nq, dtype=torch.bool, device=queries.device)
    kk = min(k + 1, kmax)
    while c > 0 and nq > 0:
        rows = todo.nonzero().view(-1)  # the queries not certified yet; q_sq, q64, queries, exclude hold their rows
        s32, slots = raw(queries, exclude, kk)
        d = _exact_d(keys, q64, slots)
        top_s, top_i = _top_exact(d, slots, k)
        n_valid = (slots >= 0).sum(1)
        d_k = torch.sort(d, dim=1).values[:, min(k, kk) - 1]
        s_min = torch.where(slots >= 0, s32, float("inf")).amin(1).to(torch.float64)
        bound = l2_error_bound(dim, q_sq, q_sq.sqrt() + d_k.sqrt())
        ok = (n_valid < kk) | (kk >= c) | (s_min < -d_k * (1 + _TIE) - bound)
        top_s, top_i = _pad(top_s, top_i, k)
        out_s[rows[ok]], out_i[rows[ok]] = top_s[ok], top_i[ok]
        todo[rows[ok]] = False
        q_sq, q64, queries = q_sq[~ok], q64[~ok], queries[~ok]
        exclude = None if exclude is None else exclude[~ok]
        if not bool(todo.any()):
            break
        if kk >= kmax:  # near the fp32 bound: the float64 brute force for the rest
            out_s[rows[~ok]], out_i[rows[~ok]] = brute_force_l2(keys, groups, q64, exclude, k)
            break
        kk = min(kmax, 4 * kk)
    drop = out_s < min_score
    out_s = torch.where(drop, float("-inf"), out_s)
    out_i = torch.where(drop, -1, out_i)
    return out_s, out_i


def rescored_l2_search(
    keys: torch.Tensor, queries: torch.Tensor, k: int, min_score: float, found: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 search's k slots `found` re-scored and re-ordered exactly, without the certificate: no data-dependent
    branch, for torch.compile tracing. Equal to certified_l2_search wherever the certificate holds."""
    slots = found[1]
    s, i = _pad(*_top_exact(_exact_d(keys, queries.to(torch.float64), slots), slots, k), k)
    drop = s < min_score
    return torch.where(drop, float("-inf"), s), torch.where(drop, -1, i)
