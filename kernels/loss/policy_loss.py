"""Triton kernels of the per-token RAPO policy loss: forward (weighted token loss + metric partial sums) and backward
(dL/dlogp, dL/dH times the upstream gradient), elementwise over N tokens.

What this is: `@triton.jit` code only. The log-probs come from token_logprobs; the launchers
(rapo_fast/loss/policy_op.py, called by rapo_fast/loss/policy_loss.py) gather the per-sequence quantities (shaping
factor, GSPO sequence log-ratio, aggregation weight) per token; the token codes, mode codes and metric layout are
named once in rapo_fast/loss/policy_layout.py and read here as constexprs.
What this is not: the spec. The formulas are those of rapo_fast/reference/policy_loss.py, written out in docs/loss.md
section 3 (per token) and section 4 (aggregation).
"""

import triton
import triton.language as tl

from rapo_fast.loss.policy_layout import NUM_METRICS, KLMode, Metric, OffMode, TokenCode

# jit code reads only constexpr globals: the layout's names as constexprs
_CODE_ON = tl.constexpr(int(TokenCode.ON))
_CODE_OFF = tl.constexpr(int(TokenCode.OFF))
_OFF_SHAPED = tl.constexpr(int(OffMode.SHAPED))
_OFF_TRUNCATED = tl.constexpr(int(OffMode.TRUNCATED))
_OFF_NONE = tl.constexpr(int(OffMode.NONE))
_KL_NONE = tl.constexpr(int(KLMode.NONE))
_KL_K1 = tl.constexpr(int(KLMode.K1))
_KL_K2 = tl.constexpr(int(KLMode.K2))
_KL_K3 = tl.constexpr(int(KLMode.K3))
_KL_K3U = tl.constexpr(int(KLMode.K3_UNCLAMPED))
# every log-ratio is clamped to [-CL, CL] before exp (the reference's LOG_RATIO_CLAMP, verl's clamp)
CL = tl.constexpr(20.0)
# metric partial sums, one row of NUM_METRICS per program: the launcher sums rows and turns sums into means
_NUM_METRICS = tl.constexpr(NUM_METRICS)
_M_N_ON = tl.constexpr(int(Metric.N_ON))
_M_N_OFF = tl.constexpr(int(Metric.N_OFF))
_M_N_ACTIVE = tl.constexpr(int(Metric.N_ACTIVE))
_M_CLIP_HIGH = tl.constexpr(int(Metric.CLIP_HIGH))
_M_CLIP_LOW = tl.constexpr(int(Metric.CLIP_LOW))
_M_DUAL_CLIP = tl.constexpr(int(Metric.DUAL_CLIP))
_M_RATIO = tl.constexpr(int(Metric.RATIO))
_M_APPROX_KL = tl.constexpr(int(Metric.APPROX_KL))
_M_KL = tl.constexpr(int(Metric.KL))
_M_ENTROPY = tl.constexpr(int(Metric.ENTROPY))
_M_TIS_WEIGHT = tl.constexpr(int(Metric.TIS_WEIGHT))
_M_OFFPOLICY_WEIGHT = tl.constexpr(int(Metric.OFFPOLICY_WEIGHT))


@triton.jit
def _policy_token(
    logp,
    old,
    adv,
    scale,
    seqlr,
    behav,
    ref,
    ent,
    is_on,
    is_off,
    eps_low,
    eps_high,
    dual_c,
    gamma,
    is_cap,
    tis_cap,
    beta,
    ent_coef,
    SEQ: tl.constexpr,
    DUAL: tl.constexpr,
    TIS: tl.constexpr,
    OFF: tl.constexpr,
    KL: tl.constexpr,
    HAS_ENT: tl.constexpr,
):
    """Loss of one token block and its derivative w.r.t. logp (and the metric terms). All fp32."""
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

    l_off, d_off, off_w = _offpolicy_token(logp, adv, behav, gamma, is_cap, OFF)
    if OFF != _OFF_NONE:
        loss += tl.where(is_off, l_off, 0.0)
        dlogp += tl.where(is_off, d_off, 0.0)
    kl, dkl = _kl_token(logp, ref, KL)
    if KL != _KL_NONE:
        loss += tl.where(is_act, beta * kl, 0.0)
        dlogp += tl.where(is_act, beta * dkl, 0.0)
    if HAS_ENT:
        loss += tl.where(is_act, -ent_coef * ent, 0.0)
    clip_hi = is_on & clipped & (rh > 1.0 + eps_high)
    clip_lo = is_on & clipped & (rh < 1.0 - eps_low)
    return loss, dlogp, r, clip_hi, clip_lo, is_on & dual, kl, tis_w, off_w


@triton.jit
def _offpolicy_token(logp, adv, behav, gamma, is_cap, OFF: tl.constexpr):
    """Loss, its derivative w.r.t. logp, and the weight of a retrieved token trained off-policy: -A p / (p + gamma)
    ("shaped") or -A sg(min(exp(logp - behav), is_cap)) logp ("truncated"); zeros when OFF is none."""
    loss = tl.zeros(logp.shape, tl.float32)
    dlogp = tl.zeros(logp.shape, tl.float32)
    off_w = tl.zeros(logp.shape, tl.float32)
    if OFF == _OFF_SHAPED:
        p = tl.exp(logp)
        denom = p + gamma
        off_w = p / denom
        loss = -adv * off_w
        dlogp = -adv * gamma * p / (denom * denom)
    if OFF == _OFF_TRUNCATED:
        lw2 = tl.minimum(tl.maximum(logp - behav, -CL), CL)
        off_w = tl.minimum(tl.exp(lw2), is_cap)
        loss = -adv * off_w * logp
        dlogp = -adv * off_w
    return loss, dlogp, off_w


@triton.jit
def _kl_token(logp, ref, KL: tl.constexpr):
    """verl's KL estimator k1 / k2 / k3 of (logp, ref) and its derivative w.r.t. logp; zeros when KL is none."""
    kl = tl.zeros(logp.shape, tl.float32)
    dkl = tl.zeros(logp.shape, tl.float32)
    if KL == _KL_K1:
        kl = logp - ref
        dkl = tl.full(logp.shape, 1.0, tl.float32)
    if KL == _KL_K2:
        d = logp - ref
        kl = 0.5 * d * d
        dkl = d
    if KL == _KL_K3:
        x = ref - logp
        gx = ((x >= -CL) & (x <= CL)).to(tl.float32)
        xc = tl.minimum(tl.maximum(x, -CL), CL)
        ex = tl.exp(xc)
        kraw = ex - xc - 1.0
        gk = ((kraw >= -10.0) & (kraw <= 10.0)).to(tl.float32)
        kl = tl.minimum(tl.maximum(kraw, -10.0), 10.0)
        dkl = -(ex - 1.0) * gx * gk
    if KL == _KL_K3U:  # TRL's k3: no clamp of the estimate (x keeps its overflow clamp)
        x = ref - logp
        gx = ((x >= -CL) & (x <= CL)).to(tl.float32)
        xc = tl.minimum(tl.maximum(x, -CL), CL)
        ex = tl.exp(xc)
        kl = ex - xc - 1.0
        dkl = -(ex - 1.0) * gx
    return kl, dkl


@triton.jit
def _store_metric_sums(part_ptr, pid, is_on, is_off, clip_hi, clip_lo, dual, r, approx_kl, kl, ent, tis_w, off_w):
    """This program's row of the metric partial sums, one column per Metric (rapo_fast/loss/policy_layout.py)."""
    is_act = is_on | is_off
    base = part_ptr + pid.to(tl.int64) * _NUM_METRICS
    tl.store(base + _M_N_ON, tl.sum(is_on.to(tl.float32), axis=0))
    tl.store(base + _M_N_OFF, tl.sum(is_off.to(tl.float32), axis=0))
    tl.store(base + _M_N_ACTIVE, tl.sum(is_act.to(tl.float32), axis=0))
    tl.store(base + _M_CLIP_HIGH, tl.sum(clip_hi.to(tl.float32), axis=0))
    tl.store(base + _M_CLIP_LOW, tl.sum(clip_lo.to(tl.float32), axis=0))
    tl.store(base + _M_DUAL_CLIP, tl.sum(dual.to(tl.float32), axis=0))
    tl.store(base + _M_RATIO, tl.sum(tl.where(is_on, r, 0.0), axis=0))
    tl.store(base + _M_APPROX_KL, tl.sum(tl.where(is_on, approx_kl, 0.0), axis=0))
    tl.store(base + _M_KL, tl.sum(tl.where(is_act, kl, 0.0), axis=0))
    tl.store(base + _M_ENTROPY, tl.sum(tl.where(is_act, ent, 0.0), axis=0))
    tl.store(base + _M_TIS_WEIGHT, tl.sum(tl.where(is_on, tis_w, 0.0), axis=0))
    tl.store(base + _M_OFFPOLICY_WEIGHT, tl.sum(tl.where(is_off, off_w, 0.0), axis=0))


@triton.jit
def _load_token_inputs(
    offs,
    m,
    logp_ptr,
    old_ptr,
    adv_ptr,
    scale_ptr,
    seqlr_ptr,
    behav_ptr,
    ref_ptr,
    SEQ: tl.constexpr,
    TIS: tl.constexpr,
    OFF: tl.constexpr,
    KL: tl.constexpr,
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
    if TIS or OFF == _OFF_TRUNCATED:
        behav = tl.load(behav_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if KL != _KL_NONE:
        ref = tl.load(ref_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return logp, old, adv, scale, seqlr, behav, ref


@triton.jit
def policy_loss_fwd_kernel(
    logp_ptr,
    old_ptr,
    adv_ptr,
    w_ptr,
    scale_ptr,
    code_ptr,
    seqlr_ptr,
    behav_ptr,
    ref_ptr,
    ent_ptr,
    out_ptr,
    part_ptr,
    N,
    eps_low,
    eps_high,
    dual_c,
    gamma,
    is_cap,
    tis_cap,
    beta,
    ent_coef,
    SEQ: tl.constexpr,
    DUAL: tl.constexpr,
    TIS: tl.constexpr,
    OFF: tl.constexpr,
    KL: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: docs/pitfalls.md #5
    m = offs < N
    code = tl.load(code_ptr + offs, mask=m, other=0).to(tl.int32)
    is_on = code == _CODE_ON
    is_off = code == _CODE_OFF
    logp, old, adv, scale, seqlr, behav, ref = _load_token_inputs(
        offs, m, logp_ptr, old_ptr, adv_ptr, scale_ptr, seqlr_ptr, behav_ptr, ref_ptr, SEQ, TIS, OFF, KL
    )
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    ent = logp
    if HAS_ENT:
        ent = tl.load(ent_ptr + offs, mask=m, other=0.0).to(tl.float32)
    loss, dlogp, r, clip_hi, clip_lo, dual, kl, tis_w, off_w = _policy_token(
        logp,
        old,
        adv,
        scale,
        seqlr,
        behav,
        ref,
        ent,
        is_on,
        is_off,
        eps_low,
        eps_high,
        dual_c,
        gamma,
        is_cap,
        tis_cap,
        beta,
        ent_coef,
        SEQ,
        DUAL,
        TIS,
        OFF,
        KL,
        HAS_ENT,
    )
    tl.store(out_ptr + offs, w * loss, mask=m)
    _store_metric_sums(part_ptr, pid, is_on, is_off, clip_hi, clip_lo, dual, r, old - logp, kl, ent, tis_w, off_w)


@triton.jit
def policy_loss_bwd_kernel(
    grad_ptr,
    logp_ptr,
    old_ptr,
    adv_ptr,
    w_ptr,
    scale_ptr,
    code_ptr,
    seqlr_ptr,
    behav_ptr,
    ref_ptr,
    ent_ptr,
    dlogp_ptr,
    dent_ptr,
    N,
    eps_low,
    eps_high,
    dual_c,
    gamma,
    is_cap,
    tis_cap,
    beta,
    ent_coef,
    SEQ: tl.constexpr,
    DUAL: tl.constexpr,
    TIS: tl.constexpr,
    OFF: tl.constexpr,
    KL: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    code = tl.load(code_ptr + offs, mask=m, other=0).to(tl.int32)
    is_on = code == _CODE_ON
    is_off = code == _CODE_OFF
    logp, old, adv, scale, seqlr, behav, ref = _load_token_inputs(
        offs, m, logp_ptr, old_ptr, adv_ptr, scale_ptr, seqlr_ptr, behav_ptr, ref_ptr, SEQ, TIS, OFF, KL
    )
    # the upstream gradient is per token (docs/pitfalls.md #7): never assume a scalar 1
    gw = tl.load(grad_ptr + offs, mask=m, other=0.0).to(tl.float32) * tl.load(w_ptr + offs, mask=m, other=0.0)
    ent = logp
    loss, dlogp, r, clip_hi, clip_lo, dual, kl, tis_w, off_w = _policy_token(
        logp,
        old,
        adv,
        scale,
        seqlr,
        behav,
        ref,
        ent,
        is_on,
        is_off,
        eps_low,
        eps_high,
        dual_c,
        gamma,
        is_cap,
        tis_cap,
        beta,
        ent_coef,
        SEQ,
        DUAL,
        TIS,
        OFF,
        KL,
        False,
    )
    tl.store(dlogp_ptr + offs, gw * dlogp, mask=m)
    if HAS_ENT:
        tl.store(dent_ptr + offs, tl.where(is_on | is_off, -ent_coef * gw, 0.0), mask=m)
