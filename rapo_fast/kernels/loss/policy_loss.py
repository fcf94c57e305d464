"""Triton kernels of the per-token RAPO policy loss: forward (weighted token loss + metric partial sums) and backward
(dL/dlogp, dL/dH times the upstream gradient), elementwise over N tokens.

What this is: `@triton.jit` code only (launchers: rapo_fast/loss/policy_op.py). The options arrive as one named tuple
`opts` whose fields are LossOptions' kernel options (a choice or flag a constexpr, a real a runtime scalar), the
per-token inputs as one tensor (rows: policy_layout.TokenInput).
What this is not: the spec. The formulas are those of rapo_fast/reference/policy_loss.py, written out in docs/loss.md
section 3 (per token) and section 4 (aggregation).
"""

import triton
import triton.language as tl

from rapo_fast.kernels.loss.policy_layout import (
    KL_ESTIMATORS,
    NUM_METRICS,
    OFFPOLICY_MODES,
    Metric,
    TokenCode,
    TokenInput,
)

# jit code reads only constexpr globals: the layout's names and the option codes (their vocabularies' indices)
_CODE_ON = tl.constexpr(int(TokenCode.ON))
_CODE_OFF = tl.constexpr(int(TokenCode.OFF))
_OFF_NONE = tl.constexpr(OFFPOLICY_MODES.index("none"))
_OFF_SHAPED = tl.constexpr(OFFPOLICY_MODES.index("shaped"))
_OFF_TRUNCATED = tl.constexpr(OFFPOLICY_MODES.index("truncated"))
_KL_K1 = tl.constexpr(KL_ESTIMATORS.index("k1"))
_KL_K2 = tl.constexpr(KL_ESTIMATORS.index("k2"))
_KL_K3 = tl.constexpr(KL_ESTIMATORS.index("k3"))
_ROW_OLD = tl.constexpr(int(TokenInput.OLD))
_ROW_ADV = tl.constexpr(int(TokenInput.ADV))
_ROW_W = tl.constexpr(int(TokenInput.W))
_ROW_SCALE = tl.constexpr(int(TokenInput.SCALE))
_ROW_CODE = tl.constexpr(int(TokenInput.CODE))
_ROW_SEQLR = tl.constexpr(int(TokenInput.SEQLR))
_ROW_BEHAV = tl.constexpr(int(TokenInput.BEHAV))
_ROW_REF = tl.constexpr(int(TokenInput.REF))
# presence bits of the optional rows (constexpr on the left: the interpreter's int >> constexpr is not defined)
_HAS_SEQLR = tl.constexpr(1 << int(TokenInput.SEQLR))
_HAS_BEHAV = tl.constexpr(1 << int(TokenInput.BEHAV))
_HAS_REF = tl.constexpr(1 << int(TokenInput.REF))
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
    opts,
    SEQ: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_ENT: tl.constexpr,
):
    """Loss of one token block and its derivative w.r.t. logp (and the metric terms). All fp32. `opts`: the options
    (module docstring); dual_clip and tis_cap are 0 when off (LossOptions' encoding), and the branches they select are
    where()s, not constexprs."""
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
    rc = tl.minimum(tl.maximum(rh, 1.0 - opts.eps_low), 1.0 + opts.eps_high)
    pg2 = -adv * rc
    clipped = pg2 > pg1
    pg = tl.where(clipped, pg2, pg1)
    dpg = tl.where(clipped, 0.0, -adv * rh * g_lr)
    pg3 = -adv * opts.dual_clip
    dual = (adv < 0) & (pg > pg3) & (opts.dual_clip > 0.0)
    pg = tl.where(dual, pg3, pg)
    dpg = tl.where(dual, 0.0, dpg)
    lw = tl.minimum(tl.maximum(old - behav, -CL), CL)
    tis_w = tl.where(opts.tis_cap > 0.0, tl.minimum(tl.exp(lw), opts.tis_cap), 1.0)
    pg = pg * tis_w
    dpg = dpg * tis_w
    loss = tl.where(is_on, pg, 0.0)
    dlogp = tl.where(is_on, dpg, 0.0)

    l_off, d_off, off_w = _offpolicy_token(logp=logp, adv=adv, behav=behav, opts=opts)
    if opts.offpolicy_train != _OFF_NONE:
        loss += tl.where(is_off, l_off, 0.0)
        dlogp += tl.where(is_off, d_off, 0.0)
    kl = tl.zeros(logp.shape, tl.float32)
    if HAS_REF:
        kl, dkl = _kl_token(logp=logp, ref=ref, opts=opts)
        loss += tl.where(is_act, opts.beta * kl, 0.0)
        dlogp += tl.where(is_act, opts.beta * dkl, 0.0)
    if HAS_ENT:
        loss += tl.where(is_act, -opts.entropy_coef * ent, 0.0)
    clip_hi = is_on & clipped & (rh > 1.0 + opts.eps_high)
    clip_lo = is_on & clipped & (rh < 1.0 - opts.eps_low)
    return loss, dlogp, r, clip_hi, clip_lo, is_on & dual, kl, tis_w, off_w


@triton.jit
def _offpolicy_token(logp, adv, behav, opts):
    """Loss, its derivative w.r.t. logp, and the weight of a retrieved token trained off-policy: -A p / (p + gamma)
    ("shaped") or -A sg(min(exp(logp - behav), is_cap)) logp ("truncated"); zeros when offpolicy_train is none."""
    loss = tl.zeros(logp.shape, tl.float32)
    dlogp = tl.zeros(logp.shape, tl.float32)
    off_w = tl.zeros(logp.shape, tl.float32)
    if opts.offpolicy_train == _OFF_SHAPED:
        p = tl.exp(logp)
        denom = p + opts.gamma
        off_w = p / denom
        loss = -adv * off_w
        dlogp = -adv * opts.gamma * p / (denom * denom)
    if opts.offpolicy_train == _OFF_TRUNCATED:
        lw2 = tl.minimum(tl.maximum(logp - behav, -CL), CL)
        off_w = tl.minimum(tl.exp(lw2), opts.is_cap)
        loss = -adv * off_w * logp
        dlogp = -adv * off_w
    return loss, dlogp, off_w


@triton.jit
def _kl_token(logp, ref, opts):
    """verl's KL estimator k1 / k2 / k3 of (logp, ref) and its derivative w.r.t. logp; k3 clamped to [-10, 10] when
    kl_clamp (verl), unclamped otherwise (TRL; x keeps its overflow clamp)."""
    kl = tl.zeros(logp.shape, tl.float32)
    dkl = tl.zeros(logp.shape, tl.float32)
    if opts.kl_estimator == _KL_K1:
        kl = logp - ref
        dkl = tl.full(logp.shape, 1.0, tl.float32)
    if opts.kl_estimator == _KL_K2:
        d = logp - ref
        kl = 0.5 * d * d
        dkl = d
    if opts.kl_estimator == _KL_K3:
        x = ref - logp
        gx = ((x >= -CL) & (x <= CL)).to(tl.float32)
        xc = tl.minimum(tl.maximum(x, -CL), CL)
        ex = tl.exp(xc)
        kl = ex - xc - 1.0
        dkl = -(ex - 1.0) * gx
        if opts.kl_clamp:
            gk = ((kl >= -10.0) & (kl <= 10.0)).to(tl.float32)
            kl = tl.minimum(tl.maximum(kl, -10.0), 10.0)
            dkl = dkl * gk
    return kl, dkl


@triton.jit
def _store_metric_sums(part_ptr, pid, is_on, is_off, clip_hi, clip_lo, dual, r, approx_kl, kl, ent, tis_w, off_w):
    """This program's row of the metric partial sums, one column per Metric (policy_layout.py)."""
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
def _load_token_inputs(tok_ptr, tok_stride, offs, m, logp, PRESENT: tl.constexpr):
    """The stacked per-token inputs both kernels read (rows: TokenInput); an optional row not present in PRESENT is
    never loaded (logp stands in: its value is then unused)."""
    code = tl.load(tok_ptr + _ROW_CODE * tok_stride + offs, mask=m, other=0).to(tl.float32)
    old = tl.load(tok_ptr + _ROW_OLD * tok_stride + offs, mask=m, other=0.0).to(tl.float32)
    adv = tl.load(tok_ptr + _ROW_ADV * tok_stride + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.load(tok_ptr + _ROW_W * tok_stride + offs, mask=m, other=0.0).to(tl.float32)
    scale = tl.load(tok_ptr + _ROW_SCALE * tok_stride + offs, mask=m, other=1.0).to(tl.float32)
    seqlr = logp
    behav = logp
    ref = logp
    if (_HAS_SEQLR & PRESENT) != 0:
        seqlr = tl.load(tok_ptr + _ROW_SEQLR * tok_stride + offs, mask=m, other=0.0).to(tl.float32)
    if (_HAS_BEHAV & PRESENT) != 0:
        behav = tl.load(tok_ptr + _ROW_BEHAV * tok_stride + offs, mask=m, other=0.0).to(tl.float32)
    if (_HAS_REF & PRESENT) != 0:
        ref = tl.load(tok_ptr + _ROW_REF * tok_stride + offs, mask=m, other=0.0).to(tl.float32)
    return code == _CODE_ON, code == _CODE_OFF, old, adv, w, scale, seqlr, behav, ref


@triton.jit
def policy_loss_fwd_kernel(
    logp_ptr,
    ent_ptr,
    tok_ptr,
    out_ptr,
    part_ptr,
    N,
    tok_stride,
    opts,
    PRESENT: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: docs/pitfalls.md #5
    m = offs < N
    logp = tl.load(logp_ptr + offs, mask=m, other=0.0).to(tl.float32)
    is_on, is_off, old, adv, w, scale, seqlr, behav, ref = _load_token_inputs(
        tok_ptr=tok_ptr, tok_stride=tok_stride, offs=offs, m=m, logp=logp, PRESENT=PRESENT
    )
    ent = logp
    if HAS_ENT:
        ent = tl.load(ent_ptr + offs, mask=m, other=0.0).to(tl.float32)
    loss, dlogp, r, clip_hi, clip_lo, dual, kl, tis_w, off_w = _policy_token(
        logp=logp,
        old=old,
        adv=adv,
        scale=scale,
        seqlr=seqlr,
        behav=behav,
        ref=ref,
        ent=ent,
        is_on=is_on,
        is_off=is_off,
        opts=opts,
        SEQ=(_HAS_SEQLR & PRESENT) != 0,
        HAS_REF=(_HAS_REF & PRESENT) != 0,
        HAS_ENT=HAS_ENT,
    )
    tl.store(out_ptr + offs, w * loss, mask=m)
    _store_metric_sums(
        part_ptr=part_ptr,
        pid=pid,
        is_on=is_on,
        is_off=is_off,
        clip_hi=clip_hi,
        clip_lo=clip_lo,
        dual=dual,
        r=r,
        approx_kl=old - logp,
        kl=kl,
        ent=ent,
        tis_w=tis_w,
        off_w=off_w,
    )


@triton.jit
def policy_loss_bwd_kernel(
    grad_ptr,
    logp_ptr,
    tok_ptr,
    dlogp_ptr,
    dent_ptr,
    N,
    tok_stride,
    opts,
    PRESENT: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    logp = tl.load(logp_ptr + offs, mask=m, other=0.0).to(tl.float32)
    is_on, is_off, old, adv, w, scale, seqlr, behav, ref = _load_token_inputs(
        tok_ptr=tok_ptr, tok_stride=tok_stride, offs=offs, m=m, logp=logp, PRESENT=PRESENT
    )
    # the upstream gradient is per token (docs/pitfalls.md #7): never assume a scalar 1
    gw = tl.load(grad_ptr + offs, mask=m, other=0.0).to(tl.float32) * w
    loss, dlogp, r, clip_hi, clip_lo, dual, kl, tis_w, off_w = _policy_token(
        logp=logp,
        old=old,
        adv=adv,
        scale=scale,
        seqlr=seqlr,
        behav=behav,
        ref=ref,
        ent=logp,
        is_on=is_on,
        is_off=is_off,
        opts=opts,
        SEQ=(_HAS_SEQLR & PRESENT) != 0,
        HAS_REF=(_HAS_REF & PRESENT) != 0,
        HAS_ENT=False,
    )
    tl.store(dlogp_ptr + offs, gw * dlogp, mask=m)
    if HAS_ENT:
        tl.store(dent_ptr + offs, tl.where(is_on | is_off, -opts.entropy_coef * gw, 0.0), mask=m)
