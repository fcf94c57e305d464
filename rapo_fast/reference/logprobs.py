"""Reference (spec) of token_logprobs: per-token log-prob of the target and full-vocabulary entropy.

logp_t = log softmax(z_t / T)[y_t],  H_t = -sum_v p_tv log p_tv,  with z_t the logits row, or h_t W^T (+ b).
Computed in fp32 (fp64 when given fp64) with plain torch ops so autograd gives the gradients. This is the spec the
Triton kernels are tested against, and (chunked) the CPU fallback; it is not a fast path.
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs_ref", "linear_token_logprobs_ref"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_logprobs_ref(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False
):
    """logits [..., V] (any float dtype), targets [...] int64 -> logp [...] fp32 (fp64 for fp64 input), and entropy."""
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1) - lse
    if not return_entropy:
        return logp
    p = torch.exp(z - lse.unsqueeze(-1))
    # -inf logits (masked vocab) have p = 0; 0 * -inf would be NaN, and their contribution is 0 (pitfall 3).
    pz = torch.where(p > 0, p * z, torch.zeros_like(p))
    entropy = lse - pz.sum(-1)
    return logp, entropy


def linear_token_logprobs_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """hidden [..., H], weight [V, H], bias [V] or None: the same as token_logprobs_ref on hidden @ weight.T + bias.

    Materialises the logits (this is the spec, not the memory-bounded path).
    """
    cd = _compute_dtype(hidden.dtype)
    logits = hidden.to(cd) @ weight.to(cd).T
    if bias is not None:
        logits = logits + bias.to(cd)
    return token_logprobs_ref(logits, targets, temperature, return_entropy)
