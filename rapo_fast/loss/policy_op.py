"""The per-token policy-loss op `rapo_fast::policy_loss` (backward: `rapo_fast::policy_loss_bwd`): the launchers of
rapo_fast/kernels/loss/policy_loss.py, their torch fallback, the op's fake and its autograd formula.

What this is: elementwise work over N tokens; the per-token inputs come stacked with a presence mask
(stack_token_inputs) and the options as one small tensor (LossOptions.kernel_scalars()). Nothing here names an
option: adding one touches LossOptions, the kernels and the reference only.
What this is not: the per-sequence quantities (rapo_fast/loss/policy_loss.py) or the spec
(rapo_fast/reference/policy_loss.py: policy_token_loss_ref; docs/loss.md section 3).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping
from typing import Any

import torch

from rapo_fast._dispatch import device_guard, register_op, use_triton
from rapo_fast.kernels.loss.policy_layout import NUM_INPUTS, NUM_METRICS, REQUIRED_INPUTS, Metric, TokenCode, TokenInput
from rapo_fast.loss.options import LossOptions
from rapo_fast.reference.policy_loss import policy_token_loss_ref

__all__ = [
    "stack_token_inputs",
    "policy_loss_op",
    "policy_loss_fwd",
    "policy_loss_bwd",
    "torch_policy_loss",
    "KernelOptions",
    "kernel_options",
]

_BLOCK = 1024  # tokens per program of the elementwise kernels
# the kernels' one options argument: a named tuple whose fields are LossOptions' kernel options, in their order
KernelOptions = namedtuple("KernelOptions", LossOptions.kernel_names())


def stack_token_inputs(**rows: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The op's per-token inputs as one [NUM_INPUTS, N] tensor and its presence mask (bit `1 << row` set for each row
    given). `rows`: one [N] tensor per TokenInput member, by its lower-case name (old, adv, w, scale, code, seqlr,
    behav, ref), None for an optional row not given (left unset: never read). Dtype and device: the old row's."""
    unknown = sorted(set(rows) - {m.name.lower() for m in TokenInput})
    if unknown:
        raise TypeError(
            f"stack_token_inputs: expected rows among {[m.name.lower() for m in TokenInput]}, got {unknown}"
        )
    old = rows["old"]
    tok = torch.empty((NUM_INPUTS, old.shape[0]), dtype=old.dtype, device=old.device)
    present = 0
    for m in TokenInput:
        x = rows.get(m.name.lower())
        if x is None:
            if m in REQUIRED_INPUTS:
                raise ValueError(f"stack_token_inputs: {m.name.lower()}: expected a tensor (a required row), got None")
            continue
        tok[m].copy_(x)
        present |= 1 << int(m)
    return tok, present


def _rows(tok: torch.Tensor, present: int) -> dict[str, torch.Tensor | None]:
    """The rows of a stacked input by lower-case TokenInput name, None where absent."""
    return {m.name.lower(): (tok[m] if present >> int(m) & 1 else None) for m in TokenInput}


def _kernels():
    # lazy: `import rapo_fast.loss.policy_loss` must not need triton
    from rapo_fast.kernels.loss import policy_loss as K

    return K


def torch_policy_loss(
    logp: torch.Tensor,
    ent: torch.Tensor | None,
    tok: torch.Tensor,
    present: int,
    options: LossOptions | Mapping[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's math in torch (the reference's per-token function): weighted token losses and the metric sums.
    Differentiable by autograd; the fallback of rapo_loss and of the registered op on devices without Triton.
    `options`: the call's checked LossOptions (read, not rebuilt), or the kernel options by name (kernel_options of
    the op's scalars): Python values, no tensor read on the host, so that the call traces whole under torch.compile."""
    r = _rows(tok, present)
    on, off = r["code"] == int(TokenCode.ON), r["code"] == int(TokenCode.OFF)
    act = on | off
    loss, terms = policy_token_loss_ref(
        logp,
        r["old"],
        r["adv"],
        on_mask=on,
        off_mask=off,
        ratio_scale=r["scale"],
        seq_log_ratio=r["seqlr"],
        behav_logp=r["behav"],
        ref_logp=r["ref"],
        entropy=ent,
        options=options,
    )
    z = torch.zeros_like(logp).detach()

    def msum(x, m):
        return torch.where(m, x.to(z.dtype), z).sum()

    # a term the reference did not compute (absent) sums to 0 (the kernel writes 1 per token for an unused TIS weight:
    # that metric is reported only when tis_cap is set)
    sums = {
        Metric.N_ON: on.sum().to(z.dtype),
        Metric.N_OFF: off.sum().to(z.dtype),
        Metric.N_ACTIVE: act.sum().to(z.dtype),
        Metric.CLIP_HIGH: msum(terms["clipped_high"], on),
        Metric.CLIP_LOW: msum(terms["clipped_low"], on),
        Metric.DUAL_CLIP: msum(terms["dual_clipped"], on),
        Metric.RATIO: msum(terms["ratio"], on),
        Metric.APPROX_KL: msum(terms["approx_kl"], on),
        Metric.KL: msum(terms["kl"], act) if "kl" in terms else z.sum(),
        Metric.ENTROPY: msum(ent.detach(), act) if ent is not None else z.sum(),
        Metric.TIS_WEIGHT: msum(terms["tis_weight"], on) if "tis_weight" in terms else z.sum(),
        Metric.OFFPOLICY_WEIGHT: msum(terms["offpolicy_weight"], off) if "offpolicy_weight" in terms else z.sum(),
    }
    return loss * r["w"], torch.stack([sums[m] for m in Metric])


def kernel_options(scalars: torch.Tensor) -> KernelOptions:
    """The kernels' `opts` from the op's scalars (LossOptions.kernel_kwargs): a choice or flag (int, bool) as a
    constexpr, so that the kernels branch on it at compile time; a real as a runtime scalar (no recompile per value)."""
    import triton.language as tl  # lazy: `import rapo_fast.loss.policy_loss` must not need triton

    kw = LossOptions.kernel_kwargs(scalars)
    return KernelOptions(**{k: v if isinstance(v, float) else tl.constexpr(v) for k, v in kw.items()})


def _launch_args(tok: torch.Tensor, present: int, scalars: torch.Tensor, n: int) -> dict:
    """The keyword arguments every policy-loss kernel launch shares: the stacked inputs and the options."""
    if tok.dim() != 2 or tok.shape[0] != NUM_INPUTS or tok.stride(1) != 1:
        raise ValueError(f"tok: expected [{NUM_INPUTS}, N] with contiguous rows, got {tuple(tok.shape)} {tok.stride()}")
    opts = kernel_options(scalars)
    return dict(tok_ptr=tok, tok_stride=tok.stride(0), N=n, opts=opts, PRESENT=present, BLOCK=_BLOCK)


def policy_loss_fwd(
    logp: torch.Tensor, ent: torch.Tensor | None, tok: torch.Tensor, present: int, scalars: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w * token loss [N], metric sums [NUM_METRICS] fp32): the implementation of rapo_fast::policy_loss."""
    if not use_triton(logp.device):
        with torch.no_grad():
            out, sums = torch_policy_loss(logp, ent, tok, present, LossOptions.kernel_options(scalars))
        return out.to(logp.dtype), sums.to(torch.float32)
    n = logp.numel()
    out = torch.empty_like(logp)
    nb = max(1, -(-n // _BLOCK))
    part = torch.zeros((nb, NUM_METRICS), dtype=torch.float32, device=logp.device)
    if n > 0:
        with device_guard(logp):
            _kernels().policy_loss_fwd_kernel[(nb,)](
                logp_ptr=logp,
                ent_ptr=logp if ent is None else ent,
                out_ptr=out,
                part_ptr=part,
                HAS_ENT=ent is not None,
                **_launch_args(tok, present, scalars, n),
            )
    return out, part.sum(0)


def _policy_loss_fake(logp, ent, tok, present, scalars):
    return torch.empty_like(logp), logp.new_empty((NUM_METRICS,))


def policy_loss_bwd(
    grad: torch.Tensor, logp: torch.Tensor, tok: torch.Tensor, present: int, scalars: torch.Tensor, has_ent: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dlogp, dL/dH, or a [0] tensor without entropy) times the per-token upstream gradient `grad`."""
    if not use_triton(logp.device):
        # autograd is off inside a custom op's implementation; torch.func.vjp still differentiates (the loss is
        # linear in H, so any entropy value gives its gradient)
        options = LossOptions.kernel_options(scalars)

        def tok_of(lp, ent):
            return torch_policy_loss(lp, ent if has_ent else None, tok, present, options)[0]

        _, vjp = torch.func.vjp(tok_of, logp.detach(), torch.zeros_like(logp))
        dlogp, dent = vjp(grad.to(logp.dtype))
        return dlogp, (dent if has_ent else logp.new_empty((0,)))
    n = logp.numel()
    dlogp = torch.empty_like(logp)
    dent = torch.empty_like(logp) if has_ent else logp.new_empty((0,))
    if n > 0:
        with device_guard(logp):
            _kernels().policy_loss_bwd_kernel[(max(1, -(-n // _BLOCK)),)](
                grad_ptr=grad.contiguous(),
                logp_ptr=logp,
                dlogp_ptr=dlogp,
                dent_ptr=dent if has_ent else dlogp,
                HAS_ENT=has_ent,
                **_launch_args(tok, present, scalars, n),
            )
    return dlogp, dent


def _policy_loss_bwd_fake(grad, logp, tok, present, scalars, has_ent):
    return torch.empty_like(logp), (torch.empty_like(logp) if has_ent else logp.new_empty((0,)))


_policy_loss_bwd_op = register_op("policy_loss_bwd", policy_loss_bwd, fake=_policy_loss_bwd_fake)


def _setup_context(ctx, inputs, output):
    logp, ent, tok, present, scalars = inputs
    ctx.save_for_backward(logp, tok, scalars)
    ctx.present, ctx.has_ent = present, ent is not None


def _backward(ctx, g_out, g_part):
    logp, tok, scalars = ctx.saved_tensors
    dlogp, dent = _policy_loss_bwd_op(g_out, logp, tok, ctx.present, scalars, ctx.has_ent)
    return dlogp, (dent if ctx.has_ent else None), None, None, None


policy_loss_op = register_op(
    "policy_loss", policy_loss_fwd, fake=_policy_loss_fake, backward=_backward, setup_context=_setup_context
)
