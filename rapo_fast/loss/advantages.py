"""RAPO's small advantage helpers (docs/loss.md section 8): step entropy, retrieval reward, combined advantage.

Plain torch on [B]/[S]/[B, R] vectors, no kernel: they are tiny next to the loss. Arguments are validated (with one
device sync) like every public function. What this is not: the per-token loss (rapo_fast/loss/policy_loss.py) or the
entropy itself (rapo_fast.token_logprobs(..., return_entropy=True) gives the per-token entropy these consume).
"""

from __future__ import annotations

from typing import Literal

import torch

from rapo_fast import _checks as C

__all__ = ["step_entropy", "retrieval_reward", "rapo_advantages", "retrieval_advantage", "group_normalize", "RET_NORMS"]

# the rows A_ret is normalised over (rapo_advantages' ret_norm)
RET_NORMS = ("group", "retrieved")


def step_entropy(entropy: torch.Tensor, step_spans: torch.Tensor) -> torch.Tensor:
    """Mean entropy of each step's tokens.

    entropy: float [B, T] (padded, with step_spans int [S, 3] rows (row, start, end)) or flat [N] (with step_spans
    [S, 2] rows (start, end)); end is exclusive, 0 <= start <= end <= T (or N). Returns [S] in entropy's dtype
    (computed in fp64); a step with no tokens gets 0. Differentiable w.r.t. entropy.
    """
    C.check_tensor("entropy", entropy, ndim=(1, 2), dtypes=C.FLOAT_DTYPES)
    cols = 3 if entropy.dim() == 2 else 2
    C.check_tensor("step_spans", step_spans, ndim=2, dtypes=C.INT_DTYPES)
    if step_spans.shape[1] != cols:
        raise ValueError(
            f"step_spans: expected shape (S, {cols}) for entropy of {entropy.dim()} dims "
            f"({'(row, start, end)' if cols == 3 else '(start, end)'}), got {tuple(step_spans.shape)}"
        )
    C.check_same_device(entropy=entropy, step_spans=step_spans)
    spans = step_spans.to(torch.int64)
    ent = entropy if entropy.dim() == 2 else entropy.unsqueeze(0)
    if cols == 2:
        spans = torch.cat([torch.zeros_like(spans[:, :1]), spans], dim=1)
    B, T = ent.shape
    if spans.numel():
        C.check_index_range("step_spans[:, 0] (row)", spans[:, 0], B)
        C.check_index_range("step_spans start", spans[:, 1], T + 1)
        C.check_index_range("step_spans end", spans[:, 2], T + 1)
        bad = torch.nonzero(spans[:, 2] < spans[:, 1])
        if bad.numel():
            raise ValueError(f"step_spans: expected start <= end in every row, got start > end in row {int(bad[0])}")
    # prefix sums in fp64 so that a long row's sum does not lose the small steps' precision
    cs = torch.cat([ent.new_zeros((B, 1), dtype=torch.float64), ent.to(torch.float64).cumsum(1)], dim=1)
    row, start, end = spans.unbind(1)
    total = cs[row, end] - cs[row, start]
    count = (end - start).to(torch.float64)
    return torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total)).to(entropy.dtype)


def retrieval_reward(h_before: torch.Tensor, h_after: torch.Tensor) -> torch.Tensor:
    """Retrieval reward Z of each trajectory (RAPO): mean over its retrievals of tanh(2 * H_delta) * H_b, with
    H_delta = -(H_a - H_b) / H_b.

    h_before, h_after: float [B, R], the step entropy before and after each retrieval; NaN (in both) where trajectory
    b made fewer than R retrievals. Returns [B] in the input dtype (computed in fp64); 0 for a trajectory with no
    retrieval. A retrieval with H_b = 0 contributes 0 (the limit of tanh(.) * H_b as H_b -> 0).
    """
    C.check_tensor("h_before", h_before, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.check_tensor("h_after", h_after, shape=tuple(h_before.shape), dtypes=C.FLOAT_DTYPES)
    C.check_same_device(h_before=h_before, h_after=h_after)
    nb, na = torch.isnan(h_before), torch.isnan(h_after)
    if bool((nb != na).any()):
        raise ValueError(
            f"h_before/h_after: expected NaN (no retrieval) at the same positions in both, got {int((nb != na).sum())} "
            "position(s) NaN in one only"
        )
    hb = torch.where(nb, 0.0, h_before.to(torch.float64))
    ha = torch.where(na, 0.0, h_after.to(torch.float64))
    C.check_finite("h_before", hb)  # NaN means "no retrieval"; inf is an error
    C.check_finite("h_after", ha)
    valid = ~nb & (hb != 0)
    delta = -(ha - hb) / torch.where(valid, hb, torch.ones_like(hb))
    z = torch.where(valid, torch.tanh(2.0 * delta) * hb, torch.zeros_like(hb))
    count = (~nb).sum(1)
    return (z.sum(1) / count.clamp_min(1)).to(h_before.dtype)


def group_normalize(values: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group normalisation: (x - mean_g) / (std_g + eps) with the unbiased (Bessel) std of x's group, as TRL and
    verl compute it. A group whose values are all equal (std 0, including a group of one) gets exactly 0.
    values: float [B]; group_ids: integer [B] (any labels). Returns [B] in values' dtype (computed in fp64)."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    x = values.to(torch.float64)
    count = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, inv, torch.ones_like(x))
    mean = torch.zeros_like(count).index_add_(0, inv, x) / count
    dev = x - mean[inv]
    var = torch.zeros_like(count).index_add_(0, inv, dev * dev) / (count - 1).clamp_min(1)
    hi = torch.full_like(count, -torch.inf).scatter_reduce(0, inv, x, "amax")
    lo = torch.full_like(count, torch.inf).scatter_reduce(0, inv, x, "amin")
    # equal values: (x - mean) would be rounding noise divided by eps; the contract is exactly 0
    const = (hi == lo)[inv]
    out = torch.where(const, torch.zeros_like(x), dev / (var.sqrt()[inv] + eps))
    return out.to(values.dtype)


def rapo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    z_ret: torch.Tensor,
    a: float = 0.2,
    eps: float = 1e-6,
    *,
    ret_norm: Literal["group", "retrieved"] = "group",
    retrieved: torch.Tensor | None = None,
) -> torch.Tensor:
    """RAPO's combined advantage A = (1 + a * A_ret) * A_acc per trajectory.

    rewards (outcome), z_ret (retrieval reward, e.g. from retrieval_reward): float [B]; group_ids: integer [B], the
    prompt group of each trajectory. A_acc = group_normalize(rewards) over every row of the group: (x - mean_g) /
    (std_g + eps), unbiased std, eps = 1e-6 by default; a group with std 0 gets A = 0.

    ret_norm picks the rows A_ret is normalised over (docs/loss.md section 8):
    - "group" (default): group_normalize(z_ret) over every row of the group, rows without a retrieval included with
      their Z = 0; such a row then gets A_ret != 0 whenever the group's Z vary, so its advantage is scaled too.
    - "retrieved": z-scored over the rows of the group that retrieved (retrieved, bool [B], required), the others get
      A_ret = 0 exactly (A = A_acc) and their z_ret is ignored; a group with one retrieving row, or retrieving rows of
      equal Z, gives them A_ret = 0 (the std-0 rule). With every row retrieving it equals "group" bit for bit.
    Why "group" is the default (the paper's formula as written): docs/loss.md section 8.
    Returns [B] in rewards' dtype; pass it to rapo_loss as per-sequence advantages.
    """
    C.check_tensor("rewards", rewards, ndim=1, dtypes=C.FLOAT_DTYPES)
    C.check_tensor("group_ids", group_ids, shape=tuple(rewards.shape), dtypes=C.INT_DTYPES)
    C.check_tensor("z_ret", z_ret, shape=tuple(rewards.shape), dtypes=C.FLOAT_DTYPES)
    C.check_choice("ret_norm", ret_norm, RET_NORMS)
    if ret_norm == "retrieved":
        if retrieved is None:
            raise ValueError("retrieved: expected a bool tensor of shape (B,) with ret_norm='retrieved', got None")
        C.check_tensor("retrieved", retrieved, shape=tuple(rewards.shape), dtypes=(torch.bool,))
    elif retrieved is not None:  # a mask that would silently do nothing is a caller's mistake
        raise ValueError(
            f"retrieved: expected None unless ret_norm='retrieved', got a tensor with ret_norm={ret_norm!r}"
        )
    C.check_same_device(rewards=rewards, group_ids=group_ids, z_ret=z_ret, retrieved=retrieved)
    C.check_float("a", a)
    C.check_float("eps", eps, min_value=0.0, min_inclusive=False)
    C.check_finite("rewards", rewards)
    C.check_finite("z_ret", z_ret)
    a_acc = group_normalize(rewards, group_ids, eps).to(torch.float64)
    a_ret = retrieval_advantage(z_ret, group_ids, eps, retrieved)
    return ((1.0 + a * a_ret) * a_acc).to(rewards.dtype)


def retrieval_advantage(
    z_ret: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, retrieved: torch.Tensor | None = None
) -> torch.Tensor:
    """A_ret [B] float64 of rapo_advantages (arguments already checked there): group_normalize(z_ret) over every row
    of the group (retrieved None: ret_norm="group"), or over the retrieving rows only, the others 0 exactly."""
    if retrieved is None:
        return group_normalize(z_ret, group_ids, eps).to(torch.float64)
    # the same group_normalize on the retrieving rows only, so that "every row retrieved" equals "group" exactly
    rows = torch.nonzero(retrieved).flatten()
    a_ret = torch.zeros(z_ret.shape, dtype=torch.float64, device=z_ret.device)
    a_ret[rows] = group_normalize(z_ret[rows], group_ids[rows], eps).to(torch.float64)
    return a_ret
