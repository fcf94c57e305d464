"""The l2 search over centred keys, chunk by chunk: how StepBuffer.search scores metric "l2" on CUDA without a full
centred copy of the stored keys (docs/retrieval.md, "l2 on CUDA, chunk by chunk").

What this is: `chunked_l2_search` (device-agnostic, so the CPU tests run it with the CPU backend).
What this is not: a search kernel, argument validation (StepBuffer does it first), or the CPU path (the CPU backend
centres keys as it packs them and needs no copy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rapo_fast._constants import METRIC_L2

__all__ = ["L2_CHUNK_BYTES", "chunked_l2_search", "l2_chunk_rows", "sq_norms"]

# Bytes of centred fp32 keys per chunk. The norm's fp64 block is at most as large, so a search holds at most
# 2 x L2_CHUNK_BYTES of transient key copies (plus its [Q, k] results). Large enough that a chunk is still a full
# GPU's worth of work (87k keys at D = 768), small enough to be noise next to the stored keys.
L2_CHUNK_BYTES = 256 << 20

SearchFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def l2_chunk_rows(dim: int, chunk_bytes: int = L2_CHUNK_BYTES) -> int:
    """Keys per chunk: as many fp32 rows of `dim` as fit in `chunk_bytes` (at least one)."""
    return max(1, chunk_bytes // (4 * max(dim, 1)))


def sq_norms(keys: torch.Tensor, block_rows: int | None = None) -> torch.Tensor:
    """|row|^2 of keys [n, D] as fp32, summed in float64 (the square of an fp32 value is exact there), in blocks of
    `block_rows` rows so that the fp64 copy stays at most that large (None: one block)."""
    n = keys.shape[0]
    block = n if block_rows is None else max(1, block_rows)
    out = torch.empty(n, dtype=torch.float32, device=keys.device)
    for a in range(0, n, block):
        out[a : a + block] = keys[a : a + block].double().square_().sum(1)
    return out


def _merge(best: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], k: int):
    """The k best of two [Q, k] lists, `best` holding the smaller slots: a stable descending sort of [best | new]
    keeps equal scores in that order, so ties still go to the smaller slot. The sort key maps -0.0 to +0.0 (equal
    scores for the contract, whatever a sort makes of the sign); the values returned are the lists' own."""
    scores = torch.cat([best[0], new[0]], 1)
    slots = torch.cat([best[1], new[1]], 1)
    order = torch.sort(scores + 0.0, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(scores, 1, order), torch.gather(slots, 1, order)


def chunked_l2_search(
    keys: torch.Tensor,
    groups: torch.Tensor,
    queries: torch.Tensor,
    exclude: torch.Tensor | None,
    k: int,
    min_score: float,
    centre: torch.Tensor | None,
    chunk_rows: int,
    search_fn: SearchFn,
    aux_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact l2 top-k of queries [Q, D] against keys [C, D], `chunk_rows` keys at a time -> (scores [Q, k] fp32,
    slots [Q, k] int64), best first, ties to the smaller slot, -inf / -1 padding.

    centre [D] fp32: keys and queries are centred on it (keys one chunk at a time, into fp32); None: they are taken as
    they are (already centred, fp32, as a CPU test passes them). Each chunk's key aux is aux_fn(centred chunk),
    default its float64 squared norms (sq_norms). search_fn has the signature of rapo_fast::retrieval_search and is
    called per chunk with metric l2 and no centre; groups [C] int64 and exclude [Q] int64 or None as there.
    """
    C = keys.shape[0]
    rows = max(1, chunk_rows)
    norms = aux_fn if aux_fn is not None else (lambda x: sq_norms(x, max(1, rows // 2)))
    q = queries if centre is None else queries - centre  # promotes to fp32 in one op: no intermediate copy
    best = None
    for s in range(0, max(C, 1), rows):  # an empty buffer still makes one (empty) call: its padding
        kc = keys[s : s + rows]
        if centre is not None:
            kc = kc - centre  # fp16/bf16 - fp32 is computed in fp32, as keys.float() - centre, in one allocation
        scores, slots = search_fn(kc, norms(kc), groups[s : s + rows], q, exclude, k, METRIC_L2, min_score, None)
        del kc  # free the chunk before the next one is made
        if s > 0:
            slots = torch.where(slots >= 0, slots + s, slots)
        best = (scores, slots) if best is None else _merge(best, (scores, slots), k)
    return best
