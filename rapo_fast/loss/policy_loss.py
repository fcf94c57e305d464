"""rapo_fast.rapo_loss and rapo_fast.RAPOLoss: the drop-in RAPO / GRPO / DAPO / GSPO / PPO policy loss.

Flow: validate (may sync with the device, before anything runs) -> logp (and entropy H when entropy_coef != 0 or
metrics are asked for) = rapo_fast.token_logprobs(...) -> per-sequence quantities (shaping factor F, GSPO sequence
log-ratio, aggregation weights) as small torch ops on [N]/[S] vectors -> one elementwise Triton kernel
(kernels/loss/policy_loss.py, registered as rapo_fast::policy_loss with a fake and an autograd formula) giving the
weighted per-token loss and the metric partial sums; its backward gives dL/dlogp and dL/dH times the upstream
gradient. The loss itself only touches [N] vectors. CPU tensors without TRITON_INTERPRET=1, and float64 inputs,
take the same math through the reference's per-token function (rapo_fast/reference/policy_loss.py, the spec).

Passes over the logits and GEMMs of the hidden path (logits= always takes the two-pass path: its logits exist already):
- two-pass (GSPO, no gradient needed, RAPO_FAST_FUSED_LINEAR_LOSS=0, or no Triton): token_logprobs' forward (GEMM
  h W^T per tile, one pass), the policy op on [N] vectors, then token_logprobs' backward (recompute h W^T, grad_z in
  place, grad_h = gz W, grad_W = gz^T h): 2 passes, 4 GEMM families.
- fused (hidden=, token level, gradient needed, Triton device; the default): rapo_fast/loss/fused_linear.py forms
  each tile's logits, log-prob, entropy, token loss and logits gradient while the tile is in memory and accumulates
  grad_h / grad_W / grad_b in the forward; the backward multiplies them by the upstream scalar: 1 pass, 3 GEMM
  families (4 again, in the forward, when one row of V exceeds the tile byte budget; see that module).
No host sync after validation: metrics are 0-dim tensors computed from on-device sums.

Aggregation (verl's agg_loss) and `global_num_tokens` (the normaliser of the whole global batch, so that the losses of
data-parallel shards or gradient-accumulation micro-batches, and their gradients, sum to the one-big-batch loss):
  token-mean               sum_t l_t / D,  D = tokens in the loss (global: all shards' count)
  seq-mean-token-mean      sum_s (sum_{t in s} l_t / n_s) / G,  G = sequences with >= 1 token in the loss (global count)
  seq-mean-token-sum       sum_s sum_{t in s} l_t / G
  seq-mean-token-sum-norm  sum_t l_t / K,  K = T (padded) or the longest cu_seqlens segment (flat); global: a constant K
Counts are clamped to >= 1 (an all-masked batch gives loss 0, no NaN). With DDP, which averages gradients over W ranks,
multiply the loss by W as verl does (dp_size).
What this is not: the log-prob kernel (rapo_fast/loss/logprobs.py) or an advantage estimator
(rapo_fast/loss/advantages.py).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from rapo_fast._dispatch import register_op, use_triton
from rapo_fast.loss.logprobs import token_logprobs
from rapo_fast.reference.logprobs import linear_token_logprobs_ref, token_logprobs_ref
from rapo_fast.reference.policy_loss import policy_token_loss_ref

__all__ = ["rapo_loss", "policy_loss_from_logp", "RAPOLoss", "OPTION_DEFAULTS"]

from rapo_fast.loss.options import (  # noqa: F401  (re-exported: the option vocabularies are public)
    IS_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    OFFPOLICY_MODES,
    OPTION_DEFAULTS,
    _validate,
    _validate_model_inputs,
)

_NUM_METRICS = 12
_BLOCK = 1024


# ---------------------------------------------------------------------------------------------------------- kernel op
def _torch_policy_loss(
    logp, old, adv, w, scale, code, seqlr, behav, ref, ent, eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta,
    ent_coef, off_mode, kl_mode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's math in torch (the reference's per-token function): weighted token losses and the metric sums.
    Differentiable by autograd; the fallback of rapo_loss and of the registered op on devices without Triton."""
    on, off = code == 1, code == 2
    act = on | off
    tok, terms = policy_token_loss_ref(
        logp, old, adv, on_mask=on, off_mask=off, ratio_scale=scale, seq_log_ratio=seqlr, behav_logp=behav,
        ref_logp=ref, entropy=ent, offpolicy_train=OFFPOLICY_MODES[off_mode], gamma=gamma, is_cap=is_cap,
        tis_cap=tis_cap if tis_cap > 0 else None, eps_low=eps_low, eps_high=eps_high,
        dual_clip=dual_c if dual_c > 0 else None, beta=beta, kl_estimator=KL_ESTIMATORS[max(kl_mode, 1) - 1],
        entropy_coef=ent_coef,
    )
    z = torch.zeros_like(logp).detach()

    def msum(x, m):
        return torch.where(m, x.to(z.dtype), z).sum()

    sums = torch.stack([
        on.sum().to(z.dtype), off.sum().to(z.dtype), act.sum().to(z.dtype), msum(terms["clipped_high"], on),
        msum(terms["clipped_low"], on), msum(terms["dual_clipped"], on), msum(terms["ratio"], on),
        msum(terms["approx_kl"], on), msum(terms["kl"], act) if kl_mode else z.sum(),
        msum(ent.detach(), act) if ent is not None else z.sum(),
        msum(terms["tis_weight"], on) if tis_cap > 0 else z.sum(),
        msum(terms["offpolicy_weight"], off) if off_mode else z.sum(),
    ])
    return tok * w, sums


def _policy_loss_impl(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
    code: torch.Tensor, seqlr: torch.Tensor | None, behav: torch.Tensor | None, ref: torch.Tensor | None,
    ent: torch.Tensor | None, eps_low: float, eps_high: float, dual_c: float, gamma: float, is_cap: float,
    tis_cap: float, beta: float, ent_coef: float, off_mode: int, kl_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(logp.device):
        with torch.no_grad():
            tok, sums = _torch_policy_loss(logp, old, adv, w, scale, code, seqlr, behav, ref, ent, eps_low, eps_high,
                                           dual_c, gamma, is_cap, tis_cap, beta, ent_coef, off_mode, kl_mode)
        return tok.to(logp.dtype), sums.to(torch.float32)
    from rapo_fast.kernels.loss import (
        policy_loss as K,  # lazy: `import rapo_fast.loss.policy_loss` must not need triton
    )

    n = logp.numel()
    out = torch.empty_like(logp)
    nb = max(1, -(-n // _BLOCK))
    part = torch.zeros((nb, K.NUM_METRICS), dtype=torch.float32, device=logp.device)
    if n > 0:
        K._policy_loss_fwd_kernel[(nb,)](
            logp, old, adv, w, scale, code, seqlr if seqlr is not None else logp, behav if behav is not None else logp,
            ref if ref is not None else logp, ent if ent is not None else logp, out, part, n,
            eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef,
            SEQ=seqlr is not None, DUAL=dual_c > 0, TIS=tis_cap > 0, OFF=off_mode, KL=kl_mode,
            HAS_ENT=ent is not None, BLOCK=_BLOCK, NM=K.NUM_METRICS,
        )
    return out, part.sum(0)


def _policy_loss_fake(logp, old, adv, w, scale, code, seqlr, behav, ref, ent, *args):
    return torch.empty_like(logp), logp.new_empty((_NUM_METRICS,))


def _policy_loss_bwd_impl(
    grad: torch.Tensor, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, w: torch.Tensor,
    scale: torch.Tensor, code: torch.Tensor, seqlr: torch.Tensor | None, behav: torch.Tensor | None,
    ref: torch.Tensor | None, has_ent: bool, eps_low: float, eps_high: float, dual_c: float, gamma: float,
    is_cap: float, tis_cap: float, beta: float, ent_coef: float, off_mode: int, kl_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(logp.device):
        # autograd is off inside a custom op's implementation; torch.func.vjp still differentiates (the loss is
        # linear in H, so any entropy value gives its gradient)
        def tok_of(lp, ent):
            return _torch_policy_loss(lp, old, adv, w, scale, code, seqlr, behav, ref, ent if has_ent else None,
                                      eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef, off_mode,
                                      kl_mode)[0]

        _, vjp = torch.func.vjp(tok_of, logp.detach(), torch.zeros_like(logp))
        dlogp, dent = vjp(grad.to(logp.dtype))
        return dlogp, (dent if has_ent else logp.new_empty((0,)))
    from rapo_fast.kernels.loss import policy_loss as K

    n = logp.numel()
    dlogp = torch.empty_like(logp)
    dent = torch.empty_like(logp) if has_ent else logp.new_empty((0,))
    if n > 0:
        grad = grad.contiguous()
        K._policy_loss_bwd_kernel[(max(1, -(-n // _BLOCK)),)](
            grad, logp, old, adv, w, scale, code, seqlr if seqlr is not None else logp,
            behav if behav is not None else logp, ref if ref is not None else logp, logp, dlogp,
            dent if has_ent else dlogp, n,
            eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef,
            SEQ=seqlr is not None, DUAL=dual_c > 0, TIS=tis_cap > 0, OFF=off_mode, KL=kl_mode,
            HAS_ENT=has_ent, BLOCK=_BLOCK,
        )
    return dlogp, dent


def _policy_loss_bwd_fake(grad, logp, old, adv, w, scale, code, seqlr, behav, ref, has_ent, *args):
    return torch.empty_like(logp), (torch.empty_like(logp) if has_ent else logp.new_empty((0,)))


_policy_loss_bwd_op = register_op("policy_loss_bwd", _policy_loss_bwd_impl, fake=_policy_loss_bwd_fake)


def _setup_context(ctx, inputs, output):
    logp, old, adv, w, scale, code, seqlr, behav, ref, ent = inputs[:10]
    ctx.save_for_backward(logp, old, adv, w, scale, code, seqlr, behav, ref)
    ctx.has_ent = ent is not None
    ctx.scalars = inputs[10:]


def _backward(ctx, g_out, g_part):
    logp, old, adv, w, scale, code, seqlr, behav, ref = ctx.saved_tensors
    dlogp, dent = _policy_loss_bwd_op(g_out, logp, old, adv, w, scale, code, seqlr, behav, ref, ctx.has_ent,
                                      *ctx.scalars)
    return (dlogp, None, None, None, None, None, None, None, None, dent if ctx.has_ent else None) + (None,) * 10


policy_loss_op = register_op("policy_loss", _policy_loss_impl, fake=_policy_loss_fake, backward=_backward,
                             setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------- public entry
def _use_fused(hidden, weight, bias, importance_sampling_level: str) -> bool:
    """Whether rapo_loss takes the one-pass fused hidden-state path (rapo_fast/loss/fused_linear.py).

    Only for hidden= at token level (GSPO's ratio needs the whole sequence's logp first), when a gradient is needed
    (without one, the fused forward would do the two-pass forward's work plus gradient GEMMs), on a Triton device,
    not fp64 (the reference's checking precision). RAPO_FAST_FUSED_LINEAR_LOSS=0, read at call time, forces the
    two-pass path (benchmarks and tests compare the two).
    """
    if hidden is None or importance_sampling_level != "token" or hidden.dtype == torch.float64:
        return False
    if os.environ.get("RAPO_FAST_FUSED_LINEAR_LOSS", "1") == "0":
        return False
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))):
        return False
    return use_triton(hidden.device)


def rapo_loss(
    logits: torch.Tensor | None = None,
    *,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    targets: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    retrieved_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    shaping_m: float = 0.0,
    offpolicy_train: str = "none",
    gamma: float = 0.1,
    is_cap: float = 2.0,
    behav_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    importance_sampling_level: str = "token",
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    loss_agg: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    return_metrics: bool = False,
):
    """RAPO policy loss (clipped surrogate with importance shaping, off-policy terms, TIS, KL, entropy bonus).

    Shapes: padded targets [B, T] (rows are sequences) with logits [B, T, V] or hidden [B, T, H]; or flat targets [N]
    with logits [N, V] / hidden [N, H] and cu_seqlens [S+1] (int32/int64; without it the N tokens are one sequence).
    weight [V, H] and bias [V] (hidden's dtype) for the hidden path; logits/hidden fp32/fp16/bf16 (fp64: reference
    path); targets integer in [0, V). old_logp, behav_logp, ref_logp: float, shaped like targets, at the same
    temperature. advantages: float, per token (targets' shape) or per sequence ([B] or [S]; per token wins if both
    fit). loss_mask / retrieved_mask / response_mask: bool or 0/1 numbers shaped like targets. loss_mask marks the
    tokens eligible for the loss; retrieved tokens among them enter only with offpolicy_train "shaped"/"truncated".
    response_mask (default: every position of the row / segment) is F's denominator. Options: see the module and
    reference docstrings; global_num_tokens: the global normaliser of loss_agg (see module docstring).
    Returns a 0-dim fp32 loss (fp64 for fp64 input), or (loss, metrics) with 0-dim detached metrics: clip_frac_low,
    clip_frac_high, dual_clip_frac, ratio_mean, approx_kl (mean old - logp), kl, entropy (on tokens in the loss),
    retrieved_frac (retrieved / response tokens), tis_weight_mean, offpolicy_weight_mean, num_tokens,
    num_offpolicy_tokens.
    """
    a = dict(locals())
    facts = _validate(a)
    want_ent = entropy_coef != 0.0 or return_metrics
    x = logits if logits is not None else hidden
    if _use_fused(hidden, weight, bias, importance_sampling_level):
        # log-probs, loss and gradients in one pass: rapo_fast/loss/fused_linear.py
        return _loss_from_logp(a, facts, None, None, fused=True)
    if x.dtype == torch.float64:  # a checking precision (gradcheck, tests): the reference, which keeps fp64
        out = (token_logprobs_ref(logits, targets, temperature, want_ent) if logits is not None else
               linear_token_logprobs_ref(hidden, weight, targets, bias, temperature, want_ent))
    else:
        out = token_logprobs(logits, hidden=hidden, weight=weight, bias=bias, targets=targets,
                             temperature=temperature, return_entropy=want_ent)
    logp, ent = out if want_ent else (out, None)
    return _loss_from_logp(a, facts, logp, ent)



def policy_loss_from_logp(
    logp: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    retrieved_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    shaping_m: float = 0.0,
    offpolicy_train: str = "none",
    gamma: float = 0.1,
    is_cap: float = 2.0,
    behav_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    importance_sampling_level: str = "token",
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    loss_agg: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    return_metrics: bool = False,
):
    """rapo_loss from log-probs that are already computed (e.g. verl's policy-loss registry hands them over).

    logp: float [B, T] or [N] (with cu_seqlens), differentiable; entropy: like logp, required when entropy_coef != 0
    (else only the entropy metric uses it; 0 without it). Every other argument, the validation and the return value
    are rapo_loss's; no temperature (it is in logp already). The per-token policy op runs on [N] vectors (Triton on
    CUDA / under TRITON_INTERPRET=1, the reference's per-token function otherwise).
    """
    a = dict(locals())
    facts = _validate(a)
    return _loss_from_logp(a, facts, logp, entropy)

def _loss_from_logp(a: dict, facts: dict, logp: torch.Tensor | None, ent: torch.Tensor | None, fused: bool = False):
    """Everything of rapo_loss after the log-probs: per-sequence quantities, aggregation weights, the policy op (or,
    with fused=True and logp None, the fused hidden-state op) and the metrics. `a` holds rapo_loss's arguments."""
    tshape = facts["shape"]
    flat, S = facts["flat"], facts["rows"]
    n = math.prod(tshape)
    (old_logp, behav_logp, ref_logp, loss_mask, retrieved_mask, response_mask, advantages, cu_seqlens,
     global_num_tokens) = (a[k] for k in ("old_logp", "behav_logp", "ref_logp", "loss_mask", "retrieved_mask",
                                          "response_mask", "advantages", "cu_seqlens", "global_num_tokens"))
    (shaping_m, offpolicy_train, gamma, is_cap, tis_cap, eps_low, eps_high, dual_clip, importance_sampling_level, beta,
     kl_estimator, entropy_coef, loss_agg, return_metrics) = (a[k] for k in (
        "shaping_m", "offpolicy_train", "gamma", "is_cap", "tis_cap", "eps_low", "eps_high", "dual_clip",
        "importance_sampling_level", "beta", "kl_estimator", "entropy_coef", "loss_agg", "return_metrics"))
    if fused:
        lp, cd, dev = None, torch.float32, a["hidden"].device
    else:
        if ent is not None and entropy_coef == 0.0:
            ent = ent.detach()  # for the metric only: no backward through the entropy
        cd = torch.float64 if logp.dtype == torch.float64 else torch.float32
        dev = logp.device
        lp = logp.reshape(n).to(cd)

    def vec(x):
        return None if x is None else x.reshape(n).to(cd).contiguous()

    old, behav, ref = vec(old_logp), vec(behav_logp), vec(ref_logp)
    ent_v = vec(ent)
    lm = loss_mask.reshape(n) != 0
    ret = retrieved_mask.reshape(n) != 0 if retrieved_mask is not None else torch.zeros_like(lm)
    on = lm & ~ret
    off = lm & ret if offpolicy_train != "none" else torch.zeros_like(lm)
    act = on | off
    # segment id of each token; padded rows are segments of length T
    if flat and cu_seqlens is not None:
        seg = torch.searchsorted(cu_seqlens[1:].to(torch.int64), torch.arange(n, device=dev), right=True)
    elif flat:
        seg = torch.zeros(n, dtype=torch.int64, device=dev)
    else:
        seg = torch.arange(n, device=dev) // tshape[1]

    def seg_sum(x):
        if not flat:  # rows: a plain (deterministic) row sum; index_add_ is atomic on CUDA
            return x.to(cd).view(S, tshape[1]).sum(1)
        return torch.zeros(S, dtype=cd, device=dev).index_add_(0, seg, x.to(cd))

    resp = response_mask.reshape(n) != 0 if response_mask is not None else torch.ones_like(lm)
    frac = seg_sum(ret) / seg_sum(resp).clamp_min(1)
    scale = (1.0 + shaping_m * frac)[seg].contiguous()
    n_on = seg_sum(on)
    seqlr = None
    if importance_sampling_level == "sequence":
        lr = torch.where(on, lp.detach() - old, torch.zeros_like(lp))
        seqlr = (seg_sum(lr) / n_on.clamp_min(1))[seg].contiguous()
    adv = advantages.to(cd)
    adv = (adv.reshape(n) if tuple(advantages.shape) == tshape else adv[seg]).contiguous()

    # aggregation weight of each token (no gradient: counts only)
    g = None if global_num_tokens is None else torch.as_tensor(global_num_tokens, dtype=cd).to(dev).reshape(())
    actf = act.to(cd)
    if loss_agg == "token-mean":
        w = actf / (g if g is not None else actf.sum().clamp_min(1))
    elif loss_agg == "seq-mean-token-sum-norm":
        w = actf / (g if g is not None else torch.tensor(float(facts["max_len"]), dtype=cd, device=dev))
    else:
        n_act = seg_sum(act)
        denom = g if g is not None else (n_act > 0).sum().clamp_min(1).to(cd)
        w = actf / denom
        if loss_agg == "seq-mean-token-mean":
            w = w / n_act.clamp_min(1)[seg]
    w = w.contiguous()

    code = (on.to(torch.int8) + 2 * off.to(torch.int8)).contiguous()
    kl_mode = 0 if ref is None else 1 + KL_ESTIMATORS.index(kl_estimator)
    behav_used = behav if (tis_cap is not None or offpolicy_train == "truncated") else None
    scalars = (float(eps_low), float(eps_high), float(dual_clip or 0.0), float(gamma), float(is_cap),
               float(tis_cap or 0.0), float(beta), float(entropy_coef), OFFPOLICY_MODES.index(offpolicy_train),
               kl_mode)
    if fused:
        from rapo_fast.loss.fused_linear import fused_linear_policy_loss

        loss, sums = fused_linear_policy_loss(a["hidden"], a["weight"], a["bias"], a["targets"], old, adv, w, scale,
                                              code, behav_used, ref if kl_mode else None, *scalars,
                                              float(a["temperature"]), entropy_coef != 0.0 or return_metrics)
    else:
        args = (lp.contiguous(), old, adv, w, scale, code, seqlr, behav_used, ref if kl_mode else None, ent_v,
                *scalars)
        # fp64 (a checking precision) and devices without Triton: the same math in torch, differentiated by autograd
        tok, sums = policy_loss_op(*args) if use_triton(dev) and cd == torch.float32 else _torch_policy_loss(*args)
        loss = tok.sum()
    if not return_metrics:
        return loss
    sums = sums.detach().to(cd)
    n_on_t, n_off_t, n_act_t = sums[0].clamp_min(1), sums[1].clamp_min(1), sums[2].clamp_min(1)
    metrics = {
        "clip_frac_high": sums[3] / n_on_t,
        "clip_frac_low": sums[4] / n_on_t,
        "dual_clip_frac": sums[5] / n_on_t,
        "ratio_mean": sums[6] / n_on_t,
        "approx_kl": sums[7] / n_on_t,
        "kl": sums[8] / n_act_t,
        "entropy": sums[9] / n_act_t,
        "retrieved_frac": ret.sum().to(cd) / resp.sum().clamp_min(1).to(cd),
        "tis_weight_mean": sums[10] / n_on_t if tis_cap is not None else torch.ones((), dtype=cd, device=dev),
        "offpolicy_weight_mean": sums[11] / n_off_t,
        "num_tokens": sums[2],
        "num_offpolicy_tokens": sums[1],
    }
    return loss, metrics


class RAPOLoss(nn.Module):
    """nn.Module form of rapo_loss: options (and `preset`, a name in rapo_fast.loss.presets or a dict) fixed at
    construction, explicit keyword options overriding the preset; forward(logits=None, *, hidden, weight, bias,
    targets, old_logp, advantages, loss_mask, retrieved_mask, response_mask, behav_logp, ref_logp, cu_seqlens,
    global_num_tokens, return_metrics=None) takes the tensors and returns what rapo_loss returns."""

    def __init__(self, preset: str | dict | None = None, **options: Any):
        super().__init__()
        from rapo_fast.loss import presets as P

        opts: dict[str, Any] = dict(OPTION_DEFAULTS)
        if preset is not None:
            opts.update(P.get(preset))
        unknown = sorted(set(options) - set(OPTION_DEFAULTS))
        if unknown:
            raise TypeError(f"RAPOLoss: unknown option(s) {unknown}; expected some of {sorted(OPTION_DEFAULTS)}")
        opts.update(options)
        self.options = opts

    def forward(self, logits: torch.Tensor | None = None, *, return_metrics: bool | None = None, **tensors):
        bad = sorted(set(tensors) & set(OPTION_DEFAULTS))
        if bad:
            raise TypeError(f"RAPOLoss.forward: {bad} are constructor options, not forward arguments")
        opts = dict(self.options)
        if return_metrics is not None:
            opts["return_metrics"] = return_metrics
        return rapo_loss(logits, **tensors, **opts)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items() if OPTION_DEFAULTS.get(k) != v)
