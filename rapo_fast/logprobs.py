"""token_logprobs: public entry point (placeholder that calls the reference until the Triton path lands)."""

from __future__ import annotations

import torch

from rapo_fast.reference.logprobs import linear_token_logprobs_ref, token_logprobs_ref


def token_logprobs(
    logits: torch.Tensor | None = None,
    *,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    if logits is not None:
        return token_logprobs_ref(logits, targets, temperature, return_entropy)
    return linear_token_logprobs_ref(hidden, weight, targets, bias, temperature, return_entropy)
