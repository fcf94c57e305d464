"""The per-token policy-loss op `rapo_fast::policy_loss` (backward: `rapo_fast::policy_loss_bwd`): the launchers of
kernels/loss/policy_loss.py, their torch fallback, the op's fake and its autograd formula.

What this is: elementwise work over N tokens. The inputs are [N] vectors that rapo_fast/loss/policy_loss.py prepares
(log-probs, old / behaviour / reference log-probs, advantage, aggregation weight w, shaping scale, token code, GSPO
sequence log-ratio, entropy) and the options as `KernelScalars`; the outputs are the weighted token losses w_t l_t and
the metric partial sums (layout: rapo_fast/loss/policy_layout.py); the backward gives dL/dlogp and dL/dH times the
upstream gradient. rapo_fast/loss/fused_linear.py calls `policy_loss_fwd` / `policy_loss_bwd` tile by tile.
On devices without Triton the same math runs through the reference's per-token function (`torch_policy_loss`).
What this is not: the per-sequence quantities or the aggregation weights (rapo_fast/loss/policy_loss.py), nor the
spec (rapo_fast/reference/policy_loss.py: policy_token_loss_ref; formulas in docs/loss.md section 3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from rapo_fast._dispatch import device_guard, register_op, use_triton
from rapo_fast.loss.options import LossOptions
from rapo_fast.loss.policy_layout import NUM_METRICS, KLMode, Metric, OffMode, TokenCode
from rapo_fast.reference.policy_loss import policy_token_loss_ref

__all__ = ["KernelScalars", "policy_loss_op", "policy_loss_fwd", "policy_loss_bwd", "torch_policy_loss"]

_BLOCK = 1024  # tokens per program of the elementwise kernels
# kl_estimator of each KL mode (NONE: any estimator, its KL is not computed)
_KL_NAMES = {KLMode.NONE: "k1", KLMode.K1: "k1", KLMode.K2: "k2", KLMode.K3: "k3", KLMode.K3_UNCLAMPED: "k3"}


class KernelScalars(NamedTuple):
    """The options as the kernels take them (fp32 scalars and two mode codes). Its field order is the registered
    ops' order of scalar arguments, so `*scalars` passes them to an op; `kernel_args()` names them for a launch."""

    eps_low: float
    eps_high: float
    dual_c: float  # dual_clip, 0 = none
    gamma: float
    is_cap: float
    tis_cap: float  # 0 = no truncated IS
    beta: float
    ent_coef: float
    off_mode: int  # OffMode
    kl_mode: int  # KLMode (NONE without ref_logp)

    @classmethod
    def of(cls, opts: LossOptions, with_ref: bool) -> KernelScalars:
        """The kernels' scalars of `opts`; with_ref: ref_logp is given (and used: its KL term or metric)."""
        kl_mode = KLMode[opts.kl_estimator.upper()] if with_ref else KLMode.NONE
        if kl_mode == KLMode.K3 and not opts.kl_clamp:
            kl_mode = KLMode.K3_UNCLAMPED
        return cls(
            eps_low=float(opts.eps_low), eps_high=float(opts.eps_high), dual_c=float(opts.dual_clip or 0.0),
            gamma=float(opts.gamma), is_cap=float(opts.is_cap), tis_cap=float(opts.tis_cap or 0.0),
            beta=float(opts.beta), ent_coef=float(opts.entropy_coef),
            off_mode=int(OffMode[opts.offpolicy_train.upper()]), kl_mode=int(kl_mode),
        )  # fmt: skip

    def kernel_args(self) -> dict[str, Any]:
        """Keyword arguments of a policy-loss kernel launch: the runtime scalars and the mode constexprs."""
        return dict(
            eps_low=self.eps_low, eps_high=self.eps_high, dual_c=self.dual_c, gamma=self.gamma, is_cap=self.is_cap,
            tis_cap=self.tis_cap, beta=self.beta, ent_coef=self.ent_coef,
            DUAL=self.dual_c > 0, TIS=self.tis_cap > 0, OFF=self.off_mode, KL=self.kl_mode,
        )  # fmt: skip

    def reference_options(self) -> dict[str, Any]:
        """The per-token options of policy_token_loss_ref that these scalars encode."""
        return dict(
            offpolicy_train=OffMode(self.off_mode).name.lower(), gamma=self.gamma, is_cap=self.is_cap,
            tis_cap=self.tis_cap if self.tis_cap > 0 else None, eps_low=self.eps_low, eps_high=self.eps_high,
            dual_clip=self.dual_c if self.dual_c > 0 else None, beta=self.beta,
            kl_estimator=_KL_NAMES[KLMode(self.kl_mode)], kl_clamp=self.kl_mode != KLMode.K3_UNCLAMPED,
            entropy_coef=self.ent_coef,
        )  # fmt: skip


def _kernels():
    # lazy: `import rapo_fast.loss.policy_loss` must not need triton
    from rapo_fast.kernels.loss import policy_loss as K

    return K


# ------------------------------------------------------------------------------------------------ torch fallback
def torch_policy_loss(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
    code: torch.Tensor, seqlr: torch.Tensor | None, behav: torch.Tensor | None, ref: torch.Tensor | None,
    ent: torch.Tensor | None, s: KernelScalars,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The op's math in torch (the reference's per-token function): weighted token losses and the metric sums.
    Differentiable by autograd; the fallback of rapo_loss and of the registered op on devices without Triton."""
    on, off = code == int(TokenCode.ON), code == int(TokenCode.OFF)
    act = on | off
    tok, terms = policy_token_loss_ref(
        logp,
        old,
        adv,
        on_mask=on,
        off_mask=off,
        ratio_scale=scale,
        seq_log_ratio=seqlr,
        behav_logp=behav,
        ref_logp=ref,
        entropy=ent,
        **s.reference_options(),
    )
    z = torch.zeros_like(logp).detach()

    def msum(x, m):
        return torch.where(m, x.to(z.dtype), z).sum()

    sums = {
        Metric.N_ON: on.sum().to(z.dtype),
        Metric.N_OFF: off.sum().to(z.dtype),
        Metric.N_ACTIVE: act.sum().to(z.dtype),
        Metric.CLIP_HIGH: msum(terms["clipped_high"], on),
        Metric.CLIP_LOW: msum(terms["clipped_low"], on),
        Metric.DUAL_CLIP: msum(terms["dual_clipped"], on),
        Metric.RATIO: msum(terms["ratio"], on),
        Metric.APPROX_KL: msum(terms["approx_kl"], on),
        Metric.KL: msum(terms["kl"], act) if s.kl_mode else z.sum(),
        Metric.ENTROPY: msum(ent.detach(), act) if ent is not None else z.sum(),
        Metric.TIS_WEIGHT: msum(terms["tis_weight"], on) if s.tis_cap > 0 else z.sum(),
        Metric.OFFPOLICY_WEIGHT: msum(terms["offpolicy_weight"], off) if s.off_mode else z.sum(),
    }
    return tok * w, torch.stack([sums[m] for m in Metric])


# ------------------------------------------------------------------------------------------------ op: forward
def policy_loss_fwd(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
    code: torch.Tensor, seqlr: torch.Tensor | None, behav: torch.Tensor | None, ref: torch.Tensor | None,
    ent: torch.Tensor | None, eps_low: float, eps_high: float, dual_c: float, gamma: float, is_cap: float,
    tis_cap: float, beta: float, ent_coef: float, off_mode: int, kl_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(w * token loss [N], metric sums [NUM_METRICS] fp32): the implementation of rapo_fast::policy_loss."""
    s = KernelScalars(eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef, off_mode, kl_mode)
    if not use_triton(logp.device):
        with torch.no_grad():
            tok, sums = torch_policy_loss(logp, old, adv, w, scale, code, seqlr, behav, ref, ent, s)
        return tok.to(logp.dtype), sums.to(torch.float32)
    n = logp.numel()
    out = torch.empty_like(logp)
    nb = max(1, -(-n // _BLOCK))
    part = torch.zeros((nb, NUM_METRICS), dtype=torch.float32, device=logp.device)
    if n > 0:
        with device_guard(logp):
            _kernels().policy_loss_fwd_kernel[(nb,)](
                logp_ptr=logp, old_ptr=old, adv_ptr=adv, w_ptr=w, scale_ptr=scale, code_ptr=code,
                seqlr_ptr=_or(seqlr, logp), behav_ptr=_or(behav, logp), ref_ptr=_or(ref, logp), ent_ptr=_or(ent, logp),
                out_ptr=out, part_ptr=part, N=n, **s.kernel_args(),
                SEQ=seqlr is not None, HAS_ENT=ent is not None, BLOCK=_BLOCK,
            )  # fmt: skip
    return out, part.sum(0)


def _or(x: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """An optional kernel input, or a stand-in pointer that the kernel never reads (its constexpr says so)."""
    return stand_in if x is None else x


def _policy_loss_fake(logp, old, adv, w, scale, code, seqlr, behav, ref, ent, *args):
    return torch.empty_like(logp), logp.new_empty((NUM_METRICS,))


# ------------------------------------------------------------------------------------------------ op: backward
def policy_loss_bwd(
    grad: torch.Tensor, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, w: torch.Tensor,
    scale: torch.Tensor, code: torch.Tensor, seqlr: torch.Tensor | None, behav: torch.Tensor | None,
    ref: torch.Tensor | None, has_ent: bool, eps_low: float, eps_high: float, dual_c: float, gamma: float,
    is_cap: float, tis_cap: float, beta: float, ent_coef: float, off_mode: int, kl_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dL/dlogp, dL/dH, or a [0] tensor without entropy) times the per-token upstream gradient `grad`."""
    s = KernelScalars(eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef, off_mode, kl_mode)
    if not use_triton(logp.device):
        # autograd is off inside a custom op's implementation; torch.func.vjp still differentiates (the loss is
        # linear in H, so any entropy value gives its gradient)
        def tok_of(lp, ent):
            return torch_policy_loss(lp, old, adv, w, scale, code, seqlr, behav, ref, ent if has_ent else None, s)[0]

        _, vjp = torch.func.vjp(tok_of, logp.detach(), torch.zeros_like(logp))
        dlogp, dent = vjp(grad.to(logp.dtype))
        return dlogp, (dent if has_ent else logp.new_empty((0,)))
    n = logp.numel()
    dlogp = torch.empty_like(logp)
    dent = torch.empty_like(logp) if has_ent else logp.new_empty((0,))
    if n > 0:
        with device_guard(logp):
            _kernels().policy_loss_bwd_kernel[(max(1, -(-n // _BLOCK)),)](
                grad_ptr=grad.contiguous(), logp_ptr=logp, old_ptr=old, adv_ptr=adv, w_ptr=w, scale_ptr=scale,
                code_ptr=code, seqlr_ptr=_or(seqlr, logp), behav_ptr=_or(behav, logp), ref_ptr=_or(ref, logp),
                ent_ptr=logp, dlogp_ptr=dlogp, dent_ptr=dent if has_ent else dlogp, N=n, **s.kernel_args(),
                SEQ=seqlr is not None, HAS_ENT=has_ent, BLOCK=_BLOCK,
            )  # fmt: skip
    return dlogp, dent


def _policy_loss_bwd_fake(grad, logp, old, adv, w, scale, code, seqlr, behav, ref, has_ent, *args):
    return torch.empty_like(logp), (torch.empty_like(logp) if has_ent else logp.new_empty((0,)))


_policy_loss_bwd_op = register_op("policy_loss_bwd", policy_loss_bwd, fake=_policy_loss_bwd_fake)

_N_TENSORS = 10  # tensor inputs of rapo_fast::policy_loss (logp .. ent), before the KernelScalars


def _setup_context(ctx, inputs, output):
    logp, old, adv, w, scale, code, seqlr, behav, ref, ent = inputs[:_N_TENSORS]
    ctx.save_for_backward(logp, old, adv, w, scale, code, seqlr, behav, ref)
    ctx.has_ent = ent is not None
    ctx.scalars = inputs[_N_TENSORS:]


def _backward(ctx, g_out, g_part):
    logp, old, adv, w, scale, code, seqlr, behav, ref = ctx.saved_tensors
    dlogp, dent = _policy_loss_bwd_op(
        g_out, logp, old, adv, w, scale, code, seqlr, behav, ref, ctx.has_ent, *ctx.scalars
    )
    grads = [None] * (_N_TENSORS + len(KernelScalars._fields))
    grads[0] = dlogp
    grads[_N_TENSORS - 1] = dent if ctx.has_ent else None
    return tuple(grads)


policy_loss_op = register_op(
    "policy_loss", policy_loss_fwd, fake=_policy_loss_fake, backward=_backward, setup_context=_setup_context
)
