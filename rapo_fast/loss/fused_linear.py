"""One-pass fused hidden-state policy loss: logits tiles, log-prob/entropy, per-token loss and all gradients in the
forward; the backward only scales the stored gradients by the upstream scalar.

What this is: the registered op `rapo_fast::fused_linear_policy_loss` that rapo_fast.rapo_loss uses for hidden=
inputs with token-level importance sampling when a gradient is needed and the device runs Triton. It reuses the
kernels of token_logprobs (kernels/loss/token_logprobs.py: the online log-sum-exp forward and the in-place grad_z
backward, which takes any per-row g_logp, g_H) and the per-token policy-loss launchers of rapo_fast/loss/policy_loss.py
(kernels/loss/policy_loss.py), applied tile by tile; the tiling budget is rapo_fast/loss/logprobs.py's (_TILE_BYTES,
_MAX_VOCAB_TILE).
What this is not: new math (there is none here), the sequence-level (GSPO) path (its ratio needs the whole sequence's
log-prob before any token's loss gradient is known: it keeps the two-pass path), or the logits= path.

Why it works: the loss is a scalar and, at token level, dL/dlogp_t and dL/dH_t depend only on token t's logp_t, H_t and
on inputs fixed before the pass (old/behav/ref logp, advantage, aggregation weight, shaping scale, token code). So the
gradient of a logits tile can be formed while the tile is in memory, and grad_hidden, grad_weight, grad_bias
accumulated then (as Liger-Kernel's fused linear GRPO loss does). GEMM families: forward h W^T, grad_h = gz W,
grad_W = gz^T h -> 3, against 4 for the two-pass path (its backward recomputes h W^T).

Tiling: a token tile holds the full vocabulary row when V * elem <= _TILE_BYTES (rows = budget // (V * elem)); the
logits gradient needs the row's final LSE, so the tile stays in memory from its GEMM to its gradient GEMMs. When a
single row does not fit the budget (V * elem > _TILE_BYTES), the token tile is swept twice over vocabulary tiles: once
for the online LSE / entropy, once recomputing each tile's GEMM to form its gradient; that is 4 GEMM families again
(no saving over two-pass, but still one pass over the data in the forward and a free backward).
Memory: one logits tile, [N] fp32 vectors, the gradients, and an fp32 accumulator of grad_W ([V, H]; grad_W sums over
token tiles and is rounded to the input dtype once) plus an fp32 [rows, H] grad_h accumulator when vocabulary tiles
are swept. A custom op rather than a torch.autograd.Function, like every other op (STYLE.md item 6); the gradients are
extra outputs of the op so that torch.compile and opcheck see them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rapo_fast._dispatch import register_op
from rapo_fast.kernels.loss.policy_loss import NUM_METRICS
from rapo_fast.loss import logprobs as _lp

__all__ = ["fused_linear_policy_loss", "tile_shape"]


def tile_shape(n: int, v: int, elem: int, device: torch.device) -> tuple[int, int]:
    """(rows, vocabulary columns) of one logits tile: whole rows when V fits the byte budget, else logprobs' tiles."""
    budget = _lp._TILE_BYTES[_lp._where(device)]
    if v * elem <= budget:
        return max(1, min(n, budget // (v * elem))), v
    return _lp._tiles(n, v, elem, device)


def _logits_tile(buf: Tensor, hc: Tensor, weight: Tensor, v0: int, v1: int) -> Tensor:
    """hc @ weight[v0:v1].T written into the front of buf (input dtype), as a [rows, v1 - v0] view."""
    z = buf[: hc.shape[0] * (v1 - v0)].view(hc.shape[0], v1 - v0)
    torch.matmul(hc, weight[v0:v1].T, out=z)
    return z


def _fused_impl(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, old: Tensor, adv: Tensor, w: Tensor,
    scale: Tensor, code: Tensor, behav: Tensor | None, ref: Tensor | None, eps_low: float, eps_high: float,
    dual_c: float, gamma: float, is_cap: float, tis_cap: float, beta: float, ent_coef: float, off_mode: int,
    kl_mode: int, temperature: float, with_ent: bool, need_h: bool, need_w: bool, need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """hidden [N, H], weight [V, H], bias [V] or None, targets [N], per-token fp32 [N] inputs of the policy loss ->
    (loss 0-dim fp32, metric sums [12] fp32, grad_hidden, grad_weight, grad_bias) with the gradients of the loss
    (upstream gradient 1) in the inputs' dtypes, a [0] tensor for each not needed."""
    from rapo_fast.loss import policy_loss as L  # lazy: rapo_fast.loss.policy_loss imports this module lazily too

    k = _lp._kernels()
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    f32 = torch.float32
    loss = torch.zeros((), dtype=f32, device=dev)
    sums = torch.zeros(NUM_METRICS, dtype=f32, device=dev)
    has_bias = bias is not None
    need_b = need_b and has_bias
    # contiguous whatever hidden's strides (empty_like would copy them), matching the fake
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if need_h else hidden.new_empty(0)
    acc_w = torch.zeros(v, h, dtype=f32, device=dev) if need_w else None
    grad_b32 = torch.zeros(v, dtype=f32, device=dev) if need_b else None
    any_grad = need_h or need_w or need_b
    if n > 0:
        nc, vc = tile_shape(n, v, hidden.element_size(), dev)
        n_vtiles = -(-v // vc)
        wc = _lp._MAX_VOCAB_TILE[_lp._where(dev)]
        buf = _lp._tile_buffer(nc, vc, hidden)
        state = torch.empty(4, nc, dtype=f32, device=dev)  # m, s, t, scaled target logit
        logp = torch.empty(nc, dtype=f32, device=dev)
        lse = torch.empty(nc, dtype=f32, device=dev)
        ent = torch.empty(nc if with_ent else 0, dtype=f32, device=dev)
        ones = torch.ones(nc, dtype=f32, device=dev)
        acc_h = torch.empty(nc, h, dtype=f32, device=dev) if need_h and n_vtiles > 1 else None
        tgt = targets.reshape(-1)
        inv_t = 1.0 / temperature
        g_ent_on = with_ent and ent_coef != 0.0  # H enters the loss only through -ent_coef * H
        scalars = (eps_low, eps_high, dual_c, gamma, is_cap, tis_cap, beta, ent_coef, off_mode, kl_mode)
        for r0 in range(0, n, nc):
            r1 = min(n, r0 + nc)
            rows = r1 - r0
            hc = hidden[r0:r1]
            lp_t, lse_t = logp[:rows], lse[:rows]
            ent_t = ent[:rows] if with_ent else lse_t

            # sweep 1: the online LSE / entropy over the row's vocabulary tiles (one tile when the row fits)
            for v0 in range(0, v, vc):
                v1 = min(v, v0 + vc)
                z = _logits_tile(buf, hc, weight, v0, v1)
                block, warps = _lp._launch_cfg(v1 - v0)
                st = state[:, :rows]
                k._token_logprobs_fwd_kernel[(rows,)](
                    z, tgt[r0:r1], bias if has_bias else z, st[0], st[1], st[2], st[3], lp_t, lse_t, ent_t,
                    rows, 0, v1 - v0, v1 - v0, v0, inv_t,
                    INIT=v0 == 0, FINAL=v1 == v, HAS_BIAS=has_bias, WITH_ENTROPY=with_ent,
                    BLOCK_V=block, num_warps=warps,
                )  # fmt: skip

            # the per-token loss and its coefficients dL/dlogp, dL/dH (upstream gradient 1), from loss.py's launchers
            per_tok = (old[r0:r1], adv[r0:r1], w[r0:r1], scale[r0:r1], code[r0:r1], None,
                       None if behav is None else behav[r0:r1], None if ref is None else ref[r0:r1])  # fmt: skip
            tok, part = L._policy_loss_impl(lp_t, *per_tok, ent_t if with_ent else None, *scalars)
            loss += tok.sum()
            sums += part
            if not any_grad:
                continue
            g_lp, g_ent = L._policy_loss_bwd_impl(ones[:rows], lp_t, *per_tok, g_ent_on, *scalars)

            # sweep 2: grad_z of each tile in place, then its gradient GEMMs; the tile is still in memory when the
            # whole row fitted, else it is recomputed (the fallback of the module docstring)
            for v0 in range(0, v, vc):
                v1 = min(v, v0 + vc)
                if n_vtiles > 1:
                    z = _logits_tile(buf, hc, weight, v0, v1)
                block, warps = _lp._launch_cfg(v1 - v0)
                k._token_logprobs_bwd_kernel[(rows,)](
                    z, z, tgt[r0:r1], bias if has_bias else z, lse_t, ent_t, g_lp, g_ent if g_ent_on else g_lp,
                    rows, 0, v1 - v0, v1 - v0, v1 - v0, v0, inv_t,
                    HAS_BIAS=has_bias, WITH_ENTROPY=g_ent_on, BLOCK_V=block, num_warps=warps,
                )  # fmt: skip
                wv = weight[v0:v1]
                if need_h:
                    if acc_h is None:
                        torch.matmul(z, wv, out=grad_h[r0:r1])
                    elif v0 == 0:
                        acc_h[:rows].copy_(z @ wv)
                    else:
                        acc_h[:rows] += z @ wv
                if need_w:
                    if hidden.dtype == f32:
                        acc_w[v0:v1].addmm_(z.T, hc)
                    else:
                        # the GEMM accumulates in fp32 internally; its bf16/fp16 result is summed in fp32, in column
                        # chunks of at most _MAX_VOCAB_TILE so that the low-precision temporary stays small
                        for c0 in range(v0, v1, wc):
                            c1 = min(v1, c0 + wc)
                            acc_w[c0:c1] += z[:, c0 - v0 : c1 - v0].T @ hc
                if need_b:
                    grad_b32[v0:v1] += z.sum(0, dtype=f32)
            if acc_h is not None:
                grad_h[r0:r1].copy_(acc_h[:rows])
    elif need_h:
        grad_h.zero_()
    grad_w = (acc_w if weight.dtype == f32 else acc_w.to(weight.dtype)) if need_w else hidden.new_empty(0)
    grad_b = grad_b32.to(bias.dtype) if need_b else hidden.new_empty(0)
    return loss, sums, grad_h, grad_w, grad_b


def _fused_fake(hidden, weight, bias, *args):
    need_h, need_w, need_b = args[-3:]
    f32 = torch.float32
    return (
        hidden.new_empty((), dtype=f32),
        hidden.new_empty((NUM_METRICS,), dtype=f32),
        hidden.new_empty(hidden.shape) if need_h else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_w else hidden.new_empty(0),
        bias.new_empty(bias.shape) if (need_b and bias is not None) else hidden.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    _, _, gh, gw, gb = output
    ctx.save_for_backward(gh, gw, gb)
    ctx.need = tuple(inputs[-3:])
    ctx.has_bias = inputs[2] is not None


def _backward(ctx, g_loss, g_sums, g_gh, g_gw, g_gb):
    # The loss is 0-dim: the stored gradients (upstream 1) times the upstream scalar are the gradients. The sums and
    # the stored gradients themselves are not differentiated through (their upstream gradients are ignored).
    gh, gw, gb = ctx.saved_tensors
    need_h, need_w, need_b = ctx.need

    def scaled(x):
        return (x * g_loss).to(x.dtype)

    return (
        scaled(gh) if need_h else None,
        scaled(gw) if need_w else None,
        scaled(gb) if (need_b and ctx.has_bias) else None,
    ) + (None,) * 23


_fused_op = register_op("fused_linear_policy_loss", _fused_impl, fake=_fused_fake, backward=_backward,
                        setup_context=_setup_context)


def fused_linear_policy_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, old: Tensor, adv: Tensor, w: Tensor,
    scale: Tensor, code: Tensor, behav: Tensor | None, ref: Tensor | None, eps_low: float, eps_high: float,
    dual_c: float, gamma: float, is_cap: float, tis_cap: float, beta: float, ent_coef: float, off_mode: int,
    kl_mode: int, temperature: float, with_ent: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(loss, metric sums) of rapo_fast.rapo_loss's token-level policy loss from hidden [..., H] @ weight [V, H]^T
    (+ bias), differentiable w.r.t. hidden / weight / bias; the per-token fp32 [N] inputs are rapo_loss's."""
    grad_on = torch.is_grad_enabled()
    need = tuple(grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias))
    h2 = hidden.reshape(-1, hidden.shape[-1])
    bias = None if bias is None else bias.contiguous()  # the kernels index bias[v] densely
    loss, sums, *_ = _fused_op(
        h2, weight, bias, targets.reshape(-1), old, adv, w, scale, code, behav, ref, eps_low, eps_high, dual_c,
        gamma, is_cap, tis_cap, beta, ent_coef, off_mode, kl_mode, temperature, with_ent, *need,
    )  # fmt: skip
    return loss, sums
