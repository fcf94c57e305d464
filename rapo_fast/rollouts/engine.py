"""Lockstep batched decoding over a Hugging Face KV cache, with per-row positions and a column mask.

What this is: `DecodeEngine`, the engine under rapo_fast.rollout: every row advances through the same cache columns,
masking out the columns it did not use and keeping its own contiguous position ids, so a row attends to exactly its
own token sequence, the one the trainer later scores. How rows feed, branch and splice: docs/rollout.md section 5.
What this is not: a paged serving engine; the cache grows by one column per lockstep iteration for all rows.
"""

from __future__ import annotations

import torch

from rapo_fast.kv import hf_cache as hfc


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [B, H_kv, S, D] of every layer of a transformers 5.x DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


class DecodeEngine:
    """Batched incremental decoding state for `batch` rows of a HF causal LM (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, batch: int, device: torch.device):
        from transformers import DynamicCache

        self.model, self.batch, self.device = model, batch, device
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.last_logits: torch.Tensor | None = None  # [B, V] next-token logits after each row's last valid token

    @property
    def num_columns(self) -> int:
        return int(self.mask.shape[1])

    @torch.no_grad()
    def feed(self, tokens: torch.Tensor, valid: torch.Tensor) -> int:
        """Run the model over a chunk: tokens [B, L] int64, valid [B, L] bool (a row's valid tokens first).

        Returns the column index of the chunk's first column. Rows with at least one valid token get their
        `last_logits` updated; the others keep theirs.
        """
        B, L = tokens.shape
        valid = valid.to(self.device)
        n = valid.sum(1)
        pos = self.pos.unsqueeze(1) + torch.arange(L, device=self.device).unsqueeze(0)
        col0 = self.num_columns
        self.mask = torch.cat([self.mask, valid.long()], dim=1)
        out = self.model(
            input_ids=tokens.to(self.device),
            attention_mask=self.mask,
            position_ids=pos,
            use_cache=True,
            **{hfc.cache_kwarg(self.model): self.cache},
        )
        logits = out.logits.float()
        rows = torch.nonzero(n > 0).squeeze(1)
        if self.last_logits is None:
            self.last_logits = torch.zeros(B, logits.shape[-1], device=self.device)
        if rows.numel():
            self.last_logits[rows] = logits[rows, n[rows] - 1]
        self.pos = self.pos + n
        return col0

    def extend_columns(self, valid: torch.Tensor, n_new: int) -> None:
        """Account for `n_new` columns written into the cache by someone else (the splice): valid [B, n_new] bool says
        which belong to which row (a row's first), the rest stay masked; rows' positions advance by their count."""
        if self.cache.get_seq_length() != self.num_columns + n_new:
            raise RuntimeError(
                f"DecodeEngine: cache holds {self.cache.get_seq_length()} columns, expected {self.num_columns + n_new}"
            )
        self.mask = torch.cat([self.mask, valid.long().to(self.device)], dim=1)
        self.pos = self.pos + valid.sum(1).to(self.device)

    @torch.no_grad()
    def copy_row(self, src: int, dst: int, keep_columns: torch.Tensor, next_pos: int, logits: torch.Tensor) -> None:
        """Make row `dst` a branch of row `src`: same cache, only `keep_columns` (int64 column indices) visible,
        next position `next_pos`, next-token logits `logits` [V] (those of src at the branch point)."""
        for k, v in cache_layers(self.cache):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])
        self.mask[dst].zero_()
        self.mask[dst, keep_columns.to(self.device)] = 1
        self.pos[dst] = next_pos
        self.last_logits[dst] = logits


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """Sample one token per row: logits [N, V] fp32 -> (tokens [N] int64, logp [N] fp32, entropy [N] fp32).

    logp and entropy are of softmax(logits / T) (T = 1 for greedy, temperature 0), the behaviour policy's.
    """
    t = temperature if temperature > 0 else 1.0
    logp_all = torch.log_softmax(logits / t, dim=-1)
    p = logp_all.exp()
    entropy = -(p * logp_all.clamp_min(-1e30)).nan_to_num(0.0).sum(-1)
    if temperature > 0:
        tok = torch.multinomial(p.cpu(), 1, generator=generator).squeeze(1).to(logits.device)
    else:
        tok = logits.argmax(-1)
    return tok, logp_all.gather(1, tok.unsqueeze(1)).squeeze(1), entropy
