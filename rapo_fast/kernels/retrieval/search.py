"""Triton kernel of exact top-k retrieval: a tensor-core score tile per (query tile, key tile) with a fused, filtered
top-k, so that no [Q, C] score matrix is ever written.

What this is: `@triton.jit` code only (launcher: rapo_fast/retrieval/triton_search.py; contract:
rapo_fast/reference/retrieval.py). The algorithm: docs/retrieval.md, "Triton path"; all offsets are int64
(docs/pitfalls.md #5).
What this is not: a sort (the merge of the splits, a torch.topk in triton_search.py, orders the result).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rapo_fast import _constants
from rapo_fast.kernels.triton_helpers import dot_operand

# Shared constants (defined once in rapo_fast/_constants.py) as constexprs, the form jit code reads a global in.
# SENTINEL: below every eligible key. METRIC_*: the values of the METRIC argument.
SENTINEL = tl.constexpr(_constants.TRITON_EMPTY_KEY)
METRIC_COSINE = tl.constexpr(_constants.METRIC_COSINE)
METRIC_L2 = tl.constexpr(_constants.METRIC_L2)


@triton.jit
def encode_keys(score, slot):
    """(fp32 score, int32 slot) -> int64 key, larger = better: score order first, then the smaller slot."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 == +0.0: one image, so the slot decides the tie
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - slot).to(tl.int64)


@triton.jit
def decode_threshold(key):
    """A row's threshold key -> (score, slot) to compare fp32 scores against; SENTINEL -> (-inf, 2^31 - 1)."""
    hi = (key >> 32).to(tl.int32)
    bits = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
    score = tl.where(key == SENTINEL, float("-inf"), bits.to(tl.float32, bitcast=True))
    slot = tl.where(key == SENTINEL, 0x7FFFFFFF, 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32))
    return score, slot


@triton.jit
def _mma(q, k, acc, FP32_KEYS: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + q @ k in fp32; fp32 keys without TF32 (the contract's fp32 path, docs/retrieval.md, "Precision")."""
    if FP32_KEYS:
        return tl.dot(q, k, acc, input_precision="ieee")
    else:
        return tl.dot(dot_operand(x=q, UPCAST_DOT=UPCAST_DOT), dot_operand(x=k, UPCAST_DOT=UPCAST_DOT), acc)


@triton.jit
def score_tile(
    q_ptr,
    k_ptr,
    rows,
    c0,
    c_end,
    row_ok,
    D,
    stride_q,
    stride_k,
    BLOCK_Q: tl.constexpr,
    HALF_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_KEYS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """fp32 dot products of the query rows with keys [c0, c0 + 2 HALF_C) as two [BLOCK_Q, HALF_C] halves: a K-loop
    over D in which each query block, loaded once, feeds both halves' tl.dot. The operand stream is that of one
    [BLOCK_Q, 2 HALF_C] tile (64 flop per byte at 128 x 128); the caller's epilogue holds one half at a time."""
    acc0 = tl.zeros([BLOCK_Q, HALF_C], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_Q, HALF_C], dtype=tl.float32)
    cols0 = c0 + tl.arange(0, HALF_C)
    cols1 = cols0 + HALF_C
    q_row = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    k_col0 = k_ptr + cols0.to(tl.int64)[None, :] * stride_k
    k_col1 = k_ptr + cols1.to(tl.int64)[None, :] * stride_k
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < D
        q = tl.load(q_row + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        k0 = tl.load(k_col0 + dd[:, None], mask=d_ok[:, None] & (cols0 < c_end)[None, :], other=0.0)
        k1 = tl.load(k_col1 + dd[:, None], mask=d_ok[:, None] & (cols1 < c_end)[None, :], other=0.0)
        acc0 = _mma(q=q, k=k0, acc=acc0, FP32_KEYS=FP32_KEYS, UPCAST_DOT=UPCAST_DOT)
        acc1 = _mma(q=q, k=k1, acc=acc1, FP32_KEYS=FP32_KEYS, UPCAST_DOT=UPCAST_DOT)
    return acc0, acc1


@triton.jit
def finish_scores(dot, qaux, kaux, METRIC: tl.constexpr):
    """retrieval_finish of csrc/include/rapo/retrieval_metric.h, same operation order: ip, cosine, l2."""
    if METRIC == METRIC_COSINE:
        return (dot * qaux[:, None]) * kaux[None, :]
    elif METRIC == METRIC_L2:
        t = (2.0 * dot - kaux[None, :]) - qaux[:, None]
        return tl.where(t > 0.0, 0.0, t)  # NaN stays NaN (never eligible)
    else:
        return dot


@triton.jit
def select_kth(x, K_TOP: tl.constexpr, ROWS: tl.constexpr):
    """The K_TOP-th largest int64 of each row of x [ROWS, W] (rows hold at least K_TOP entries, SENTINEL counted):
    a bisection on the value, 64 halvings of the int64 range, each a compare and a row count. Cheaper than a sort
    and the same on the GPU as in the interpreter (where tl.sort takes seconds per call)."""
    lo = tl.full([ROWS], SENTINEL, tl.int64)  # count(x >= lo) >= K_TOP always
    hi = tl.max(x, axis=1) + 1  # count(x >= hi) == 0 < K_TOP
    for _ in range(64):
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        enough = tl.sum((x >= mid[:, None]).to(tl.int32), axis=1) >= K_TOP
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo


@triton.jit
def merge_rows(
    ws_row,
    thr_ptr,
    cnt_ptr,
    cnt,
    q0,
    Q,
    K_TOP: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Select each row's K_TOP best of its running list and its `cnt` pending survivors, compact them to the front
    of the row (SENTINEL after them), and return the new thresholds: the K_TOP-th best key per row (SENTINEL while a
    row has fewer). Row chunks of ROWS rows keep the block [ROWS, W] small."""
    rows = q0 + tl.arange(0, BLOCK_Q)
    tl.store(cnt_ptr + rows, cnt, mask=rows < Q)
    tl.debug_barrier()  # the survivors and counts written by every thread are visible before any row is read
    cols = tl.arange(0, W)
    for r0 in range(0, tl.minimum(BLOCK_Q, Q - q0), ROWS):  # the tile's rows that exist (few-query searches)
        rr = q0 + r0 + tl.arange(0, ROWS)
        r_ok = rr < Q
        n = tl.load(cnt_ptr + rr, mask=r_ok, other=0)
        ptrs = ws_row + (rr - q0).to(tl.int64)[:, None] * W + cols[None, :]
        live = r_ok[:, None] & (cols[None, :] < KP + n[:, None])
        x = tl.load(ptrs, mask=live, other=SENTINEL)
        kth = select_kth(x=x, K_TOP=K_TOP, ROWS=ROWS)
        keep = (x >= kth[:, None]) & (x != SENTINEL)  # keys are distinct: exactly min(K_TOP, real entries) kept
        pos = tl.cumsum(keep.to(tl.int32), axis=1) - 1
        n_keep = tl.sum(keep.to(tl.int32), axis=1)
        tl.debug_barrier()  # every thread has read its row block before any of it is overwritten
        row_base = ws_row + (rr - q0).to(tl.int64)[:, None] * W
        tl.store(row_base + pos, x, mask=keep)
        tl.store(
            ptrs,
            tl.full([ROWS, W], SENTINEL, tl.int64),
            mask=r_ok[:, None] & (cols[None, :] >= n_keep[:, None]) & (cols < KP)[None, :],
        )
        tl.store(thr_ptr + rr, kth, mask=r_ok)
    tl.debug_barrier()  # the new running lists and thresholds are written before the next tile appends or reads
    return tl.load(thr_ptr + rows, mask=rows < Q, other=SENTINEL)


@triton.jit
def clear_rows(ws_row, q0, Q, W: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr):
    """Fill the program's workspace rows with SENTINEL: the running lists start empty."""
    lane = tl.arange(0, W)
    for r0 in range(0, tl.minimum(BLOCK_Q, Q - q0), ROWS):
        rr = r0 + tl.arange(0, ROWS)
        empty = tl.full([ROWS, W], SENTINEL, tl.int64)
        tl.store(ws_row + rr.to(tl.int64)[:, None] * W + lane[None, :], empty, mask=(q0 + rr < Q)[:, None])
    tl.debug_barrier()


@triton.jit
def admit(s, cols, row_ok, col_ok, grp_ptr, excl, thr, min_score, HAS_EXCL: tl.constexpr):
    """The keys of a tile that enter a row's pending area: eligible (in range, not NaN or -inf, >= min_score, not of
    the row's excluded group) and better than the row's threshold key (higher score, or equal and a smaller slot)."""
    ok = row_ok[:, None] & col_ok[None, :] & (s == s) & (s > float("-inf")) & (s >= min_score)
    if HAS_EXCL:
        grp = tl.load(grp_ptr + cols, mask=col_ok, other=-1)
        ok = ok & ((grp[None, :] != excl[:, None]) | (excl[:, None] < 0))
    t_score, t_slot = decode_threshold(thr)
    beats = (s > t_score[:, None]) | ((s == t_score[:, None]) & (cols[None, :] < t_slot[:, None]))
    return ok & beats


@triton.jit
def take_survivors(
    dot,
    c_start,
    c_end,
    rows,
    row_ok,
    q0,
    Q,
    qaux,
    excl,
    thr,
    cnt,
    kaux_ptr,
    grp_ptr,
    ws_row,
    thr_ptr,
    cnt_ptr,
    min_score,
    K_TOP: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    METRIC: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HALF_C: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One half tile of dot products (keys c_start ..): append the admitted keys to their rows' pending areas, and merge
    when the next half could overflow one. Returns the (thresholds, pending counts) after it."""
    cols = c_start + tl.arange(0, HALF_C)
    col_ok = cols < c_end
    kaux = tl.load(kaux_ptr + cols, mask=col_ok, other=0.0)
    s = finish_scores(dot=dot, qaux=qaux, kaux=kaux, METRIC=METRIC)
    keep = admit(
        s=s,
        cols=cols,
        row_ok=row_ok,
        col_ok=col_ok,
        grp_ptr=grp_ptr,
        excl=excl,
        thr=thr,
        min_score=min_score,
        HAS_EXCL=HAS_EXCL,
    )
    n_new = tl.sum(keep.to(tl.int32), axis=1)
    if tl.max(n_new, axis=0) > 0:  # most tiles, once the thresholds have risen, skip this
        pos = cnt[:, None] + tl.cumsum(keep.to(tl.int32), axis=1) - 1
        dst = ws_row + (rows - q0).to(tl.int64)[:, None] * W + KP + pos
        tl.store(dst, encode_keys(score=s, slot=cols), mask=keep)
        cnt += n_new
        if tl.max(cnt, axis=0) > W - KP - HALF_C:  # the next half could overflow a pending area
            thr = merge_rows(
                ws_row=ws_row,
                thr_ptr=thr_ptr,
                cnt_ptr=cnt_ptr,
                cnt=cnt,
                q0=q0,
                Q=Q,
                K_TOP=K_TOP,
                KP=KP,
                W=W,
                BLOCK_Q=BLOCK_Q,
                ROWS=ROWS,
            )
            cnt = tl.zeros([BLOCK_Q], dtype=tl.int32)
    return thr, cnt


@triton.jit
def retrieval_topk_kernel(
    q_ptr,  # [Q, D] queries in the keys' dtype, rows strided, last dim contiguous
    k_ptr,  # [C, D] keys, rows strided, last dim contiguous
    kaux_ptr,  # [C] fp32 per-key aux (cosine 1/|k|, l2 |k|^2; unread for ip)
    qaux_ptr,  # [Q] fp32 per-query aux, same convention
    grp_ptr,  # [C] int64 group ids (unread without HAS_EXCL)
    excl_ptr,  # [Q] int64 excluded group per query (negative: none)
    ws_ptr,  # [splits, Q, W] int64 workspace: running top-KP then pending survivors per row
    thr_ptr,  # [splits, Q] int64 scratch: thresholds during a merge
    cnt_ptr,  # [splits, Q] int32 scratch: pending counts during a merge
    Q,
    C,
    D,
    stride_q,
    stride_k,
    keys_per_split,  # a multiple of BLOCK_C
    min_score,  # fp32, -inf for none
    K_TOP: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    METRIC: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    FP32_KEYS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Query tiles vary fastest: programs running at once share a key split, which L2 then serves to all of them.
    n_qt = tl.cdiv(Q, BLOCK_Q)
    pid = tl.program_id(0)
    qt, split = pid % n_qt, pid // n_qt
    q0 = qt * BLOCK_Q
    rows = q0 + tl.arange(0, BLOCK_Q)
    row_ok = rows < Q
    ws_row = ws_ptr + (split.to(tl.int64) * Q + q0) * W
    thr_ptr += split.to(tl.int64) * Q
    cnt_ptr += split.to(tl.int64) * Q
    clear_rows(ws_row=ws_row, q0=q0, Q=Q, W=W, BLOCK_Q=BLOCK_Q, ROWS=ROWS)
    qaux = tl.load(qaux_ptr + rows, mask=row_ok, other=0.0)
    excl = tl.full([BLOCK_Q], -1, tl.int64)
    if HAS_EXCL:
        excl = tl.load(excl_ptr + rows, mask=row_ok, other=-1)
    thr = tl.full([BLOCK_Q], SENTINEL, tl.int64)
    cnt = tl.zeros([BLOCK_Q], dtype=tl.int32)
    c_begin = split * keys_per_split
    c_end = tl.minimum(C, c_begin + keys_per_split)
    # A tile of BLOCK_C keys in two halves (score_tile): as one [128, 128] piece the epilogue needed 255 registers and
    # 296 B of stack on sm_90a, spilling inside the per-tile path; a half at a time it has no spill instruction there
    # (bench/NOTES_retrieval.md, "Registers and spills"; tests/test_sm90_compile.py holds the bound).
    HALF_C: tl.constexpr = BLOCK_C // 2
    for c0 in range(c_begin, c_end, BLOCK_C):
        halves = score_tile(
            q_ptr=q_ptr,
            k_ptr=k_ptr,
            rows=rows,
            c0=c0,
            c_end=c_end,
            row_ok=row_ok,
            D=D,
            stride_q=stride_q,
            stride_k=stride_k,
            BLOCK_Q=BLOCK_Q,
            HALF_C=HALF_C,
            BLOCK_D=BLOCK_D,
            FP32_KEYS=FP32_KEYS,
            UPCAST_DOT=UPCAST_DOT,
        )
        for h in tl.static_range(2):  # the two halves in turn: keys c0 + h * HALF_C ..
            thr, cnt = take_survivors(
                dot=halves[h],
                c_start=c0 + h * HALF_C,
                c_end=c_end,
                rows=rows,
                row_ok=row_ok,
                q0=q0,
                Q=Q,
                qaux=qaux,
                excl=excl,
                thr=thr,
                cnt=cnt,
                kaux_ptr=kaux_ptr,
                grp_ptr=grp_ptr,
                ws_row=ws_row,
                thr_ptr=thr_ptr,
                cnt_ptr=cnt_ptr,
                min_score=min_score,
                K_TOP=K_TOP,
                KP=KP,
                W=W,
                METRIC=METRIC,
                HAS_EXCL=HAS_EXCL,
                BLOCK_Q=BLOCK_Q,
                HALF_C=HALF_C,
                ROWS=ROWS,
            )
    merge_rows(
        ws_row=ws_row,
        thr_ptr=thr_ptr,
        cnt_ptr=cnt_ptr,
        cnt=cnt,
        q0=q0,
        Q=Q,
        K_TOP=K_TOP,
        KP=KP,
        W=W,
        BLOCK_Q=BLOCK_Q,
        ROWS=ROWS,
    )
