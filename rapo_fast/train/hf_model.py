"""Helpers over a HF causal LM that the trainer needs: the lm_head weight it multiplies by and its final hidden states
(of a whole padded batch, or of its rows in length buckets so that no row runs over another row's padding).

What this is: model plumbing shared by the trainer and the policy-hidden encoder (no loss math, no model building;
the demo's tiny model builder is rapo_fast.demo.tiny_policy).
"""

from __future__ import annotations

import torch

from rapo_fast._checks import check_int


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm_head weight [V, H] the model actually multiplies by (tied or not; docs/pitfalls.md #10)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"lm_head_weight: model: expected an output embedding with weight, got {type(model).__name__}")
    if getattr(head, "bias", None) is not None:
        raise ValueError("lm_head_weight: model: expected an lm_head without a bias, got one with a bias")
    return head.weight


def final_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states [B, T, H] (after the final norm, i.e. what lm_head multiplies) of a HF causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state


def row_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's last attended position + 1 (0 for a row with none): its length up to its padding."""
    if not attention_mask.shape[1]:
        return torch.zeros(attention_mask.shape[0], dtype=torch.long, device=attention_mask.device)
    idx = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return ((attention_mask != 0) * idx).amax(1)


def scored_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T-1] bool: the shifted positions t of each row before its last attended token (the target t + 1 is
    attended): the positions that score a real token; the rest only score padding."""
    n = row_lengths(attention_mask) - 1
    return torch.arange(attention_mask.shape[1] - 1, device=attention_mask.device)[None, :] < n[:, None]


# A bucket's fixed cost in token slots (one more model call): on table1's tiny policy at one CPU thread a forward and
# backward call costs about what 60-70 more token slots do (a no-grad forward ~36); a larger model's tokens cost more,
# so the same overhead only errs towards fewer buckets there.
BUCKET_OVERHEAD_TOKENS = 64


def length_buckets(lengths: list[int], overhead: int = BUCKET_OVERHEAD_TOKENS) -> list[list[int]]:
    """Row indices grouped into buckets of similar length: rows sorted by length (stable), cut where the cost
    sum(rows x the bucket's longest length) + overhead per bucket is least (exact, by dynamic programming)."""
    overhead = check_int("length_buckets: overhead", overhead, lo=0)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best, cut = [0] + [0] * n, [0] * (n + 1)  # best[k]: least cost of the first k sorted rows
    for k in range(1, n + 1):
        longest = lengths[order[k - 1]]
        best[k], cut[k] = min((best[j] + (k - j) * longest + overhead, j) for j in range(k))
    out, k = [], n
    while k > 0:
        out.append(order[cut[k] : k])
        k = cut[k]
    return out[::-1]


def final_hidden_buckets(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    overhead: int = BUCKET_OVERHEAD_TOKENS,
) -> torch.Tensor:
    """final_hidden [B, T, H] computed over length buckets (length_buckets of each row's last attended position + 1),
    each bucket cut to its longest row; positions after a row's last attended token are 0. A row's states are those
    of final_hidden up to float rounding (causal attention: a position never sees the columns cut off), at the cost
    of its bucket's length rather than the batch's. Differentiable."""
    B, T = input_ids.shape
    ends = row_lengths(attention_mask).tolist()
    parts, rows = [], []
    for bucket in length_buckets(ends, overhead):
        L = max(1, ends[bucket[-1]])
        sel = torch.tensor(bucket, device=input_ids.device)
        h = final_hidden(model, input_ids[sel, :L], attention_mask[sel, :L])
        parts.append(torch.nn.functional.pad(h, (0, 0, 0, T - L)) if L < T else h)
        rows += bucket
    out = torch.cat(parts)
    inverse = torch.empty(B, dtype=torch.long, device=out.device)
    inverse[torch.tensor(rows, device=out.device)] = torch.arange(B, device=out.device)
    return out[inverse]
