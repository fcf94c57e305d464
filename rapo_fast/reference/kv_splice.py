"""Reference (spec) of the KV splice: RoPE re-rotation of cached keys and the copy of a segment into a cache.

What this is: plain PyTorch, the definition the C++ and CUDA backends are tested against, and the `reference` backend
of `rapo_fast.splice_kv`. The angle of a rotation by delta is formed in float64 (delta * inv_freq, reduced modulo
2 pi) and its cos/sin rounded to fp32 before use, exactly as csrc/include/rapo/rope.h does; the rotation itself runs in
`compute_dtype` (fp32 for the spec, fp64 for ground truth) and the result is rounded once to the key's dtype.
What this is not: a fast path (one request at a time) or a place for cache bookkeeping (rapo_fast/kv/hf_cache.py).
"""

from __future__ import annotations

import math

import torch

__all__ = ["rope_cos_sin_ref", "rotate_keys_ref", "splice_segment_ref", "paged_slots_ref"]


def rope_cos_sin_ref(
    delta: torch.Tensor | int, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles delta * inv_freq: delta [...] (int) and inv_freq [P] give [..., P] in `dtype`.

    The product and the reduction modulo 2 pi are formed in float64 so that large deltas (10^6) keep fp32 accuracy.
    """
    d = torch.as_tensor(delta, dtype=torch.float64, device=inv_freq.device)
    ang = d[..., None] * inv_freq.to(torch.float64)
    ang = torch.remainder(ang, 2 * math.pi)
    if dtype == torch.float64:
        return torch.cos(ang), torch.sin(ang)
    ang = ang.to(torch.float32)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rotate_keys_ref(
    keys: torch.Tensor,
    delta: torch.Tensor | int,
    inv_freq: torch.Tensor,
    *,
    rotary_dim: int | None = None,
    layout: str = "rotate_half",
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """K' = R(delta) K along the last dim of keys [..., D]; delta is an int or a tensor broadcastable to keys[..., 0].

    Pairs: rotate_half (i, i + rotary_dim/2), interleaved (2i, 2i+1), for i < rotary_dim/2 with frequency inv_freq[i];
    dims >= rotary_dim are copied. Math in compute_dtype, result in keys.dtype (compute_dtype when it is float64).
    """
    d_head = keys.shape[-1]
    rd = d_head if rotary_dim is None else rotary_dim
    half = rd // 2
    if inv_freq.numel() != half:
        raise ValueError(f"inv_freq: expected rotary_dim // 2 = {half} entries, got {inv_freq.numel()}")
    cos, sin = rope_cos_sin_ref(
        delta, inv_freq.to(keys.device), torch.float64 if compute_dtype == torch.float64 else torch.float32
    )
    cos, sin = cos.to(compute_dtype), sin.to(compute_dtype)
    x = keys.to(compute_dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    if layout == "rotate_half":
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    elif layout == "interleaved":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        raise ValueError(f"layout: expected 'rotate_half' or 'interleaved', got {layout!r}")
    out = torch.cat([out, rest], dim=-1)
    return out if compute_dtype == torch.float64 else out.to(keys.dtype)


def paged_slots_ref(block_table: torch.Tensor, row: int, slots: torch.Tensor, block_size: int):
    """(physical block, offset in block) of logical token slots [n] of sequence `row` under a block table [B, M]."""
    blocks = block_table[row].to(torch.int64)[slots // block_size]
    return blocks, slots % block_size


def splice_segment_ref(
    dst_keys: list[torch.Tensor],
    dst_values: list[torch.Tensor],
    seg_keys: torch.Tensor,
    seg_values: torch.Tensor,
    row: int,
    position: int,
    inv_freq: torch.Tensor,
    *,
    rotary_dim: int,
    layout: str,
    rope_delta: int | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int = 0,
) -> None:
    """Write one segment into every layer's cache, in place.

    seg_keys / seg_values: [num_layers, L, H_kv, D], the segment's K/V computed at positions 0..L-1.
    dst_keys[l] / dst_values[l]: [B, H_kv, S, D] (HF layout), or [num_blocks, block_size, H_kv, D] with block_table
    [B, max_blocks] (paged). Token j goes to slot position + j of sequence `row`; keys are rotated by rope_delta
    (default: position), values copied.
    """
    n_tok = seg_keys.shape[1]
    delta = position if rope_delta is None else rope_delta
    slots = torch.arange(position, position + n_tok, device=seg_keys.device)
    for layer in range(seg_keys.shape[0]):
        k = rotate_keys_ref(seg_keys[layer], delta, inv_freq, rotary_dim=rotary_dim, layout=layout)
        v = seg_values[layer]
        if block_table is None:
            dst_keys[layer][row, :, position : position + n_tok] = k.transpose(0, 1).to(dst_keys[layer].dtype)
            dst_values[layer][row, :, position : position + n_tok] = v.transpose(0, 1).to(dst_values[layer].dtype)
        else:
            blk, off = paged_slots_ref(block_table, row, slots.to(block_table.device), block_size)
            blk, off = blk.to(dst_keys[layer].device), off.to(dst_keys[layer].device)
            dst_keys[layer][blk, off] = k.to(dst_keys[layer].dtype)
            dst_values[layer][blk, off] = v.to(dst_values[layer].dtype)
