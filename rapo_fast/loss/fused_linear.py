"""One-pass fused hidden-state policy loss: logits tiles, log-prob/entropy, per-token loss and all gradients in the
forward; the backward only scales the stored gradients by the upstream scalar.

What this is: the registered op `rapo_fast::fused_linear_policy_loss`, built from the tiles of rapo_fast/loss/tiles.py
and the launchers of rapo_fast/loss/policy_op.py; when rapo_loss takes it, why it works, the tiling, grad_W and
memory: docs/loss.md section 6.
What this is not: new math (there is none here), the sequence-level (GSPO) path (its ratio needs the whole sequence's
log-prob before any token's loss gradient is known: it keeps the two-pass path), or the logits= path.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from rapo_fast._dispatch import register_op
from rapo_fast.kernels.loss.policy_layout import NUM_METRICS, TokenInput
from rapo_fast.loss import tiles
from rapo_fast.loss.options import check_loss_logp_defined
from rapo_fast.loss.policy_op import policy_loss_bwd, policy_loss_fwd

__all__ = ["fused_linear_policy_loss", "tile_shape"]

_F32 = torch.float32


def tile_shape(n: int, v: int, elem: int, device: torch.device) -> tuple[int, int]:
    """(rows, vocabulary columns) of one logits tile: whole rows when V fits the byte budget (tiles.tile_budget: from
    the free memory on CUDA), in token tiles of balanced size, else the vocabulary tiles of rapo_fast/loss/tiles.py."""
    budget = tiles.tile_budget(device)
    if v * elem <= budget:
        return tiles.balanced_rows(n, min(n, budget // (v * elem))), v
    return tiles.vocab_tiles(n, v, elem, device)


class _Tiles:
    """The logits tiles of one call: shape, the reused tile buffer, and the [rows] fp32 vectors of one token tile
    (online state, logp, the (m, log s) stats, entropy)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, with_ent: bool):
        n, dev = hidden.shape[0], hidden.device
        self.weight, self.bias, self.vocab = weight, bias, weight.shape[0]
        self.inv_t, self.with_ent = 1.0 / temperature, with_ent
        self.rows, self.cols = tile_shape(n, self.vocab, hidden.element_size(), dev)
        self.n_vtiles = -(-self.vocab // self.cols)
        self.buf = tiles.tile_buffer(self.rows, self.cols, hidden)
        self.state = torch.empty(4, self.rows, dtype=_F32, device=dev)  # m, s, t, scaled target logit
        self.logp = torch.empty(self.rows, dtype=_F32, device=dev)
        self.stats = torch.empty(2, self.rows, dtype=_F32, device=dev)
        self.ent = torch.empty(self.rows if with_ent else 0, dtype=_F32, device=dev)
        self.ones = torch.ones(self.rows, dtype=_F32, device=dev)

    def vocab_ranges(self):
        return ((v0, min(self.vocab, v0 + self.cols)) for v0 in range(0, self.vocab, self.cols))

    def logprob_sweep(self, hc: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """Sweep 1: the online LSE / entropy of the token tile hc over its vocabulary tiles (one when the row fits).
        Returns logp [rows], stats [2, rows], entropy [rows] or None, and the last logits tile."""
        rows = hc.shape[0]
        lp, stats = self.logp[:rows], self.stats[:, :rows]
        ent = self.ent[:rows] if self.with_ent else None
        for v0, v1 in self.vocab_ranges():
            z = tiles.logits_tile(self.buf, hc, self.weight, v0, v1)
            tiles.tile_fwd(
                z, tgt, self.bias, self.state[:, :rows], lp, stats, ent, v0=v0, vocab=self.vocab, inv_temp=self.inv_t
            )
        return lp, stats, ent, z

    def gradient_sweep(
        self,
        hc: Tensor,
        tgt: Tensor,
        z: Tensor,
        stats: Tensor,
        ent: Tensor | None,
        g_lp: Tensor,
        g_ent: Tensor | None,
        grads: _Grads,
        r0: int,
    ) -> None:
        """Sweep 2: grad_z of each logits tile in place, then its gradient GEMMs. The tile is still in memory when
        the whole row fitted, else it is recomputed (the fallback of the module docstring)."""
        for v0, v1 in self.vocab_ranges():
            if self.n_vtiles > 1:
                z = tiles.logits_tile(self.buf, hc, self.weight, v0, v1)
            tiles.tile_grad(z, tgt, self.bias, stats, g_lp, v0=v0, inv_temp=self.inv_t, entropy=ent, g_entropy=g_ent)
            grads.add_tile(z, hc, self.weight[v0:v1], r0, v0, v1)
        grads.end_token_tile(r0, r0 + hc.shape[0])


class _Grads:
    """The gradients of one call, accumulated tile by tile: grad_h in the input dtype (through an fp32 [rows, H]
    accumulator when vocabulary tiles are swept), grad_b in fp32 (rounded once), and grad_W either written directly
    (one token tile: each vocabulary tile's rows of grad_W = grad_z^T h are finished by one GEMM, which accumulates
    in fp32 and rounds once) or summed over token tiles in an fp32 [V, H] accumulator by the GEMM itself
    (tiles.accumulate_fp32) and rounded to the input dtype once."""

    def __init__(self, hidden: Tensor, weight: Tensor, need: tuple[bool, bool, bool], tile_rows: int, n_vtiles: int):
        need_h, need_w, need_b = need
        n, h, v, dev = hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.device
        self.need_h = need_h
        # contiguous whatever hidden's strides (empty_like would copy them), matching the fake
        self.grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if need_h else hidden.new_empty(0)
        self.acc_h = torch.empty(tile_rows, h, dtype=_F32, device=dev) if need_h and n_vtiles > 1 else None
        self.direct_w = need_w and (tile_rows >= n > 0 or weight.dtype == _F32)
        # direct: grad_W in the weight's dtype, every row written once (fp32 inputs accumulate in it with addmm_);
        # else an fp32 accumulator, each row's first token tile writes it (beta = 0), so neither needs zeroing
        self.grad_w = torch.empty(v, h, dtype=weight.dtype, device=dev) if self.direct_w else None
        self.acc_w = torch.empty(v, h, dtype=_F32, device=dev) if need_w and not self.direct_w else None
        self.grad_b32 = torch.zeros(v, dtype=_F32, device=dev) if need_b else None
        self.w_chunk = tiles.MAX_VOCAB_TILE[tiles.device_kind(dev)]

    def add_tile(self, gz: Tensor, hc: Tensor, wv: Tensor, r0: int, v0: int, v1: int) -> None:
        """Fold grad_z of the tile (token rows from r0, vocabulary v0:v1) into grad_h, grad_W and grad_b."""
        rows = gz.shape[0]
        if self.need_h:
            if self.acc_h is None:
                torch.matmul(gz, wv, out=self.grad_h[r0 : r0 + rows])
            else:
                tiles.accumulate_fp32(self.acc_h[:rows], gz, wv, first=v0 == 0, chunk=rows)
        if self.grad_w is not None:
            if r0 == 0:
                torch.mm(gz.T, hc, out=self.grad_w[v0:v1])
            else:  # fp32 weight over several token tiles
                self.grad_w[v0:v1].addmm_(gz.T, hc)
        elif self.acc_w is not None:
            tiles.accumulate_fp32(self.acc_w[v0:v1], gz.T, hc, first=r0 == 0, chunk=self.w_chunk)
        if self.grad_b32 is not None:
            self.grad_b32[v0:v1] += gz.sum(0, dtype=_F32)

    def end_token_tile(self, r0: int, r1: int) -> None:
        if self.acc_h is not None:
            self.grad_h[r0:r1].copy_(self.acc_h[: r1 - r0])

    def results(self, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes, a [0] tensor for each not needed."""
        grad_w = hidden.new_empty(0)
        if self.grad_w is not None:
            grad_w = self.grad_w
        elif self.acc_w is not None:
            grad_w = self.acc_w.to(weight.dtype)
        grad_b = self.grad_b32.to(bias.dtype) if self.grad_b32 is not None else hidden.new_empty(0)
        return self.grad_h, grad_w, grad_b


def _fused_impl(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    tok: Tensor,
    present: int,
    scalars: Tensor,
    temperature: float,
    with_ent: bool,
    grad_ent: bool,
    need_h: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V] or None, targets [N], the stacked per-token fp32 inputs of the policy op
    (tok [NUM_INPUTS, N], present) and its options (scalars) -> (loss 0-dim fp32, metric sums [NUM_METRICS] fp32,
    grad_hidden, grad_weight, grad_bias, undefined [N] bool) with the gradients of the loss (upstream gradient 1) in
    the inputs' dtypes, a [0] tensor for each not needed. grad_ent: the entropy enters the loss (entropy_coef != 0).
    undefined marks the tokens in the loss whose log-prob is NaN (their logits row's log-sum-exp is not finite, e.g. h
    W^T overflowed): the caller refuses the call when any is set (the logits never exist as a whole to be checked).
    Also returns logp [N] fp32, the log-probs the loss used (NaN where undefined; no gradient), for the metrics."""
    n, dev = hidden.shape[0], hidden.device
    loss = torch.zeros((), dtype=_F32, device=dev)
    sums = torch.zeros(NUM_METRICS, dtype=_F32, device=dev)
    need = (need_h, need_w, need_b and bias is not None)
    undefined = torch.zeros(n, dtype=torch.bool, device=dev)
    logp_all = torch.empty(n, dtype=_F32, device=dev)
    if n == 0:
        grads = _Grads(hidden, weight, need, 1, 1)
        for g in (grads.grad_h, grads.grad_w, grads.acc_w):
            if g is not None:
                g.zero_()
        return (loss, sums, *grads.results(hidden, weight, bias), undefined, logp_all)
    tiling = _Tiles(hidden, weight, bias, temperature, with_ent)
    grads = _Grads(hidden, weight, need, tiling.rows, tiling.n_vtiles)
    g_ent_on = with_ent and grad_ent
    tgt = targets.reshape(-1)
    in_loss = tok[TokenInput.CODE] != 0
    for r0 in range(0, n, tiling.rows):
        r1 = min(n, r0 + tiling.rows)
        # a row holding NaN/inf is zeroed for the GEMMs (grad_W = grad_z^T h would meet 0 * NaN) and given NaN
        # log-prob, stats and entropy: undefined if in the loss, inert (zero grad_z row) if masked (tiles.finite_rows)
        hc, bad = tiles.finite_rows(hidden[r0:r1])
        lp, stats, ent, z = tiling.logprob_sweep(hc, tgt[r0:r1])
        tiles.mark_rows_undefined(bad, lp, stats, ent)
        torch.logical_and(torch.isnan(lp), in_loss[r0:r1], out=undefined[r0:r1])
        logp_all[r0:r1].copy_(lp)
        # the per-token loss and its coefficients dL/dlogp, dL/dH (upstream gradient 1), from policy_op's launchers
        tile = tok[:, r0:r1]
        t_loss, part = policy_loss_fwd(lp, ent, tile, present, scalars)
        loss += t_loss.sum()
        sums += part
        if any(need):
            g_lp, g_ent = policy_loss_bwd(tiling.ones[: r1 - r0], lp, tile, present, scalars, g_ent_on)
            tiling.gradient_sweep(
                hc, tgt[r0:r1], z, stats, ent if g_ent_on else None, g_lp, g_ent if g_ent_on else None, grads, r0
            )
    return (loss, sums, *grads.results(hidden, weight, bias), undefined, logp_all)


def _fused_fake(hidden, weight, bias, *args):
    need_h, need_w, need_b = args[-3:]
    return (
        hidden.new_empty((), dtype=_F32),
        hidden.new_empty((NUM_METRICS,), dtype=_F32),
        hidden.new_empty(hidden.shape) if need_h else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_w else hidden.new_empty(0),
        bias.new_empty(bias.shape) if (need_b and bias is not None) else hidden.new_empty(0),
        hidden.new_empty((hidden.shape[0],), dtype=torch.bool),
        hidden.new_empty((hidden.shape[0],), dtype=_F32),
    )


# inputs of the op after bias (targets .. need_b), none of which gets a gradient: counted from the signature
_N_INPUTS_AFTER_BIAS = len(inspect.signature(_fused_impl).parameters) - 3


def _setup_context(ctx, inputs, output):
    _, _, gh, gw, gb, _, _ = output
    ctx.save_for_backward(gh, gw, gb)
    ctx.need = tuple(inputs[-3:])
    ctx.has_bias = inputs[2] is not None


def _backward(ctx, g_loss, g_sums, g_gh, g_gw, g_gb, g_undefined, g_logp):
    # The loss is 0-dim: the stored gradients (upstream 1) times the upstream scalar are the gradients. The sums, the
    # stored gradients, the undefined flags and the log-probs are not differentiated through (their upstream
    # gradients are ignored).
    gh, gw, gb = ctx.saved_tensors
    need_h, need_w, need_b = ctx.need

    def scaled(x):
        return (x * g_loss).to(x.dtype)

    return (
        scaled(gh) if need_h else None,
        scaled(gw) if need_w else None,
        scaled(gb) if (need_b and ctx.has_bias) else None,
    ) + (None,) * _N_INPUTS_AFTER_BIAS


_fused_op = register_op(
    "fused_linear_policy_loss", _fused_impl, fake=_fused_fake, backward=_backward, setup_context=_setup_context
)


def fused_linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    tok: Tensor,
    present: int,
    scalars: Tensor,
    temperature: float,
    with_ent: bool,
    grad_ent: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, metric sums, log-probs [N] fp32 without gradient) of rapo_fast.rapo_loss's token-level policy loss from
    hidden [..., H] @ weight [V, H]^T (+ bias), differentiable w.r.t. hidden / weight / bias; tok / present / scalars
    are the policy op's (policy_op.py). Raises ValueError (after the pass, before any backward) when a token in the
    loss has an undefined log-prob."""
    grad_on = torch.is_grad_enabled()
    need = tuple(grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias))
    h2 = hidden.reshape(-1, hidden.shape[-1])
    bias = None if bias is None else bias.contiguous()  # the kernels index bias[v] densely
    loss, sums, _, _, _, undefined, logp = _fused_op(
        h2, weight, bias, targets.reshape(-1), tok, present, scalars, temperature, with_ent, grad_ent, *need
    )
    check_loss_logp_defined(undefined)
    return loss, sums, logp
