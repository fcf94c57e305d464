"""The hidden-state path of token_logprobs: the registered ops `rapo_fast::linear_token_logprobs_fwd` / `_bwd`, which
take hidden [N, H] and the lm_head weight [V, H] (+ bias) instead of logits and never hold [N, V].

How the tiles, the recomputing backward and its GEMMs work: docs/loss.md section 2, "Hidden path".
What this is not: the public function, its checks and its CPU fallback (rapo_fast/loss/logprobs.py), the logits= path
(also there), or the kernels (rapo_fast/kernels/loss/token_logprobs.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rapo_fast._dispatch import register_op
from rapo_fast.loss import tiles

__all__ = ["linear_token_logprobs_fwd"]


def _lin_fwd_impl(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V] or None, targets [N] -> (logp [N], stats [2, N], entropy [N]) fp32
    ([0] entropy when not with_entropy; stats the rows' (max m, log s) that the backward forms p from), without
    materialising [N, V]: tiles of [rows, V_chunk] and an online state per row."""
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    stats = torch.empty(2, n, dtype=torch.float32, device=dev)
    ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=dev)
    if n == 0:
        return logp, stats, ent
    hidden, bad = tiles.finite_rows(hidden)  # a NaN/inf row: zeroed for the GEMMs, its outputs NaN (tiles.py)
    nc, vc = tiles.vocab_tiles(n, v, hidden.element_size(), dev)
    buf = tiles.tile_buffer(nc, vc, hidden)
    state = torch.empty(4, n, dtype=torch.float32, device=dev)  # m, s, t, scaled target logit
    tgt = targets.reshape(-1)
    for v0 in range(0, v, vc):
        v1 = min(v, v0 + vc)
        for r0 in range(0, n, nc):
            r1 = min(n, r0 + nc)
            z = tiles.logits_tile(buf, hidden[r0:r1], weight, v0, v1)
            tiles.tile_fwd(
                z,
                tgt[r0:r1],
                bias,
                state[:, r0:r1],
                logp[r0:r1],
                stats[:, r0:r1],
                ent[r0:r1] if with_entropy else None,
                v0=v0,
                vocab=v,
                inv_temp=1.0 / temperature,
            )
    tiles.mark_rows_undefined(bad, logp, stats, ent)
    return logp, stats, ent


def _lin_fwd_fake(hidden, weight, bias, targets, temperature, with_entropy):
    n = hidden.shape[0]
    return tuple(hidden.new_empty(m, dtype=torch.float32) for m in (n, (2, n), n if with_entropy else 0))


class _LinearGrads:
    """grad_hidden, grad_weight, grad_bias of the hidden path, accumulated over logits tiles (vocabulary tiles outer,
    row tiles inner). Sums over several tiles accumulate in fp32 (one rounding to the input dtype at the end), not in
    bf16. Outputs of a custom op may not alias each other: a fresh [0] tensor for each gradient not needed."""

    def __init__(
        self, hidden: Tensor, weight: Tensor, bias: Tensor | None, nc: int, vc: int, need: tuple[bool, bool, bool]
    ):
        (n, h), v, dev = hidden.shape, weight.shape[0], hidden.device
        need_h, need_w, need_b = need
        self.n_vtiles, self.n_rtiles = -(-v // vc), -(-n // nc)
        low_precision = hidden.dtype != torch.float32
        self.need_h, self.need_w = need_h, need_w
        self.grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
        self.acc_h = (
            torch.zeros(n, h, dtype=torch.float32, device=dev)
            if need_h and self.n_vtiles > 1 and low_precision
            else None
        )
        if self.acc_h is None and need_h and self.n_vtiles > 1:
            self.grad_h.zero_()
        self.grad_w = torch.empty_like(weight) if need_w else hidden.new_empty(0)
        self.acc_w = (
            torch.empty(vc, h, dtype=torch.float32, device=dev)
            if need_w and self.n_rtiles > 1 and low_precision
            else None
        )
        self.grad_b32 = torch.zeros(v, dtype=torch.float32, device=dev) if need_b and bias is not None else None
        self.bias_dtype = None if bias is None else bias.dtype

    def start_vocab_tile(self, v0: int, v1: int) -> None:
        if self.acc_w is not None:
            self.acc_w[: v1 - v0].zero_()
        elif self.need_w and self.n_rtiles > 1:
            self.grad_w[v0:v1].zero_()

    def add_tile(self, gz: Tensor, hc: Tensor, wv: Tensor, r0: int, v0: int) -> None:
        """Fold grad_z of one tile (rows from r0, vocabulary columns from v0) into the three gradients."""
        r1, v1 = r0 + gz.shape[0], v0 + gz.shape[1]
        if self.need_h:
            if self.n_vtiles == 1:
                torch.matmul(gz, wv, out=self.grad_h[r0:r1])
            elif self.acc_h is not None:
                self.acc_h[r0:r1] += torch.matmul(gz, wv)
            else:
                self.grad_h[r0:r1].addmm_(gz, wv)
        if self.need_w:
            gw = self.grad_w[v0:v1]
            if self.n_rtiles == 1:
                torch.matmul(gz.T, hc, out=gw)
            elif self.acc_w is not None:
                self.acc_w[: v1 - v0] += torch.matmul(gz.T, hc)
            else:
                gw.addmm_(gz.T, hc)
        if self.grad_b32 is not None:
            self.grad_b32[v0:v1] += gz.sum(0, dtype=torch.float32)

    def end_vocab_tile(self, v0: int, v1: int) -> None:
        if self.acc_w is not None:
            self.grad_w[v0:v1].copy_(self.acc_w[: v1 - v0])

    def results(self) -> tuple[Tensor, Tensor, Tensor]:
        if self.acc_h is not None:
            self.grad_h.copy_(self.acc_h)
        grad_b = self.grad_b32.to(self.bias_dtype) if self.grad_b32 is not None else self.grad_h.new_empty(0)
        return self.grad_h, self.grad_w, grad_b


def _lin_bwd_impl(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    stats: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    with_entropy: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight [V, H], grad_bias [V]) in the inputs' dtypes; a [0] tensor for each one not
    needed. Vocabulary tiles outer, row tiles inner: grad_W of one vocabulary tile is finished before the next."""
    n, v = hidden.shape[0], weight.shape[0]
    if n == 0:
        return (
            torch.zeros_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.zeros_like(weight) if need_weight else hidden.new_empty(0),
            torch.zeros_like(bias) if (need_bias and bias is not None) else hidden.new_empty(0),
        )
    # the rows the forward found non-finite have NaN stats, hence a zero grad_z row: zeroed here too, so that grad_W =
    # grad_z^T h never meets 0 * NaN (tiles.finite_rows)
    hidden = tiles.finite_rows(hidden)[0]
    nc, vc = tiles.vocab_tiles(n, v, hidden.element_size(), hidden.device)
    buf = tiles.tile_buffer(nc, vc, hidden)
    grads = _LinearGrads(hidden, weight, bias, nc, vc, (need_hidden, need_weight, need_bias))
    tgt = targets.reshape(-1)
    g_lp = grad_logp.reshape(-1).to(torch.float32).contiguous()
    g_ent = grad_entropy.reshape(-1).to(torch.float32).contiguous() if with_entropy else None
    for v0 in range(0, v, vc):
        v1 = min(v, v0 + vc)
        grads.start_vocab_tile(v0, v1)
        for r0 in range(0, n, nc):
            r1 = min(n, r0 + nc)
            hc = hidden[r0:r1]
            z = tiles.logits_tile(buf, hc, weight, v0, v1)
            tiles.tile_grad(
                z,
                tgt[r0:r1],
                bias,
                stats[:, r0:r1],
                g_lp[r0:r1],
                v0=v0,
                inv_temp=1.0 / temperature,
                entropy=entropy[r0:r1] if with_entropy else None,
                g_entropy=g_ent[r0:r1] if with_entropy else None,
            )
            grads.add_tile(z, hc, weight[v0:v1], r0, v0)  # z now holds grad_z (input dtype) for this tile
        grads.end_vocab_tile(v0, v1)
    return grads.results()


def _lin_bwd_fake(hidden, weight, bias, *args):
    need_h, need_w, need_b = args[-3:]
    return (
        torch.empty_like(hidden) if need_h else hidden.new_empty(0),
        torch.empty_like(weight) if need_w else hidden.new_empty(0),
        torch.empty_like(bias) if (need_b and bias is not None) else hidden.new_empty(0),
    )


_linear_token_logprobs_bwd = register_op("linear_token_logprobs_bwd", _lin_bwd_impl, fake=_lin_bwd_fake)


def _lin_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, with_entropy = inputs
    _, stats, ent = output
    ctx.save_for_backward(hidden, weight, bias, targets, stats, ent)
    ctx.temperature, ctx.with_entropy = temperature, with_entropy


def _lin_backward(ctx, g_logp, g_stats, g_ent):
    # g_stats is ignored: stats is an internal output of the op and never leaves token_logprobs.
    hidden, weight, bias, targets, stats, ent = ctx.saved_tensors
    if g_logp is None:
        g_logp = torch.zeros_like(stats[0])
    with_ent = ctx.with_entropy and g_ent is not None
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    gh, gw, gb = _linear_token_logprobs_bwd(
        hidden,
        weight,
        bias,
        targets,
        stats,
        ent,
        g_logp,
        g_ent if with_ent else g_logp,
        ctx.temperature,
        with_ent,
        need_h,
        need_w,
        need_b and bias is not None,
    )
    return (
        gh if need_h else None,
        gw if need_w else None,
        gb if (need_b and bias is not None) else None,
        None,
        None,
        None,
    )


linear_token_logprobs_fwd = register_op(
    "linear_token_logprobs_fwd",
    _lin_fwd_impl,
    fake=_lin_fwd_fake,
    backward=_lin_backward,
    setup_context=_lin_setup_context,
)
