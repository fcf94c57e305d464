"""rapo_fast.rapo_loss and rapo_fast.RAPOLoss: the drop-in RAPO / GRPO / DAPO / GSPO / PPO policy loss.

What this is: the flow front desk (cast, check and plan once) -> log-probs (token_logprobs' private runner: nothing is
checked twice) -> the finite log-sum-exp check -> per-sequence quantities on [N]/[S] vectors -> the elementwise op
`rapo_fast::policy_loss` (or the one-pass rapo_fast/loss/fused_linear.py). No host sync after that check. Formulas,
aggregation and paths: docs/loss.md sections 3, 4 and 6; the spec is rapo_fast/reference/policy_loss.py.
What this is not: log-probs (rapo_fast/loss/logprobs.py) or advantage estimation (rapo_fast/loss/advantages.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from rapo_fast._dispatch import use_triton
from rapo_fast.kernels.loss.policy_layout import Metric, TokenCode
from rapo_fast.loss import presets as P
from rapo_fast.loss.fused_linear import fused_linear_policy_loss
from rapo_fast.loss.logprobs import LogprobInputs, _run_logprobs, check_inplace_backward, head_in_hidden_dtype
from rapo_fast.loss.options import (  # noqa: F401  (re-exported: the option vocabularies are public)
    IGNORE_INDEX,
    IS_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    OFFPOLICY_MODES,
    OPTION_DEFAULTS,
    InputFacts,
    LossInputs,
    LossOptions,
    check_logits_rows_defined,
    check_loss_logp_defined,
    with_option_keywords,
)
from rapo_fast.loss.path_plan import Path, PathPlan, log_path, plan_path
from rapo_fast.loss.policy_op import policy_loss_op, stack_token_inputs, torch_policy_loss

__all__ = ["rapo_loss", "policy_loss_from_logp", "RAPOLoss", "LossMetrics", "LossOptions", "OPTION_DEFAULTS"]


def _use_fused(plan: PathPlan) -> bool:
    """Whether rapo_loss takes the one-pass fused hidden-state path (rapo_fast/loss/fused_linear.py): the plan's
    choice (rapo_fast/loss/path_plan.py: hidden= at token level, a gradient needed, Triton, and for backend="auto"
    RAPO_FAST_FUSED_LINEAR_LOSS not 0). One call per rapo_loss call: tests spy on it."""
    return plan.path is Path.TRITON_FUSED_LINEAR


def _plan(a: LossInputs, backend: str, want_ent: bool) -> PathPlan:
    """rapo_loss's path for its checked inputs (rapo_fast/loss/path_plan.py)."""
    hidden = a.hidden
    x = a.logits if a.logits is not None else hidden
    grad_in = (hidden, a.weight, a.bias) if hidden is not None else (x,)
    return plan_path(
        "rapo_loss",
        backend,
        device=x.device,
        dtype=x.dtype,
        hidden=hidden is not None,
        entropy=want_ent,
        needs_grad=torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grad_in),
        sequence_level=a.opts.importance_sampling_level == "sequence",
        auto_triton=use_triton(x.device) if backend == "auto" else None,
    )


@with_option_keywords()
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
    behav_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    options: LossOptions | None = None,
    inplace_backward: bool = False,
    backend: str = "auto",
    **option_kwargs: Any,
):
    """RAPO policy loss (clipped surrogate with importance shaping, off-policy terms, TIS, KL, entropy bonus).

    Shapes: padded targets [B, T] (rows are sequences) with logits [B, T, V] or hidden [B, T, H]; or flat targets
    [N] with logits [N, V] / hidden [N, H] and cu_seqlens [S+1] (int32/int64; without it the N tokens are one
    sequence). weight [V, H] and bias [V] (hidden's dtype; under torch.autocast a weight/bias of another float
    dtype, e.g. an fp32 lm_head weight with bf16 hidden, is cast to hidden's dtype here, differentiably: its
    gradient comes back in its own dtype) for the hidden path; logits/hidden fp32/fp16/bf16 (fp64: reference path);
    targets integer in [0, V), or -100 (IGNORE_INDEX) at tokens where loss_mask is 0. old_logp, behav_logp,
    ref_logp: float log-probs, shaped like targets, at the same temperature; old_logp above 1e-4 (OLD_LOGP_MAX) at a
    token in the loss is refused (probabilities passed instead of log-probs). advantages: float, per token (targets'
    shape) or per sequence ([B] or [S]; per token wins if both fit). loss_mask / retrieved_mask / response_mask:
    bool or 0/1 numbers shaped like targets. loss_mask marks the tokens eligible for the loss; retrieved tokens
    among them enter only with offpolicy_train "shaped"/"truncated". response_mask (default: every position of the
    row / segment) is F's denominator. global_num_tokens: the global normaliser of loss_agg (docs/loss.md section 4).
    inplace_backward (logits= only): the backward writes the logits gradient over the logits instead of a new [N, V]
    tensor; only when nothing reads the logits afterwards (the hazard and the cases where it has no effect:
    rapo_fast.token_logprobs, docs/loss.md).
    Options: the fields of rapo_fast.loss.options.LossOptions, as keywords, or as `options=LossOptions(...)` (keywords
    given beside it win).
    backend: "auto" (default), "triton", "torch" or "reference" (token_logprobs' meanings; "triton" also takes the
    fused one-pass path for hidden= at token level with a gradient); an explicit backend that cannot run on the inputs
    raises ValueError. docs/architecture.md ("Log-prob and loss paths") lists the paths.
    Returns a 0-dim fp32 loss (fp64 for fp64 input), or (loss, metrics), metrics a LossMetrics whose 0-dim detached
    fields are clip_frac_low, clip_frac_high, dual_clip_frac, ratio_mean, approx_kl (mean old - logp), kl, entropy (on
    tokens in the loss), retrieved_frac (retrieved / response tokens), tis_weight_mean, offpolicy_weight_mean,
    num_tokens, num_offpolicy_tokens (metrics.scalars(): these by name); metrics.path: the name of the path that ran
    (rapo_fast.loss.path_plan.Path; the "rapo_fast" logger names it at debug level); metrics.token_logp: the per-token
    log-probs the loss used, detached, in the targets' shape.
    Raises ValueError / TypeError naming the argument before any kernel runs, except for a token in the loss whose
    logits row has no finite log-sum-exp (NaN, +inf, only -inf): refused from the log-prob pass's output, before the
    policy op and any backward (docs/loss.md section 3). While tracing under torch.compile the checks that read tensor
    values are skipped (docs/loss.md section 6, "Under torch.compile"); the call compiles with fullgraph=True.
    """
    opts = LossOptions.from_call(options, option_kwargs, caller="rapo_loss")
    check_inplace_backward(inplace_backward, logits)
    weight, bias = head_in_hidden_dtype(hidden, weight, bias)  # autocast: cast to hidden's dtype, with grad
    a = LossInputs.checked("rapo_loss", opts, locals())  # the arguments as given (weight/bias cast)
    want_ent = opts.entropy_coef != 0.0 or opts.return_metrics
    plan = _plan(a, backend, want_ent)
    if _use_fused(plan):
        return _loss_from_logp(a, None, None, plan, plan.path, fused=True)
    lp_in = LogprobInputs(
        logits=a.logits,
        hidden=a.hidden,
        weight=a.weight,
        bias=a.bias,
        targets=a.targets,
        vocab=a.facts.vocab,
        temperature=float(opts.temperature),
        entropy=want_ent,
        inplace_backward=inplace_backward,
    )
    out, path, _ = _run_logprobs(lp_in, plan)  # checked and planned here: not token_logprobs' front desk again
    logp, ent = out if want_ent else (out, None)
    return _loss_from_logp(a, logp, ent, plan, path)


@with_option_keywords(exclude=("temperature",))
def policy_loss_from_logp(
    logp: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    retrieved_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    behav_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    options: LossOptions | None = None,
    backend: str = "auto",
    **option_kwargs: Any,
):
    """rapo_loss from log-probs that are already computed (e.g. verl's policy-loss registry hands them over).

    logp: float [B, T] or [N] (with cu_seqlens), differentiable; entropy: like logp, required when entropy_coef != 0
    (else only the entropy metric uses it; 0 without it). Every other argument, the validation and the return value
    are rapo_loss's; no temperature (it is in logp already: an `options` with temperature != 1 is refused). The
    per-token policy op runs on [N] vectors (Triton on CUDA / under TRITON_INTERPRET=1, the reference's per-token
    function otherwise; backend: "auto", "triton" (path "triton_policy"), "torch" or "reference" (both
    "torch_policy")).
    """
    opts = LossOptions.from_call(options, option_kwargs, caller="policy_loss_from_logp", exclude=("temperature",))
    if opts.temperature != 1.0:
        raise ValueError(
            f"options.temperature: expected 1.0 with policy_loss_from_logp (logp is taken at its temperature "
            f"already), got {opts.temperature}"
        )
    a = LossInputs.checked("policy_loss_from_logp", opts, locals())
    plan = plan_path(
        "policy_loss_from_logp",
        backend,
        device=logp.device,
        dtype=logp.dtype,
        auto_triton=use_triton(logp.device) if backend == "auto" else None,
    )
    return _loss_from_logp(a, logp, entropy, plan, plan.path)


@dataclass
class _Tokens:
    """rapo_loss's per-token inputs as [N] vectors in the compute dtype `cd`, the token classes (on-policy, trained
    off-policy, active = in the loss, retrieved, response) and each token's segment (row, or cu_seqlens segment)."""

    cd: torch.dtype
    device: torch.device
    facts: InputFacts
    lp: torch.Tensor | None  # None on the fused path: the log-probs are formed inside the fused op
    ent: torch.Tensor | None
    old: torch.Tensor
    behav: torch.Tensor | None
    ref: torch.Tensor | None
    on: torch.Tensor
    off: torch.Tensor
    act: torch.Tensor
    ret: torch.Tensor
    resp: torch.Tensor
    seg: torch.Tensor

    def seg_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-segment sum [S] of a per-token vector, in the compute dtype."""
        f = self.facts
        if not f.flat:  # rows: a plain (deterministic) row sum; index_add_ is atomic on CUDA
            return x.to(self.cd).view(f.rows, f.shape[1]).sum(1)
        return torch.zeros(f.rows, dtype=self.cd, device=self.device).index_add_(0, self.seg, x.to(self.cd))


def _tokens(a: LossInputs, logp: torch.Tensor | None, ent: torch.Tensor | None, fused: bool) -> _Tokens:
    opts, facts = a.opts, a.facts
    n = math.prod(facts.shape)
    if fused:
        lp, cd, dev = None, torch.float32, a.hidden.device
    else:
        if ent is not None and opts.entropy_coef == 0.0:
            ent = ent.detach()  # for the metric only: no backward through the entropy
        cd = torch.float64 if logp.dtype == torch.float64 else torch.float32
        dev = logp.device
        lp = logp.reshape(n).to(cd)

    def vec(x):
        return None if x is None else x.reshape(n).to(cd).contiguous()

    lm = a.loss_mask.reshape(n) != 0
    ret = a.retrieved_mask.reshape(n) != 0 if a.retrieved_mask is not None else torch.zeros_like(lm)
    resp = a.response_mask.reshape(n) != 0 if a.response_mask is not None else torch.ones_like(lm)
    on = lm & ~ret
    off = lm & ret if opts.offpolicy_train != "none" else torch.zeros_like(lm)
    # segment id of each token; padded rows are segments of length T
    cu = a.cu_seqlens
    if facts.flat and cu is not None:
        seg = torch.searchsorted(cu[1:].to(torch.int64), torch.arange(n, device=dev), right=True)
    elif facts.flat:
        seg = torch.zeros(n, dtype=torch.int64, device=dev)
    else:
        seg = torch.arange(n, device=dev) // facts.shape[1]
    return _Tokens(
        cd=cd,
        device=dev,
        facts=facts,
        lp=lp,
        ent=vec(ent),
        old=vec(a.old_logp),
        behav=vec(a.behav_logp),
        ref=vec(a.ref_logp),
        on=on,
        off=off,
        act=on | off,
        ret=ret,
        resp=resp,
        seg=seg,
    )


def _sequence_terms(t: _Tokens, opts: LossOptions, advantages: torch.Tensor):
    """Per-token gathers of per-sequence quantities: shaping scale 1 + m F_s, GSPO's sequence log-ratio (or None),
    and the advantage."""
    frac = t.seg_sum(t.ret) / t.seg_sum(t.resp).clamp_min(1)
    scale = (1.0 + opts.shaping_m * frac)[t.seg].contiguous()
    seqlr = None
    if opts.importance_sampling_level == "sequence":
        lr = torch.where(t.on, t.lp.detach() - t.old, torch.zeros_like(t.lp))
        seqlr = (t.seg_sum(lr) / t.seg_sum(t.on).clamp_min(1))[t.seg].contiguous()
    adv = advantages.to(t.cd)
    adv = (adv.reshape(-1) if tuple(advantages.shape) == t.facts.shape else adv[t.seg]).contiguous()
    return scale, seqlr, adv


def _agg_weights(t: _Tokens, loss_agg: str, global_num_tokens) -> torch.Tensor:
    """The aggregation weight of each token (no gradient: counts only); docs/loss.md section 4."""
    cd, dev = t.cd, t.device
    g = None if global_num_tokens is None else torch.as_tensor(global_num_tokens, dtype=cd).to(dev).reshape(())
    actf = t.act.to(cd)
    if loss_agg == "token-mean":
        w = actf / (g if g is not None else actf.sum().clamp_min(1))
    elif loss_agg == "seq-mean-token-sum-norm":
        if g is None:  # K: T, or the longest segment counted on the device (no host sync: nothing breaks a trace)
            f = t.facts
            k = t.seg_sum(torch.ones_like(actf)).amax() if f.flat else torch.full((), f.shape[1], dtype=cd, device=dev)
        w = actf / (g if g is not None else k.clamp_min(1))
    else:
        n_act = t.seg_sum(t.act)
        denom = g if g is not None else (n_act > 0).sum().clamp_min(1).to(cd)
        w = actf / denom
        if loss_agg == "seq-mean-token-mean":
            w = w / n_act.clamp_min(1)[t.seg]
    return w.contiguous()


def _loss_from_logp(
    a: LossInputs, logp: torch.Tensor | None, ent: torch.Tensor | None, plan: PathPlan, path: Path, fused: bool = False
):
    """Everything of rapo_loss after the log-probs: per-sequence quantities, aggregation weights, the policy op (Triton
    when `plan` is a Triton path, else torch; or, with fused=True and logp None, the fused hidden-state op) and the
    metrics, which name `path`, the path that ran. `a`: the call's checked inputs."""
    opts = a.opts
    t = _tokens(a, logp, ent, fused)
    scale, seqlr, adv = _sequence_terms(t, opts, a.advantages)
    w = _agg_weights(t, opts.loss_agg, a.global_num_tokens)
    code = t.on.to(t.cd) * int(TokenCode.ON) + t.off.to(t.cd) * int(TokenCode.OFF)
    behav = t.behav if (opts.tis_cap is not None or opts.offpolicy_train == "truncated") else None
    tok, present = stack_token_inputs(
        old=t.old, adv=adv, w=w, scale=scale, code=code, seqlr=seqlr, behav=behav, ref=t.ref
    )
    scalars = opts.kernel_scalars()
    if fused:
        loss, sums, lp = fused_linear_policy_loss(
            a.hidden,
            a.weight,
            a.bias,
            a.targets,
            tok,
            present,
            scalars,
            float(opts.temperature),
            opts.entropy_coef != 0.0 or opts.return_metrics,
            opts.entropy_coef != 0.0,
        )
    else:
        if a.hidden is not None:
            check_loss_logp_defined(torch.isnan(t.lp) & (code != 0))
        elif a.logits is not None:
            check_logits_rows_defined(t.lp, a.loss_mask, a.logits)
        # fp64 (a checking precision) and devices without Triton: the same math in torch, differentiated by autograd
        if plan.path.triton and t.cd == torch.float32:
            tok_loss, sums = policy_loss_op(t.lp.contiguous(), t.ent, tok, present, scalars)
        else:
            tok_loss, sums = torch_policy_loss(t.lp.contiguous(), t.ent, tok, present, opts)
        loss = tok_loss.sum()
        lp = t.lp
    log_path(a.entry, path, plan.reason)
    return (loss, _metrics(sums, t, opts, path, lp)) if opts.return_metrics else loss


@dataclass(frozen=True)
class LossMetrics:
    """rapo_loss's metrics (docs/loss.md section 5): twelve 0-dim detached tensors, `path`, the name of the path that
    ran (rapo_fast.loss.path_plan.Path), and `token_logp`, the per-token log-probs the loss used (detached; the targets'
    shape; fp32, fp64 for fp64 input). `scalars()` gives the twelve by name, for logging loops."""

    clip_frac_high: torch.Tensor
    clip_frac_low: torch.Tensor
    dual_clip_frac: torch.Tensor
    ratio_mean: torch.Tensor
    approx_kl: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    retrieved_frac: torch.Tensor
    tis_weight_mean: torch.Tensor
    offpolicy_weight_mean: torch.Tensor
    num_tokens: torch.Tensor
    num_offpolicy_tokens: torch.Tensor
    path: str
    token_logp: torch.Tensor

    def scalars(self) -> dict[str, torch.Tensor]:
        """The 0-dim metrics by name (every field but path and token_logp)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("path", "token_logp")}


def _metrics(sums: torch.Tensor, t: _Tokens, opts: LossOptions, path: Path, lp: torch.Tensor) -> LossMetrics:
    """The public metrics (docs/loss.md section 5) from the op's partial sums (rapo_fast/loss/policy_layout.py), and
    the path that ran."""
    cd = t.cd
    s = sums.detach().to(cd)
    n_on, n_off, n_act = (s[m].clamp_min(1) for m in (Metric.N_ON, Metric.N_OFF, Metric.N_ACTIVE))
    return LossMetrics(
        clip_frac_high=s[Metric.CLIP_HIGH] / n_on,
        clip_frac_low=s[Metric.CLIP_LOW] / n_on,
        dual_clip_frac=s[Metric.DUAL_CLIP] / n_on,
        ratio_mean=s[Metric.RATIO] / n_on,
        approx_kl=s[Metric.APPROX_KL] / n_on,
        kl=s[Metric.KL] / n_act,
        entropy=s[Metric.ENTROPY] / n_act,
        retrieved_frac=t.ret.sum().to(cd) / t.resp.sum().clamp_min(1).to(cd),
        tis_weight_mean=(
            s[Metric.TIS_WEIGHT] / n_on if opts.tis_cap is not None else torch.ones((), dtype=cd, device=t.device)
        ),
        offpolicy_weight_mean=s[Metric.OFFPOLICY_WEIGHT] / n_off,
        num_tokens=s[Metric.N_ACTIVE],
        num_offpolicy_tokens=s[Metric.N_OFF],
        path=path.value,
        token_logp=lp.detach().reshape(t.facts.shape),
    )


class RAPOLoss(nn.Module):
    """nn.Module form of rapo_loss: options (and `preset`, a name in rapo_fast.loss.presets or a dict) fixed at
    construction as a LossOptions (`self.loss_options`; `self.options` is a read-only dict view), explicit keyword
    options overriding the preset; forward(logits=None, *, hidden, weight, bias, targets, old_logp, advantages,
    loss_mask, retrieved_mask, response_mask, behav_logp, ref_logp, cu_seqlens, global_num_tokens,
    inplace_backward, return_metrics=None) takes the tensors and returns what rapo_loss returns."""

    def __init__(self, preset: str | dict | None = None, **options: Any):
        super().__init__()
        unknown = sorted(set(options) - set(LossOptions.names()))
        if unknown:
            raise TypeError(
                f"RAPOLoss: expected options among {sorted(LossOptions.names())}, got unknown option(s) {unknown}"
            )
        base = P.get(preset) if preset is not None else None
        self.loss_options = LossOptions.from_call(base, options, caller="RAPOLoss")

    @property
    def options(self) -> MappingProxyType:
        return MappingProxyType(self.loss_options.to_dict())

    def forward(self, logits: torch.Tensor | None = None, *, return_metrics: bool | None = None, **tensors):
        bad = sorted(set(tensors) & set(LossOptions.names()))
        if bad:
            raise TypeError(
                f"RAPOLoss.forward: expected tensor arguments (options go to RAPOLoss()), got constructor options {bad}"
            )
        opts = self.loss_options
        if return_metrics is not None:
            opts = opts.replace(return_metrics=return_metrics)
        return rapo_loss(logits, **tensors, options=opts)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.loss_options.overrides().items())
