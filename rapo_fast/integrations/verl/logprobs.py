"""verl's fused log-prob contract through rapo_fast's kernels, for verl's actor (FSDP/Megatron workers).

What it is: `fused_logprobs_from_hidden` (the contract of verl's `FusedLinearForPPO.forward`, without materialising
[N, V]), `RAPOFusedLinearForPPO` (it as a module), `logprobs_from_logits` (verl's unfused path), and `register()`
(opt-in, RAPO_FAST_VERL_FUSED_LOGPROBS=1), which puts RAPOFusedLinearForPPO in place of verl's class.
What it is not: the policy loss (rapo_fast/integrations/verl/policy_loss.py). Importing it imports neither verl nor
ray (register() and unregister() import verl).
"""

from __future__ import annotations

import torch

from rapo_fast.integrations.verl import verl_compat

__all__ = ["fused_logprobs_from_hidden", "logprobs_from_logits", "RAPOFusedLinearForPPO", "register", "unregister"]


def fused_logprobs_from_hidden(
    hidden_states: torch.Tensor,
    vocab_weights: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Per-token log-prob (and entropy) of `input_ids` under softmax((hidden @ W^T + b) / T), never holding [N, V].

    The contract of verl's `FusedLinearForPPO.forward(hidden_states, vocab_weights, input_ids, temperature)`:
    hidden_states [..., H] (e.g. [B, S, H], or [1, total_nnz, H] with remove-padding), vocab_weights [V, H] (the
    gathered lm_head weight), input_ids [...] the already shifted (rolled) labels. Returns fp32 (log_probs, entropy)
    shaped like input_ids, or log_probs alone with return_entropy=False. Gradients flow to hidden, weight and bias.
    """
    if hidden_states.shape[:-1] != input_ids.shape:
        raise ValueError(
            f"input_ids: expected shape {tuple(hidden_states.shape[:-1])} (hidden_states without H), "
            f"got {tuple(input_ids.shape)}"
        )
    import rapo_fast

    shape = input_ids.shape
    out = rapo_fast.token_logprobs(
        hidden=hidden_states.reshape(-1, hidden_states.shape[-1]),
        weight=vocab_weights,
        bias=bias,
        targets=input_ids.reshape(-1),
        temperature=temperature,
        return_entropy=return_entropy,
    )
    if return_entropy:
        logp, ent = out
        return logp.reshape(shape), ent.reshape(shape)
    return out.reshape(shape)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """verl's `logprobs_from_logits(logits / T, labels)` (and `entropy_from_logits`) through rapo_fast's kernel.

    logits [..., V] (not yet divided by the temperature: pass it here instead of verl's in-place `div_`), labels
    [...]. Returns fp32 log-probs (and entropy) shaped like labels.
    """
    import rapo_fast

    shape = labels.shape
    out = rapo_fast.token_logprobs(
        logits.reshape(-1, logits.shape[-1]),
        targets=labels.reshape(-1),
        temperature=temperature,
        return_entropy=return_entropy,
    )
    if return_entropy:
        return out[0].reshape(shape), out[1].reshape(shape)
    return out.reshape(shape)


class RAPOFusedLinearForPPO(torch.nn.Module):
    """Drop-in for verl's `FusedLinearForPPO`: forward(hidden_states, vocab_weights, input_ids, temperature) ->
    (log_probs, entropy), computed by `fused_logprobs_from_hidden`. The constructor takes verl's arguments
    (chunk_size, impl_backend) and ignores them: rapo_fast's kernel picks its own vocabulary tiles."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch") -> None:
        super().__init__()
        self.chunk_size, self.impl_backend = chunk_size, impl_backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        vocab_weights: torch.Tensor,
        input_ids: torch.Tensor,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_logprobs_from_hidden(hidden_states, vocab_weights, input_ids, temperature)


# verl's fused-kernel model forward (verl/models/transformers/dense_common.py and the VL variants) imports this name
# from this module at call time, so replacing the module attribute reroutes the actor's log-probs and entropy.
VERL_FUSED_MODULE = "verl.utils.experimental.torch_functional"
VERL_FUSED_CLASS = f"{VERL_FUSED_MODULE}:FusedLinearForPPO"  # a "patch" row of verl_compat.INTERNALS
FUSED_ENV = "RAPO_FAST_VERL_FUSED_LOGPROBS"


def register(enable: bool | None = None) -> bool:
    """Make verl's fused-kernel actor forward (`actor_rollout_ref.model.use_fused_kernels=True`, backend "torch")
    compute log-probs and entropy with rapo_fast's hidden-state kernel: replaces
    verl.utils.experimental.torch_functional.FusedLinearForPPO by RAPOFusedLinearForPPO. Opt-in: `enable`, or
    by default the environment variable RAPO_FAST_VERL_FUSED_LOGPROBS=1 (set it in the Ray runtime env so every worker
    sees it). Idempotent; returns whether the replacement is in place. Imports verl.
    """
    import os

    if enable is None:
        enable = os.environ.get(FUSED_ENV, "0") == "1"
    if enable:
        verl_compat.replace(VERL_FUSED_CLASS, RAPOFusedLinearForPPO)  # verl's class kept for unregister
    return verl_compat.get(VERL_FUSED_CLASS) is RAPOFusedLinearForPPO


def unregister() -> None:
    """Put verl's own FusedLinearForPPO back (no-op when register() did not replace it). Imports verl."""
    verl_compat.restore(VERL_FUSED_CLASS)
