"""Helpers over a HF causal LM that the trainer needs: the lm_head weight it multiplies by and its final hidden states.

What this is: model plumbing shared by the trainer and the policy-hidden encoder (no loss math, no model building;
the demo's tiny model builder is rapo_fast.demo.tiny_policy).
"""

from __future__ import annotations

import torch


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm_head weight [V, H] the model actually multiplies by (tied or not; docs/pitfalls.md #10)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"lm_head_weight: {type(model).__name__} has no output embedding with a weight")
    if getattr(head, "bias", None) is not None:
        raise ValueError("lm_head_weight: an lm_head with a bias is not supported by this helper")
    return head.weight


def final_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states [B, T, H] (after the final norm, i.e. what lm_head multiplies) of a HF causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state
