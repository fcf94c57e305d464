"""token_logprobs: the public fused per-token log-prob (+ full-vocabulary entropy), its launchers and autograd wiring.

What this is: token_logprobs' front desk (every check once, into one LogprobInputs), the runner of the path that
rapo_fast/loss/path_plan.py picks (shared with rapo_loss), the logits path's ops `rapo_fast::token_logprobs_{fwd,bwd}`
(the hidden-state path's are in linear_logprobs.py) and the chunked reference fallback. Paths, tiles and non-finite
rows: docs/loss.md section 2.
What this is not: the math (rapo_fast/kernels/triton_helpers.py, and the spec in rapo_fast/reference/logprobs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rapo_fast import _checks as C
from rapo_fast._dispatch import device_guard, register_op, use_triton
from rapo_fast.loss import tiles
from rapo_fast.loss.linear_logprobs import linear_token_logprobs_fwd
from rapo_fast.loss.options import TARGET_DTYPES
from rapo_fast.loss.path_plan import Path, PathPlan, log_path, plan_path
from rapo_fast.loss.torch_linear_ce import linear_logprobs_torch
from rapo_fast.reference.logprobs import linear_token_logprobs_ref, token_logprobs_ref

__all__ = ["token_logprobs", "TARGET_DTYPES", "check_inplace_backward", "head_in_hidden_dtype", "LogprobInputs"]


def _row_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows_inner, stride_outer, stride_inner) addressing the rows of a 2-D or 3-D, last-dim-contiguous tensor."""
    if x.dim() == 2:
        return max(1, x.shape[0]), 0, x.stride(0)
    return max(1, x.shape[1]), x.stride(0), x.stride(1)


def _lp_fwd_impl(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, inplace_backward: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """logits [N, V] or [B, T, V] (last dim contiguous), targets shaped like logits.shape[:-1] ->
    (logp, stats, entropy) fp32: logp and entropy shaped like targets (entropy is [0] when not with_entropy), stats
    [2, *targets.shape] the rows' (max m, log s) that the backward forms p from (docs/loss.md section 2).
    inplace_backward only tells the backward (_lp_backward) where to write the logits gradient."""
    shape = targets.shape
    n, v = targets.numel(), logits.shape[-1]
    dev = logits.device
    logp = torch.empty(shape, dtype=torch.float32, device=dev)
    stats = torch.empty((2, *shape), dtype=torch.float32, device=dev)
    ent = torch.empty(shape if with_entropy else (0,), dtype=torch.float32, device=dev)
    if n == 0:
        return logp, stats, ent
    rows_inner, s_outer, s_inner = _row_strides(logits)
    block, warps = tiles.launch_cfg(v)
    row_max, log_s = stats.view(2, n)
    # the whole row in one launch (INIT and FINAL): the online state needs no storage, stats stand in for it
    with device_guard(logits):
        tiles.logprob_kernels().token_logprobs_fwd_kernel[(n,)](
            z_ptr=logits,
            tgt_ptr=targets.reshape(-1),
            bias_ptr=logits,
            m_ptr=stats,
            s_ptr=stats,
            t_ptr=stats,
            zt_ptr=stats,
            logp_ptr=logp,
            row_max_ptr=row_max,
            log_s_ptr=log_s,
            ent_ptr=ent if with_entropy else stats,
            rows_inner=rows_inner,
            stride_outer=s_outer,
            stride_inner=s_inner,
            n_cols=v,
            v_start=0,
            inv_temp=1.0 / temperature,
            INIT=True,
            FINAL=True,
            HAS_BIAS=False,
            WITH_ENTROPY=with_entropy,
            BLOCK_V=block,
            num_warps=warps,
        )
    return logp, stats, ent


def _lp_fwd_fake(logits, targets, temperature, with_entropy, inplace_backward=False):
    shape = targets.shape
    sizes = (shape, (2, *shape), shape if with_entropy else (0,))
    return tuple(logits.new_empty(m, dtype=torch.float32) for m in sizes)


def _lp_bwd_launch(
    logits: Tensor,
    grad: Tensor,
    stride_gz: int,
    targets: Tensor,
    stats: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    with_entropy: bool,
) -> None:
    """The backward kernel over every row: grad row r at grad + r * stride_gz (grad may be logits itself)."""
    n, v = targets.numel(), logits.shape[-1]
    if n == 0:
        return
    rows_inner, s_outer, s_inner = _row_strides(logits)
    block, warps = tiles.launch_cfg(v)
    g_lp = grad_logp.reshape(-1).to(torch.float32).contiguous()
    g_ent = grad_entropy.reshape(-1).to(torch.float32).contiguous() if with_entropy else g_lp
    row_max, log_s = stats.reshape(2, n)
    with device_guard(logits):
        tiles.logprob_kernels().token_logprobs_bwd_kernel[(n,)](
            z_ptr=logits,
            gz_ptr=grad,
            tgt_ptr=targets.reshape(-1),
            bias_ptr=logits,
            row_max_ptr=row_max,
            log_s_ptr=log_s,
            ent_ptr=entropy.reshape(-1) if with_entropy else g_lp,
            glp_ptr=g_lp,
            gent_ptr=g_ent,
            rows_inner=rows_inner,
            stride_outer=s_outer,
            stride_inner=s_inner,
            stride_gz=stride_gz,
            n_cols=v,
            v_start=0,
            inv_temp=1.0 / temperature,
            HAS_BIAS=False,
            WITH_ENTROPY=with_entropy,
            BLOCK_V=block,
            num_warps=warps,
        )


def _lp_bwd_impl(
    logits: Tensor,
    targets: Tensor,
    stats: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    with_entropy: bool,
) -> Tensor:
    """grad_logits (contiguous, logits' dtype and shape) from the upstream fp32 grads of logp and entropy."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _lp_bwd_launch(
        logits, grad, logits.shape[-1], targets, stats, entropy, grad_logp, grad_entropy, temperature, with_entropy
    )
    return grad


def _rows_evenly_spaced(x: Tensor) -> bool:
    """Whether row r of x (2-D, or 3-D flattened to rows) starts at r * x.stride(-2): the in-place backward's
    addressing of the gradient (true of a contiguous tensor and of any 2-D one; not of logits[:, :-1])."""
    if x.dim() == 2 or x.shape[0] <= 1:
        return True
    rows_inner, s_outer, s_inner = _row_strides(x)
    return s_outer == rows_inner * s_inner


def _lp_bwd_inplace_impl(
    logits: Tensor,
    targets: Tensor,
    stats: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    with_entropy: bool,
) -> None:
    """_lp_bwd_impl writing grad_logits over logits itself (rows evenly spaced: _rows_evenly_spaced)."""
    _lp_bwd_launch(
        logits, logits, logits.stride(-2), targets, stats, entropy, grad_logp, grad_entropy, temperature, with_entropy
    )


def _lp_bwd_inplace_fake(logits, targets, stats, entropy, grad_logp, grad_entropy, temperature, with_entropy):
    return None


def _lp_bwd_fake(logits, targets, stats, entropy, grad_logp, grad_entropy, temperature, with_entropy):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


_token_logprobs_bwd = register_op("token_logprobs_bwd", _lp_bwd_impl, fake=_lp_bwd_fake)
_token_logprobs_bwd_inplace = register_op(
    "token_logprobs_bwd_inplace", _lp_bwd_inplace_impl, mutates_args=("logits",), fake=_lp_bwd_inplace_fake
)


def _lp_setup_context(ctx, inputs, output):
    logits, targets, temperature, with_entropy = inputs[:4]
    _, stats, ent = output
    ctx.save_for_backward(logits, targets, stats, ent)
    ctx.temperature, ctx.with_entropy = temperature, with_entropy
    # in place only where the gradient can take the logits' storage: evenly spaced rows (else the kernel's gradient
    # addressing does not fit), and not a leaf (its .grad must be a tensor of its own: AccumulateGrad would copy)
    ctx.inplace = len(inputs) > 4 and bool(inputs[4]) and _rows_evenly_spaced(logits) and not logits.is_leaf


def _lp_backward(ctx, g_logp, g_stats, g_ent):
    # g_stats is ignored: stats is an internal output of the op and never leaves token_logprobs.
    logits, targets, stats, ent = ctx.saved_tensors
    if g_logp is None:
        g_logp = torch.zeros_like(stats[0])
    with_ent = ctx.with_entropy and g_ent is not None
    args = (targets, stats, ent, g_logp, g_ent if with_ent else g_logp, ctx.temperature, with_ent)
    if ctx.inplace:
        # inplace_backward=True: the gradient overwrites the logits (the caller said they are not needed again);
        # this bumps their version counter, so any other use of them saved for backward fails loudly in its own
        # backward rather than reading a gradient as logits
        _token_logprobs_bwd_inplace(logits, *args)
        return logits, None, None, None, None
    return _token_logprobs_bwd(logits, *args), None, None, None, None


_token_logprobs_fwd = register_op(
    "token_logprobs_fwd", _lp_fwd_impl, fake=_lp_fwd_fake, backward=_lp_backward, setup_context=_lp_setup_context
)


# fp32 temporaries of one fallback chunk (the reference holds a handful of [rows, V] fp32 tensors per chunk).
_FALLBACK_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class LogprobInputs:
    """One call's checked log-prob inputs, as the runners take them: exactly one of logits or hidden (+ weight, bias,
    already cast to hidden's dtype under autocast), targets in [0, vocab), the temperature as a float, whether entropy
    is wanted and whether the logits gradient may overwrite the logits. Built once per public call, by
    token_logprobs' front desk (_logprob_inputs) or by rapo_loss's (which checks the same tensors its own way)."""

    logits: Tensor | None
    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    targets: Tensor
    vocab: int
    temperature: float
    entropy: bool
    inplace_backward: bool = False

    @property
    def x(self) -> Tensor:
        """The model-side input: logits, or hidden."""
        return self.logits if self.logits is not None else self.hidden


def _validate(logits, hidden, weight, bias, targets, temperature, return_entropy) -> int:
    """Checks every argument before any kernel runs (the tensors: rapo_fast/_checks.py, shared with rapo_loss);
    returns V."""
    if (logits is None) == (hidden is None):  # first, as the tensor checks would say it
        C.check_model_inputs(logits, hidden, weight, bias, targets, float_dtypes=C.KERNEL_FLOAT_DTYPES)
    C.check_bool("return_entropy", return_entropy)
    C.check_float("temperature", temperature, min_value=0.0, min_inclusive=False)
    v = C.check_model_inputs(logits, hidden, weight, bias, targets, float_dtypes=C.KERNEL_FLOAT_DTYPES)
    C.check_index_range("targets", targets, v)
    return v


def head_in_hidden_dtype(
    hidden: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias) for the hidden-state path: cast to hidden's dtype when autocast is on for hidden's device type
    and their float dtype differs, else returned as given (a mismatch outside autocast is refused by the checks).

    Why: under `torch.autocast(dtype=bfloat16)` a model's lm_head weight stays fp32 while activations may be bf16, and
    `lm_head(h)` itself would compute in the low precision; `rapo_loss(hidden=h, weight=model.lm_head.weight)` is
    what users write there. The cast is a differentiable `.to`: the gradient reaches the given weight (and bias) in
    their own dtype. The kernels themselves run outside autocast's casting rules, so this is the only cast.
    """
    if not (isinstance(hidden, torch.Tensor) and hidden.dtype in C.FLOAT_DTYPES):
        return weight, bias
    if not torch.is_autocast_enabled(hidden.device.type):
        return weight, bias

    def cast(t):
        if isinstance(t, torch.Tensor) and t.dtype in C.FLOAT_DTYPES and t.dtype != hidden.dtype:
            return t.to(hidden.dtype)
        return t

    return cast(weight), cast(bias)


def check_inplace_backward(inplace_backward, logits: Tensor | None) -> None:
    """token_logprobs' / rapo_loss's inplace_backward: a bool, True only with logits= (the hidden-state paths never
    hold a logits gradient of [N, V] to save)."""
    if C.check_bool("inplace_backward", inplace_backward) and logits is None:
        raise ValueError("inplace_backward: expected False with hidden= (that path has no [N, V] gradient), got True")


def _logprob_inputs(
    logits, hidden, weight, bias, targets, temperature, return_entropy, inplace_backward, return_path
) -> LogprobInputs:
    """token_logprobs' front desk: the autocast cast of the head, every check, once; the inputs the runners take."""
    weight, bias = head_in_hidden_dtype(hidden, weight, bias)  # under autocast: cast to hidden's dtype, with grad
    vocab = _validate(logits, hidden, weight, bias, targets, temperature, return_entropy)
    check_inplace_backward(inplace_backward, logits)
    C.check_bool("return_path", return_path)
    return LogprobInputs(
        logits=logits,
        hidden=hidden,
        weight=weight,
        bias=bias,
        targets=targets,
        vocab=vocab,
        temperature=float(temperature),
        entropy=return_entropy,
        inplace_backward=inplace_backward,
    )


def _row_slices(x: torch.Tensor, rows: int):
    """Yield views of at most `rows` rows of x ([N, D] or [B, T, D]) in flattened row order, without copying."""
    if x.dim() == 2:
        for r0 in range(0, x.shape[0], rows):
            yield x[r0 : r0 + rows]
    else:
        for b in range(x.shape[0]):
            yield from _row_slices(x[b], rows)


def _reference_chunked(inp: LogprobInputs):
    """The reference over row chunks, each under torch.utils.checkpoint, so that neither forward nor backward holds
    more than one chunk of [rows, V] fp32 temporaries (the CPU path without Triton); in one piece while tracing under
    torch.compile."""
    logits, weight, bias, targets = inp.logits, inp.weight, inp.bias, inp.targets
    temperature, return_entropy, x = inp.temperature, inp.entropy, inp.x
    rows = max(1, _FALLBACK_BYTES // (4 * inp.vocab))
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if weight is not None:
        # Upcast the parameters once, outside the chunks, so that their gradients sum over chunks in fp32 and are
        # rounded to the input dtype once (by the backward of this cast), not once per chunk.
        weight = weight.float()
        bias = None if bias is None else bias.float()

    def run(xc, yc, w, b):
        if logits is not None:
            return token_logprobs_ref(xc, yc, temperature, return_entropy)
        return linear_token_logprobs_ref(xc, w, yc, b, temperature, return_entropy)

    if torch.compiler.is_compiling():
        # one piece while tracing: a Python loop over row chunks would specialise N (one recompile per batch size);
        # the compiled graph's memory is the compiler's to plan (inductor fuses the reference's elementwise chain)
        return run(x, targets, weight, bias)
    outs = []
    for xc, yc in zip(_row_slices(x, rows), _row_slices(targets.unsqueeze(-1), rows)):
        yc = yc.squeeze(-1)
        out = checkpoint(run, xc, yc, weight, bias, use_reentrant=False) if grad else run(xc, yc, weight, bias)
        outs.append(out if return_entropy else (out,))
    if not outs:
        empty = x.new_zeros(targets.shape, dtype=torch.float32)
        return (empty, empty.clone()) if return_entropy else empty
    res = [torch.cat([o[i] for o in outs]).view(targets.shape) for i in range(len(outs[0]))]
    return tuple(res) if return_entropy else res[0]


def token_logprobs(
    logits: torch.Tensor | None = None,
    *,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
    return_path: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Per-token log-prob of `targets` under softmax(z / temperature), and optionally the full-vocabulary entropy.

    logp_t = log softmax(z_t / T)[y_t],  H_t = -sum_v p_tv log p_tv,  z_t = logits[t] or hidden[t] @ weight.T + bias.

    Args:
        logits: [N, V] or [B, T, V], float32/float16/bfloat16. A view whose last dim is contiguous (e.g.
            logits[:, :-1]) is read in place; otherwise it is copied once.
        hidden: [N, H] or [B, T, H] (instead of logits), with weight [V, H] and bias [V] or None, same dtype
            (under torch.autocast a weight/bias of another float dtype is cast to hidden's, differentiably). The
            [N, V] logits are never materialised (tiles of rows x vocabulary, backward recomputes them; without
            Triton, logits up to 1 MiB are: docs/loss.md section 2).
        targets: int64/int32 (TARGET_DTYPES, the rule rapo_loss applies too), shaped like logits.shape[:-1] (or
            hidden.shape[:-1]), values in [0, V).
        temperature: finite, > 0; divides the logits before the softmax (gradients carry 1/T).
        return_entropy: also return H_t.
        inplace_backward: logits= only. The backward writes the logits gradient over the logits themselves instead
            of a fresh [N, V] tensor (one N x V buffer less at the peak, as Liger-Kernel's fused cross-entropy does).
            Opt in only when nothing reads the logits after this call's backward: they hold the gradient then.
            A use of them that autograd saved (another loss term on the same logits, a second backward through
            this call) raises torch's "modified by an inplace operation" error instead of a wrong gradient; a read
            outside autograd (logging logits after backward) sees the gradient. No effect (a fresh gradient, as
            by default) for a leaf logits tensor, for a view whose rows are not evenly spaced (e.g.
            logits[:, :-1]: its slicing backward allocates the full gradient anyway), or without Triton.
        backend: "auto" (default), "triton", "torch" or "reference": which path runs (docs/architecture.md, "Log-prob
            and loss paths"). "auto" takes Triton on CUDA tensors (CPU tensors: under TRITON_INTERPRET=1), else
            "torch"; RAPO_FAST_DISABLE_TRITON=1 steers "auto" to "torch". "torch": torch's chunked
            F.linear_cross_entropy for hidden= without entropy, the chunked reference otherwise; "reference": the
            chunked reference always. An explicit backend that cannot run here raises ValueError saying why.
        return_path: also return the name of the path that ran (a str: "triton_logits", "triton_linear",
            "torch_linear_ce" or "reference_chunked"), as the last element. The "rapo_fast" logger names it too
            (debug level).

    Returns:
        logp, or (logp, entropy): float32, shaped like targets; then the path's name with return_path=True.
        Differentiable w.r.t. logits / hidden / weight / bias through both outputs; gradients come back in the
        inputs' dtype.
        A row whose log-sum-exp is not finite (only -inf, e.g. padding; any NaN or +inf) gives NaN logp and
        entropy and an exactly-zero gradient (docs/loss.md section 2); there is no mask here.

    Raises ValueError / TypeError naming the argument before any kernel runs. The targets range check costs one
    host sync and is skipped under torch.compile tracing.
    """
    inp = _logprob_inputs(
        logits, hidden, weight, bias, targets, temperature, return_entropy, inplace_backward, return_path
    )
    x = inp.x
    plan = plan_path(
        "token_logprobs",
        backend,
        device=x.device,
        dtype=x.dtype,
        hidden=hidden is not None,
        entropy=return_entropy,
        auto_triton=use_triton(x.device) if backend == "auto" else None,
    )
    out, path, reason = _run_logprobs(inp, plan)
    log_path("token_logprobs", path, reason)
    if not return_path:
        return out
    return (*out, path.value) if return_entropy else (out, path.value)


def _run_logprobs(inp: LogprobInputs, plan: PathPlan):
    """The log-probs (and entropy) of checked inputs on the planned path, for token_logprobs and rapo_loss (which
    plans its own call); returns (logp or (logp, entropy), the path that ran, why). torch's linear CE hands over to
    the chunked reference when some row's loss is not finite (decided from its output)."""
    path, reason = plan.path, plan.reason
    logits, hidden, targets, t, ent_on = inp.logits, inp.hidden, inp.targets, inp.temperature, inp.entropy
    if path is Path.TRITON_LOGITS:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        logp, _, ent = _token_logprobs_fwd(logits, targets, t, ent_on, inp.inplace_backward)
        return ((logp, ent) if ent_on else logp), path, reason
    if path is Path.TRITON_LINEAR:
        h2 = hidden.reshape(-1, hidden.shape[-1])
        bias = None if inp.bias is None else inp.bias.contiguous()  # the kernel indexes bias[v] densely
        logp, _, ent = linear_token_logprobs_fwd(h2, inp.weight, bias, targets.reshape(-1), t, ent_on)
        logp = logp.view(targets.shape)
        return ((logp, ent.view(targets.shape)) if ent_on else logp), path, reason
    if path is Path.REFERENCE_FP64:  # rapo_loss's checking precision (gradcheck, tests): unchunked, keeps fp64
        if logits is not None:
            return token_logprobs_ref(logits, targets, t, ent_on), path, reason
        return linear_token_logprobs_ref(hidden, inp.weight, targets, inp.bias, t, ent_on), path, reason
    if path is Path.TORCH_LINEAR_CE:
        logp = linear_logprobs_torch(hidden, inp.weight, inp.bias, targets, t)
        # one reduction and one read: a NaN/inf row makes the sum non-finite (a sum that overflows on finite rows
        # only sends the call to the exact reference too); isfinite().all() costs ~5x more at small N
        if math.isfinite(logp.sum().item()):
            return logp, path, reason
        # a row whose loss is not finite: torch's backward would not give its exactly-zero gradient
        path, reason = Path.REFERENCE_CHUNKED, f"{reason}; a row's loss was not finite, so the exact reference"
    return _reference_chunked(inp), path, reason
