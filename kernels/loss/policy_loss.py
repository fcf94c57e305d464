"""Triton kernels of the per-token RAPO policy loss: forward (weighted token loss + metric partial sums) and backward
(dL/dlogp, dL/dH times the upstream gradient).

Elementwise over N tokens; the log-probs are computed before (token_logprobs) and the per-sequence quantities (shaping
factor, GSPO sequence log-ratio, aggregation weight) are gathered per token by the launcher in
rapo_fast/loss/policy_loss.py.
Per token t with code c_t (0 = not in the loss, 1 = on-policy, 2 = retrieved and trained off-policy), aggregation
weight w_t, advantage A, shaping scale s_t = 1 + m F:
  log r = clamp(logp - old, -20, 20)  (or clamp(seq_lr + logp - sg(logp)) for GSPO: its value is seq_lr)
  r_hat = s_t exp(log r);  pg = max(-A r_hat, -A clip(r_hat, 1-el, 1+eh));  A < 0 and dual clip c: min(pg, -A c)
  pg *= min(exp(clamp(old - behav)), tis_cap)                   (TIS)
  off-policy: -A p/(p+gamma) (shaped)  or  -A sg(min(exp(clamp(logp - behav)), is_cap)) logp (truncated)
  + beta KL_k(logp, ref) - entropy_coef H          on every token in the loss
  out_t = w_t * loss_t
The formulas are those of rapo_fast/reference/policy_loss.py (the spec). Only @triton.jit code lives here.
"""

import triton
import triton.language as tl

# metric partial sums, one row per program: the launcher sums rows and turns sums into means
M_N_ON, M_N_OFF, M_N_ACTIVE, M_CLIP_HI, M_CLIP_LO, M_DUAL, M_RATIO, M_APPROX_KL, M_KL, M_ENT, M_TIS, M_OFFW = range(12)
NUM_METRICS = 12

# modes passed as constexpr ints
OFF_NONE, OFF_SHAPED, OFF_TRUNCATED = 0, 1, 2
KL_NONE, KL_K1, KL_K2, KL_K3 = 0, 1, 2, 3


@triton.jit
def _policy_token(
    logp, old, adv, scale, seqlr, behav, ref, ent, is_on, is_off,
    eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef,
    SEQ: tl.constexpr, DUAL: tl.constexpr, TIS: tl.constexpr, OFF: tl.constexpr, KL: tl.constexpr,
    HAS_ENT: tl.constexpr,
):
    """Loss of one token block and its derivative w.r.t. logp (and the metric terms). All fp32."""
    CL: tl.constexpr = 20.0
    is_act = is_on | is_off
    if SEQ:
        raw = seqlr  # value of sg(seq_lr) + logp - sg(logp); its derivative w.r.t. logp is 1
    else:
        raw = logp - old
    g_lr = ((raw >= -CL) & (raw <= CL)).to(tl.float32)
    log_r = tl.minimum(tl.maximum(raw, -CL), CL)
    r = tl.exp(log_r)
    rh = scale * r
    pg1 = -adv * rh
    rc = tl.minimum(tl.maximum(rh, 1.0 - eps_low), 1.0 + eps_high)
    pg2 = -adv * rc
    clipped = pg2 > pg1
    pg = tl.where(clipped, pg2, pg1)
    dpg = tl.where(clipped, 0.0, -adv * rh * g_lr)
    dual = is_on & (is_on == 0)  # all False, typed like the masks
    if DUAL:
        pg3 = -adv * dual_c
        dual = (adv < 0) & (pg > pg3)
        pg = tl.where(dual, pg3, pg)
        dpg = tl.where(dual, 0.0, dpg)
    tis_w = tl.full(logp.shape, 1.0, tl.float32)
    if TIS:
        lw = tl.minimum(tl.maximum(old - behav, -CL), CL)
        tis_w = tl.minimum(tl.exp(lw), tis_cap)
        pg = pg * tis_w
        dpg = dpg * tis_w
    loss = tl.where(is_on, pg, 0.0)
    dlogp = tl.where(is_on, dpg, 0.0)

    off_w = tl.zeros(logp.shape, tl.float32)
    if OFF == 1:
        p = tl.exp(logp)
        denom = p + gamma
        off_w = p / denom
        loss += tl.where(is_off, -adv * off_w, 0.0)
        dlogp += tl.where(is_off, -adv * gamma * p / (denom * denom), 0.0)
    if OFF == 2:
        lw2 = tl.minimum(tl.maximum(logp - behav, -CL), CL)
        off_w = tl.minimum(tl.exp(lw2), is_cap)
        loss += tl.where(is_off, -adv * off_w * logp, 0.0)
        dlogp += tl.where(is_off, -adv * off_w, 0.0)

    kl = tl.zeros(logp.shape, tl.float32)
    if KL == 1:
        kl = logp - ref
        dkl = tl.full(logp.shape, 1.0, tl.float32)
    if KL == 2:
        d = logp - ref
        kl = 0.5 * d * d
        dkl = d
    if KL == 3:
        x = ref - logp
        gx = ((x >= -CL) & (x <= CL)).to(tl.float32)
        xc = tl.minimum(tl.maximum(x, -CL), CL)
        ex = tl.exp(xc)
        kraw = ex - xc - 1.0
        gk = ((kraw >= -10.0) & (kraw <= 10.0)).to(tl.float32)
        kl = tl.minimum(tl.maximum(kraw, -10.0), 10.0)
        dkl = -(ex - 1.0) * gx * gk
    if KL != 0:
        loss += tl.where(is_act, beta * kl, 0.0)
        dlogp += tl.where(is_act, beta * dkl, 0.0)
    if HAS_ENT:
        loss += tl.where(is_act, -ent_coef * ent, 0.0)
    clip_hi = is_on & clipped & (rh > 1.0 + eps_high)
    clip_lo = is_on & clipped & (rh < 1.0 - eps_low)
    return loss, dlogp, r, clip_hi, clip_lo, is_on & dual, kl, tis_w, off_w


@triton.jit
def _load_token_inputs(
    offs, m, logp_ptr, old_ptr, adv_ptr, scale_ptr, seqlr_ptr, behav_ptr, ref_ptr,
    SEQ: tl.constexpr, TIS: tl.constexpr, OFF: tl.constexpr, KL: tl.constexpr,
):
    """The per-token inputs both kernels read; optional ones alias logp when absent (never used then)."""
    logp = tl.load(logp_ptr + offs, mask=m, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=m, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=m, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + offs, mask=m, other=1.0).to(tl.float32)
    seqlr = logp
    behav = logp
    ref = logp
    if SEQ:
        seqlr = tl.load(seqlr_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if TIS or OFF == 2:
        behav = tl.load(behav_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if KL != 0:
        ref = tl.load(ref_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return logp, old, adv, scale, seqlr, behav, ref


@triton.jit
def _policy_loss_fwd_kernel(
    logp_ptr, old_ptr, adv_ptr, w_ptr, scale_ptr, code_ptr, seqlr_ptr, behav_ptr, ref_ptr, ent_ptr,
    out_ptr, part_ptr, N,
    eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef,
    SEQ: tl.constexpr, DUAL: tl.constexpr, TIS: tl.constexpr, OFF: tl.constexpr, KL: tl.constexpr,
    HAS_ENT: tl.constexpr, BLOCK: tl.constexpr, NM: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: pitfall 5
    m = offs < N
    code = tl.load(code_ptr + offs, mask=m, other=0).to(tl.int32)
    is_on = code == 1
    is_off = code == 2
    logp, old, adv, scale, seqlr, behav, ref = _load_token_inputs(
        offs, m, logp_ptr, old_ptr, adv_ptr, scale_ptr, seqlr_ptr, behav_ptr, ref_ptr, SEQ, TIS, OFF, KL
    )
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    ent = logp
    if HAS_ENT:
        ent = tl.load(ent_ptr + offs, mask=m, other=0.0).to(tl.float32)
    loss, dlogp, r, clip_hi, clip_lo, dual, kl, tis_w, off_w = _policy_token(
        logp, old, adv, scale, seqlr, behav, ref, ent, is_on, is_off,
        eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef,
        SEQ, DUAL, TIS, OFF, KL, HAS_ENT,
    )
    tl.store(out_ptr + offs, w * loss, mask=m)

    is_act = is_on | is_off
    fo = is_on.to(tl.float32)
    ff = is_off.to(tl.float32)
    fa = is_act.to(tl.float32)
    base = part_ptr + pid.to(tl.int64) * NM
    tl.store(base + 0, tl.sum(fo, axis=0))
    tl.store(base + 1, tl.sum(ff, axis=0))
    tl.store(base + 2, tl.sum(fa, axis=0))
    tl.store(base + 3, tl.sum(clip_hi.to(tl.float32), axis=0))
    tl.store(base + 4, tl.sum(clip_lo.to(tl.float32), axis=0))
    tl.store(base + 5, tl.sum(dual.to(tl.float32), axis=0))
    tl.store(base + 6, tl.sum(tl.where(is_on, r, 0.0), axis=0))
    tl.store(base + 7, tl.sum(tl.where(is_on, old - logp, 0.0), axis=0))
    tl.store(base + 8, tl.sum(tl.where(is_act, kl, 0.0), axis=0))
    tl.store(base + 9, tl.sum(tl.where(is_act, ent, 0.0), axis=0))
    tl.store(base + 10, tl.sum(tl.where(is_on, tis_w, 0.0), axis=0))
    tl.store(base + 11, tl.sum(tl.where(is_off, off_w, 0.0), axis=0))


@triton.jit
def _policy_loss_bwd_kernel(
    grad_ptr, logp_ptr, old_ptr, adv_ptr, w_ptr, scale_ptr, code_ptr, seqlr_ptr, behav_ptr, ref_ptr, ent_ptr,
    dlogp_ptr, dent_ptr, N,
    eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef,
    SEQ: tl.constexpr, DUAL: tl.constexpr, TIS: tl.constexpr, OFF: tl.constexpr, KL: tl.constexpr,
    HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    code = tl.load(code_ptr + offs, mask=m, other=0).to(tl.int32)
    is_on = code == 1
    is_off = code == 2
    logp, old, adv, scale, seqlr, behav, ref = _load_token_inputs(
        offs, m, logp_ptr, old_ptr, adv_ptr, scale_ptr, seqlr_ptr, behav_ptr, ref_ptr, SEQ, TIS, OFF, KL
    )
    # the upstream gradient is per token (pitfall 7): never assume a scalar 1
    gw = tl.load(grad_ptr + offs, mask=m, other=0.0).to(tl.float32) * tl.load(w_ptr + offs, mask=m, other=0.0)
    ent = logp
    loss, dlogp, r, clip_hi, clip_lo, dual, kl, tis_w, off_w = _policy_token(
        logp, old, adv, scale, seqlr, behav, ref, ent, is_on, is_off,
        eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef,
        SEQ, DUAL, TIS, OFF, KL, False,
    )
    tl.store(dlogp_ptr + offs, gw * dlogp, mask=m)
    if HAS_ENT:
        tl.store(dent_ptr + offs, tl.where(is_on | is_off, -ent_coef * gw, 0.0), mask=m)
