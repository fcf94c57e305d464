"""Triton kernels of token_logprobs: per-row log-prob of the target and full-vocabulary entropy, forward and backward.

What this is: `@triton.jit` code only (launchers, autograd and validation are in rapo_fast/loss/logprobs.py); the same
two kernels serve the logits path and the hidden path's tiles. All offsets are int64.
What this is not: the matmul (torch.matmul / cuBLAS does it). The math, both paths and the row layouts are in
docs/loss.md section 2; docs/pitfalls.md #1 (V not a multiple of BLOCK_V) and #5 (int64 offsets).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rapo_fast.kernels.triton_helpers import (
    load_scaled_logits,
    log_sum_entropy,
    logprob_entropy_grad,
    online_lse_update,
    row_logprob,
)


@triton.jit
def _row_offset(row, rows_inner, stride_outer, stride_inner):
    """Element offset of row `row` of a [outer, inner, V] view flattened to rows (int64)."""
    return (row // rows_inner) * stride_outer + (row % rows_inner) * stride_inner


@triton.jit
def token_logprobs_fwd_kernel(
    z_ptr,  # logits block, rows addressed through (rows_inner, stride_outer, stride_inner), last dim contiguous
    tgt_ptr,  # [rows] int32/int64 targets (global vocabulary ids)
    bias_ptr,  # [V] bias or a dummy when HAS_BIAS is False
    m_ptr,  # [rows] fp32 running state, read unless INIT, written unless FINAL
    s_ptr,
    t_ptr,
    zt_ptr,  # [rows] fp32 scaled target logit seen so far
    logp_ptr,  # [rows] fp32 outputs, written when FINAL
    row_max_ptr,  # the row's statistics (m, log s) that the backward reads
    log_s_ptr,
    ent_ptr,
    rows_inner,
    stride_outer,
    stride_inner,
    n_cols,  # vocabulary columns in this block of logits
    v_start,  # global vocabulary id of column 0
    inv_temp,  # fp32 1 / temperature
    INIT: tl.constexpr,
    FINAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """z = (logits + b) / T;  m, s, t <- online update over the row;  logp = (z[y] - m) - log s,  H = log s - t / s.
    Saves (m, log s) for the backward, not their sum lse, whose fp32 rounding would cost ulp(m)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + _row_offset(row=row, rows_inner=rows_inner, stride_outer=stride_outer, stride_inner=stride_inner)
    y = tl.load(tgt_ptr + row).to(tl.int64)

    if INIT:
        m = float("-inf")
        s = 0.0
        t = 0.0
        zt = 0.0
    else:
        m = tl.load(m_ptr + row)
        s = tl.load(s_ptr + row)
        t = tl.load(t_ptr + row)
        zt = tl.load(zt_ptr + row)

    # The target logit is one scalar load, masked when the target lies in another vocabulary chunk.
    local = y - v_start
    in_block = (local >= 0) & (local < n_cols)
    zy = tl.load(z_row + local, mask=in_block, other=0.0).to(tl.float32)
    if HAS_BIAS:
        zy += tl.load(bias_ptr + y, mask=in_block, other=0.0).to(tl.float32)
    zt = tl.where(in_block, zy * inv_temp, zt)

    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        mask = c < n_cols
        z = load_scaled_logits(
            z_row=z_row, bias_ptr=bias_ptr, v_start=v_start, c=c, mask=mask, inv_temp=inv_temp, HAS_BIAS=HAS_BIAS
        )
        m, s, t = online_lse_update(m=m, s=s, t=t, z=z)

    if FINAL:
        log_s, ent = log_sum_entropy(s=s, t=t)
        tl.store(logp_ptr + row, row_logprob(z=zt, m=m, log_s=log_s))
        tl.store(row_max_ptr + row, m)
        tl.store(log_s_ptr + row, log_s)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, ent)
    else:
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)
        tl.store(zt_ptr + row, zt)


@triton.jit
def token_logprobs_bwd_kernel(
    z_ptr,  # logits block as in the forward kernel
    gz_ptr,  # [rows, n_cols] grad of the logits block, row stride stride_gz, may alias z_ptr (in place)
    tgt_ptr,
    bias_ptr,
    row_max_ptr,  # [rows] fp32 (m, log s) saved by the forward
    log_s_ptr,
    ent_ptr,  # [rows] fp32 saved by the forward (unused unless WITH_ENTROPY)
    glp_ptr,  # [rows] fp32 upstream gradient of logp
    gent_ptr,  # [rows] fp32 upstream gradient of the entropy (unused unless WITH_ENTROPY)
    rows_inner,
    stride_outer,
    stride_inner,
    stride_gz,
    n_cols,
    v_start,
    inv_temp,
    HAS_BIAS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """grad_logits = (g_lp * (onehot_y - p) - g_H * p * (log p + H)) / T, p = exp((z - m) - log s) recomputed block
    by block from the saved (m, log s)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + _row_offset(row=row, rows_inner=rows_inner, stride_outer=stride_outer, stride_inner=stride_inner)
    gz_row = gz_ptr + row * stride_gz
    y = tl.load(tgt_ptr + row).to(tl.int64)
    m = tl.load(row_max_ptr + row)
    log_s = tl.load(log_s_ptr + row)
    g_lp = tl.load(glp_ptr + row)
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + row)
        g_ent = tl.load(gent_ptr + row)
    else:
        ent = 0.0
        g_ent = 0.0
    local = y - v_start

    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        mask = c < n_cols
        z = load_scaled_logits(
            z_row=z_row, bias_ptr=bias_ptr, v_start=v_start, c=c, mask=mask, inv_temp=inv_temp, HAS_BIAS=HAS_BIAS
        )
        grad = logprob_entropy_grad(
            z=z,
            is_target=c == local,
            m=m,
            log_s=log_s,
            ent=ent,
            g_lp=g_lp,
            g_ent=g_ent,
            inv_temp=inv_temp,
            WITH_ENTROPY=WITH_ENTROPY,
        )
        tl.store(gz_row + c, grad.to(gz_ptr.dtype.element_ty), mask=mask)
