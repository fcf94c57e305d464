"""Reference (spec) of token_logprobs: per-token log-prob of the target and full-vocabulary entropy.

logp_t = log softmax(z_t / T)[y_t],  H_t = -sum_v p_tv log p_tv,  with z_t the logits row, or h_t W^T (+ b).
Computed in fp32 (fp64 when given fp64) with plain torch ops so autograd gives the gradients. This is the spec the
Triton kernels are tested against, and (chunked, in rapo_fast/loss/logprobs.py) the CPU fallback.
What this is not: a fast or memory-bounded path (it materialises [N, V] fp32 tensors), nor a place for argument
checks (rapo_fast.token_logprobs validates before calling it).
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs_ref", "linear_token_logprobs_ref"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_logprobs_ref(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the targets (and entropy) under softmax(logits / temperature).

    logits [..., V] fp32/fp16/bf16/fp64, targets [...] int32/int64 in [0, V) ->
    logp [...] fp32 (fp64 for fp64 logits), and entropy [...] of the same dtype when return_entropy.
    Gradients reach `logits` through both outputs and come back in logits' dtype (autograd of the upcast).
    A row whose log-sum-exp is not finite (only -inf, or any NaN or +inf) gives NaN logp and entropy and a zero
    gradient; -inf entries in a row with a finite entry are ordinary (p = 0).
    """
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    # Non-finite rows (lse not finite: only -inf, a padding row; any NaN or +inf) give NaN log-prob and entropy and an
    # exactly-zero gradient, whatever the upstream gradient: they are computed on a row of zeros chosen by torch.where
    # (whose backward sends nothing to the unchosen branch), never as 0 * NaN. A masked token's row thus cannot put NaN
    # into a gradient (docs/loss.md section 2).
    bad = ~torch.isfinite(torch.logsumexp(z.detach(), dim=-1))
    z = torch.where(bad.unsqueeze(-1), torch.zeros_like(z), z)
    nan = torch.full_like(bad, float("nan"), dtype=z.dtype)
    # Shift-invariant: everything is formed from the logits relative to the row max m, so that the error scales with
    # |z - m|, not with |m| (z_y - lse rounds lse ~ m first: logp 0.0 instead of -log V for an all-equal row at bf16's
    # max; lse - E_p[z] cancels). m is a constant of the gradient: lse(z) = m + lse(z - m) for any m.
    zs = z - z.detach().amax(-1, keepdim=True)
    log_s = torch.logsumexp(zs, dim=-1, keepdim=True)
    logq = zs - log_s  # log p over the vocabulary, -inf where z is
    logp = torch.where(bad, nan, logq.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1))
    if not return_entropy:
        return logp
    p = torch.exp(logq)
    # H = -sum p log p: every term >= 0, nothing cancels. -inf logits (masked vocabulary) have p = 0 and contribute 0;
    # p * -inf would give NaN in the value and, through the product's backward (0 * -inf), in the gradient too, so
    # log p is zeroed there first (docs/pitfalls.md #3).
    entropy = torch.where(bad, nan, -(p * torch.where(p > 0, logq, torch.zeros_like(logq))).sum(-1))
    return logp, entropy


def linear_token_logprobs_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The same as token_logprobs_ref on logits = hidden @ weight.T + bias, computed in fp32 (fp64 for fp64).

    hidden [..., H], weight [V, H], bias [V] or None, targets [...] -> logp [...] (and entropy [...]).
    Materialises the [..., V] logits: this is the spec, not the memory-bounded path.
    A hidden row holding a NaN or an inf is a non-finite row (its logits row has no finite log-sum-exp): NaN log-prob
    and entropy, and an exactly-zero contribution to every gradient, grad_weight and grad_bias included.
    """
    cd = _compute_dtype(hidden.dtype)
    h = hidden.to(cd)
    # grad_W = grad_z^T h sums over every row: a row of h holding NaN/inf would put 0 * NaN = NaN into it even with a
    # zero grad_z row. Such a row is zeroed with torch.where before the matmul (its backward sends exactly 0 to it) and
    # its logits row set to NaN after, so that it is the non-finite row it would have been (docs/loss.md section 2).
    ok = torch.isfinite(h.detach()).all(-1, keepdim=True)
    logits = torch.where(ok, h, torch.zeros_like(h)) @ weight.to(cd).T
    if bias is not None:
        logits = logits + bias.to(cd)
    logits = torch.where(ok, logits, torch.full_like(logits, float("nan")))
    return token_logprobs_ref(logits, targets, temperature, return_entropy)
