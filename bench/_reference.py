"""Untimed references that the loss and token log-prob benches check every provider against, computed once per shape.

Why not the eager provider's own output: the check then depended on the eager provider running first (and at all); a
run asked for `--providers rapo_fast_hidden` alone, or with the eager one last, had nothing or a later value to compare
with. These are computed in fp32 from the inputs, in row chunks (ROW_BUDGET_BYTES of fp32 logits at a time), so they
never hold the [N, V] fp32 logits at once: 16k x 152k would be 10 GB, several times what the providers themselves need.
What this is not: a provider (nothing here is timed) nor the library's reference (rapo_fast.reference materialises the
whole [N, V]: it is the spec the kernels are tested against).
"""

from __future__ import annotations

import torch

ROW_BUDGET_BYTES = 256 * 2**20  # fp32 logits of one row chunk


def chunk_rows(v: int) -> int:
    return max(1, ROW_BUDGET_BYTES // (4 * v))


def _logits_chunks(hidden: torch.Tensor | None, weight: torch.Tensor | None, logits: torch.Tensor | None, n: int):
    """(r0, r1, fp32 logits of rows r0:r1): from the given logits, or from hidden @ weight^T in fp32."""
    v = logits.shape[-1] if logits is not None else weight.shape[0]
    w32 = weight.float() if logits is None else None  # [V, H] fp32 once (no copy when already fp32)
    rows = chunk_rows(v)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        z = logits[r0:r1].float() if logits is not None else hidden[r0:r1].float() @ w32.T
        yield r0, r1, z


@torch.no_grad()
def token_logp(
    targets: torch.Tensor,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """log softmax(z)[target] in fp32 for z = logits, or z = hidden @ weight^T (hidden [N, H] or [..., H]; targets of
    the leading shape): the same shape as targets."""
    lead = targets.shape
    t = targets.reshape(-1)
    h = hidden.reshape(-1, hidden.shape[-1]) if hidden is not None else None
    z2 = logits.reshape(-1, logits.shape[-1]) if logits is not None else None
    out = torch.empty(t.numel(), dtype=torch.float32, device=t.device)
    for r0, r1, z in _logits_chunks(h, weight, z2, t.numel()):
        out[r0:r1] = z.gather(1, t[r0:r1, None]).squeeze(1) - torch.logsumexp(z, dim=1)
    return out.view(lead)


def logits_grad(z: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor) -> torch.Tensor:
    """d(sum_i g_i logp_i)/dz for fp32 logits rows z: g_i (onehot(y_i) - softmax(z_i))."""
    g = -torch.softmax(z, dim=1)
    g.scatter_add_(1, targets[:, None], torch.ones_like(targets[:, None], dtype=g.dtype))
    return g * grad_logp[:, None].float()


@torch.no_grad()
def hidden_grads(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor
) -> dict[str, torch.Tensor]:
    """fp32 gradients of sum_i g_i logp_i with respect to hidden [N, H] and weight [V, H], row chunk by row chunk."""
    w32 = weight.float()
    grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for r0, r1, z in _logits_chunks(hidden, w32, None, hidden.shape[0]):
        gz = logits_grad(z, targets[r0:r1], grad_logp[r0:r1])
        grad_h[r0:r1] = gz @ w32
        grad_w.addmm_(gz.T, hidden[r0:r1].float())
    return {"hidden": grad_h, "weight": grad_w}
