"""Reference (spec) of exact step retrieval: a float64 brute-force top-k search, the contract both backends are tested
against.

What this is: the executable form of docs/retrieval.md section 2 (score conventions, ties, eligibility, padding). It
takes l2's direct differences in float64, which need no centring; queries should come rounded to the buffer's dtype,
as the backends score them.
What this is not: a fast path (it materialises the full [Q, C] score matrix in float64) nor the StepBuffer's storage.
"""

from __future__ import annotations

import torch

from rapo_fast._constants import COSINE_EPS

__all__ = ["RETRIEVAL_METRICS", "search_ref", "scores_ref", "key_aux_ref"]

RETRIEVAL_METRICS = ("ip", "cosine", "l2")


def key_aux_ref(keys: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-key auxiliary value stored with each key, in float32: cosine 1/max(|k|, eps), l2 |k|^2, ip zeros. keys
    [C, D]. The l2 search does not read it: it centres keys on their mean and takes |k - m|^2 itself."""
    k64 = keys.to(torch.float64)
    if metric == "cosine":
        aux = 1.0 / k64.norm(dim=-1).clamp_min(COSINE_EPS)
    elif metric == "l2":
        aux = (k64 * k64).sum(-1)
    elif metric == "ip":
        aux = torch.zeros(keys.shape[0], dtype=torch.float64, device=keys.device)
    else:
        raise ValueError(f"metric: expected one of {RETRIEVAL_METRICS}, got {metric!r}")
    return aux.to(torch.float32)


def scores_ref(keys: torch.Tensor, queries: torch.Tensor, metric: str) -> torch.Tensor:
    """Float64 score matrix [Q, C] of queries [Q, D] against keys [C, D] under the conventions above."""
    k64 = keys.to(torch.float64)
    q64 = queries.to(torch.float64)
    if metric == "ip":
        return q64 @ k64.T
    if metric == "cosine":
        kn = k64 / k64.norm(dim=-1, keepdim=True).clamp_min(COSINE_EPS)
        qn = q64 / q64.norm(dim=-1, keepdim=True).clamp_min(COSINE_EPS)
        return qn @ kn.T
    if metric == "l2":
        # Direct differences (no |q|^2 + |k|^2 - 2qk cancellation), chunked over queries to bound memory.
        out = torch.empty(q64.shape[0], k64.shape[0], dtype=torch.float64, device=keys.device)
        step = max(1, (1 << 24) // max(1, k64.numel()))
        for i in range(0, q64.shape[0], step):
            diff = q64[i : i + step, None, :] - k64[None, :, :]
            out[i : i + step] = -(diff * diff).sum(-1)
        return out
    raise ValueError(f"metric: expected one of {RETRIEVAL_METRICS}, got {metric!r}")


def search_ref(
    keys: torch.Tensor,
    queries: torch.Tensor,
    k: int,
    metric: str = "ip",
    groups: torch.Tensor | None = None,
    exclude_groups: torch.Tensor | None = None,
    min_score: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of queries [Q, D] against keys [C, D] (any float dtypes, scored in float64).

    groups [C] int64 and exclude_groups [Q] int64 drop, per query, the slots of its excluded group. Returns
    (scores [Q, k] float64, slots [Q, k] int64): best first, ties to the smaller slot, -inf / -1 padding.
    """
    if keys.dim() != 2 or queries.dim() != 2 or keys.shape[1] != queries.shape[1]:
        raise ValueError(f"keys [C, D] and queries [Q, D] expected, got {tuple(keys.shape)} and {tuple(queries.shape)}")
    C, Q = keys.shape[0], queries.shape[0]
    s = scores_ref(keys, queries, metric)
    eligible = ~torch.isnan(s) & (s > float("-inf"))
    if min_score is not None:
        eligible &= s >= float(min_score)
    if exclude_groups is not None:
        if groups is None:
            raise ValueError("groups: expected a tensor with exclude_groups, got None")
        ex = exclude_groups.to(torch.int64).view(Q, 1)
        eligible &= ~((groups.to(torch.int64).view(1, C) == ex) & (ex >= 0))
    s = torch.where(eligible, s, torch.full_like(s, float("-inf")))
    # A stable descending sort keeps equal scores in slot order: the smaller slot wins a tie.
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    top = torch.gather(s, 1, order)
    slots = torch.where(torch.isfinite(top), order, torch.full_like(order, -1))
    pad = k - top.shape[1]
    if pad > 0:
        top = torch.cat([top, torch.full((Q, pad), float("-inf"), dtype=top.dtype, device=top.device)], 1)
        slots = torch.cat([slots, torch.full((Q, pad), -1, dtype=slots.dtype, device=slots.device)], 1)
    return top, slots
