"""Lockstep batched decoding over a Hugging Face KV cache, with per-row positions and a column mask.

What this is: `DecodeEngine`, the engine under rapo_fast.rollout: every row advances through the same cache columns,
masking out the columns it did not use and keeping its own contiguous position ids, so a row attends to exactly its
own token sequence, the one the trainer later scores. How rows feed, branch and splice: docs/rollout.md section 5.
What this is not: a paged serving engine. The cache grows by the longest chunk of each model call for all rows it
holds; `compact` lets the caller drop finished rows and the columns no remaining row uses.
"""

from __future__ import annotations

import torch

from rapo_fast.kv import hf_cache as hfc


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [B, H_kv, S, D] of every layer of a transformers 5.x DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


class DecodeEngine:
    """Batched incremental decoding state for `batch` rows of a HF causal LM (see the module docstring).

    Rows are addressed by their index in [0, batch) everywhere (feed, pos, last_logits, copy_row, extend_columns);
    the cache and the column mask hold only the rows still kept (`held`, after `compact`), in that order:
    `physical(i)` is row i's index in the cache's batch dimension."""

    def __init__(self, model: torch.nn.Module, batch: int, device: torch.device):
        from transformers import DynamicCache

        self.model, self.batch, self.device = model, batch, device
        self.cache = DynamicCache(config=model.config)
        self.held = torch.arange(batch, device=device)  # the rows in the cache, by cache batch index
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)  # [held, columns]
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.last_logits: torch.Tensor | None = None  # [B, V] next-token logits after each row's last valid token

    @property
    def num_columns(self) -> int:
        return int(self.mask.shape[1])

    def physical(self, row: int) -> int:
        """Row `row`'s index in the cache's batch dimension (RuntimeError for a row `compact` dropped)."""
        hit = torch.nonzero(self.held == row)
        if not hit.numel():
            raise RuntimeError(f"DecodeEngine: row {row} was dropped from the cache by compact()")
        return int(hit[0, 0])

    @torch.no_grad()
    def compact(self, keep: list[int]) -> bool:
        """Keep only rows `keep` (indices of held rows; the cache holds them in this order), each one's visible
        columns moved to the front in their order; the cache becomes as wide as the longest kept row. Attention is
        unchanged: every key carries its rotary position from when it was written and a query sees the same set of
        keys (the sums run in another order, so results agree up to float rounding). Returns False, changing nothing,
        when a cache layer is not a plain DynamicLayer (a sliding window's mask depends on column distances) or
        nothing is kept."""
        from transformers.cache_utils import DynamicLayer

        if not keep or any(type(layer) is not DynamicLayer for layer in self.cache.layers):
            return False
        phys = torch.tensor([self.physical(i) for i in keep], dtype=torch.long, device=self.device)
        mask = self.mask[phys]
        width = int(mask.sum(1).max())
        # each kept row's visible columns first, in column order (a stable sort of "not visible")
        order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)[:, :width]
        for layer in self.cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys[phys].gather(2, idx)
            layer.values = layer.values[phys].gather(2, idx)
        self.mask = (torch.arange(width, device=self.device)[None, :] < mask.sum(1, keepdim=True)).long()
        self.held = self.held[phys]
        return True

    @torch.no_grad()
    def feed(self, tokens: torch.Tensor, valid: torch.Tensor) -> int:
        """Run the model over a chunk: tokens [B, L] int64, valid [B, L] bool (a row's valid tokens first).

        Returns the column index of the chunk's first column. Rows with at least one valid token get their
        `last_logits` updated; the others keep theirs.
        """
        B, L = tokens.shape
        valid = valid.to(self.device)
        n = valid.sum(1)
        if int(n.sum()) != int(n[self.held].sum()):
            raise RuntimeError("DecodeEngine.feed: valid tokens for a row that compact() dropped")
        tokens, valid_h, n_h = tokens.to(self.device)[self.held], valid[self.held], n[self.held]
        pos = self.pos[self.held].unsqueeze(1) + torch.arange(L, device=self.device).unsqueeze(0)
        col0 = self.num_columns
        self.mask = torch.cat([self.mask, valid_h.long()], dim=1)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=pos,
            use_cache=True,
            **{hfc.cache_kwarg(self.model): self.cache},
        )
        logits = out.logits.float()
        fed = torch.nonzero(n_h > 0).squeeze(1)
        if self.last_logits is None:
            self.last_logits = torch.zeros(B, logits.shape[-1], device=self.device)
        if fed.numel():
            self.last_logits[self.held[fed]] = logits[fed, n_h[fed] - 1]
        self.pos = self.pos + n
        return col0

    def extend_columns(self, valid: torch.Tensor, n_new: int) -> None:
        """Account for `n_new` columns written into the cache by someone else (the splice): valid [B, n_new] bool says
        which belong to which row (a row's first), the rest stay masked; rows' positions advance by their count."""
        if self.cache.get_seq_length() != self.num_columns + n_new:
            raise RuntimeError(
                f"DecodeEngine: cache holds {self.cache.get_seq_length()} columns, expected {self.num_columns + n_new}"
            )
        valid = valid.to(self.device)
        self.mask = torch.cat([self.mask, valid[self.held].long()], dim=1)
        self.pos = self.pos + valid.sum(1)

    @torch.no_grad()
    def copy_row(self, src: int, dst: int, keep_columns: torch.Tensor, next_pos: int, logits: torch.Tensor) -> None:
        """Make row `dst` a branch of row `src`: same cache, only `keep_columns` (int64 column indices) visible,
        next position `next_pos`, next-token logits `logits` [V] (those of src at the branch point)."""
        ps, pd = self.physical(src), self.physical(dst)
        for k, v in cache_layers(self.cache):
            k[pd].copy_(k[ps])
            v[pd].copy_(v[ps])
        self.mask[pd].zero_()
        self.mask[pd, keep_columns.to(self.device)] = 1
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
