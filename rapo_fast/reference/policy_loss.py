"""Reference (spec) of the RAPO policy loss: plain torch autograd over the formulas of docs/loss.md (sections 3 and 4).

What this is: `policy_token_loss_ref` (the per-token loss and its metric terms; rapo_loss's CPU fallback calls it) and
`rapo_loss_ref` (the whole loss the way verl writes it). The options are the fields of
rapo_fast.loss.options.LossOptions (its checks are the only validation here).
What this is not: a fast path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rapo_fast.loss.options import LossOptions
from rapo_fast.reference.logprobs import linear_token_logprobs_ref, token_logprobs_ref

__all__ = ["policy_token_loss_ref", "rapo_loss_ref", "kl_penalty_ref", "LOG_RATIO_CLAMP"]

LOG_RATIO_CLAMP = 20.0  # verl's clamp before exp (docs/pitfalls.md #11)


def kl_penalty_ref(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: bool = True) -> torch.Tensor:
    """verl's kl_penalty: k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = clamp(e^x - x - 1, -10, 10), x = clamp(ref -
    logp, -20, 20); with clamp=False, k3 = e^x - x - 1 (TRL's; x keeps its [-20, 20] clamp against overflow). Same
    shape as logp."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp).square()
    if estimator == "k3":
        x = torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(x) - x - 1
        return torch.clamp(k3, -10.0, 10.0) if clamp else k3
    raise ValueError(f"kl_estimator: expected one of ['k1', 'k2', 'k3'], got {estimator!r}")


# Options that act on rows, on the logits or on the call, not per token (those without a KernelArg in LossOptions):
# policy_token_loss_ref takes their effect as tensors (ratio_scale, seq_log_ratio) or not at all.
_ROW_OPTIONS = tuple(n for n in LossOptions.names() if n not in LossOptions.kernel_names())


def policy_token_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    on_mask: torch.Tensor,
    off_mask: torch.Tensor | None = None,
    ratio_scale: torch.Tensor | float = 1.0,
    seq_log_ratio: torch.Tensor | None = None,
    behav_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    options: LossOptions | Mapping[str, Any] | None = None,
    **option_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (unaggregated) and per-token metric terms; all tensors broadcast to logp's shape.

    logp: float tensor (fp32/fp64) with grad; on_mask/off_mask: bool, the on-policy tokens in the loss and the
    retrieved tokens trained off-policy; seq_log_ratio: per token, the (already detached) sequence mean log-ratio for
    importance_sampling_level="sequence", else None. options: a LossOptions (its per-token fields are read: those with
    a KernelArg), or those fields as a mapping or as keywords. Returns
    (loss [...], terms) where loss is 0 outside on|off and terms holds detached per-token values: clipped_high,
    clipped_low, dual_clipped (bool), ratio, approx_kl, and where computed kl (ref_logp given), tis_weight (tis_cap
    set), offpolicy_weight (offpolicy_train not "none").
    """
    o = LossOptions.from_call(options, option_kwargs, caller="policy_token_loss_ref", exclude=_ROW_OPTIONS)
    off_mask = torch.zeros_like(on_mask) if off_mask is None else off_mask
    active = on_mask | off_mask
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Tokens out of the loss contribute exactly zero to the loss and its gradient whatever they hold (a padding row's
    # NaN log-prob, -inf old_logp): their inputs are replaced by 0 with torch.where before any arithmetic, so no
    # 0 * NaN reaches a sum or a backward (a where's backward sends exactly 0 to the unchosen branch).
    logp = torch.where(active, logp, zero)
    old_logp = torch.where(active, old_logp.detach().to(logp.dtype), zero)
    adv = torch.where(active, advantages.detach().to(logp.dtype), zero)
    behav_logp = None if behav_logp is None else torch.where(active, behav_logp.detach().to(logp.dtype), zero)
    ref_logp = None if ref_logp is None else torch.where(active, ref_logp.detach().to(logp.dtype), zero)
    entropy = None if entropy is None else torch.where(active, entropy.to(logp.dtype), zero)

    ratio = _ratio(logp, old_logp, seq_log_ratio)
    r_hat = ratio_scale * ratio
    pg, clipped, dual, tis_w = _clipped_surrogate(r_hat, adv, old_logp, behav_logp, on_mask, o)
    loss = torch.where(on_mask, pg, zero)
    off_loss, off_w = _offpolicy_loss(logp, adv, behav_logp, o)
    if off_loss is not None:
        loss = loss + torch.where(off_mask, off_loss, zero)
    kl = None
    if ref_logp is not None:
        kl = kl_penalty_ref(logp, ref_logp.detach().to(logp.dtype), o.kl_estimator, o.kl_clamp)
        if o.beta != 0.0:
            loss = loss + torch.where(active, o.beta * kl, zero)
    if entropy is not None and o.entropy_coef != 0.0:
        loss = loss + torch.where(active, -o.entropy_coef * entropy.to(logp.dtype), zero)

    hi = torch.as_tensor(1.0 + o.eps_high, dtype=logp.dtype)
    lo = torch.as_tensor(1.0 - o.eps_low, dtype=logp.dtype)
    terms = {
        "clipped_high": (clipped & (r_hat > hi)).detach(),
        "clipped_low": (clipped & (r_hat < lo)).detach(),
        "dual_clipped": dual.detach(),
        "ratio": ratio.detach(),
        "approx_kl": (old_logp - logp).detach(),
    }
    # the terms of parts that did not run are absent (no ref_logp: no KL; no tis_cap; offpolicy_train "none")
    for name, x in (("kl", kl), ("tis_weight", tis_w), ("offpolicy_weight", off_w)):
        if x is not None:
            terms[name] = x.detach()
    return loss, terms


def _ratio(logp: torch.Tensor, old_logp: torch.Tensor, seq_log_ratio: torch.Tensor | None) -> torch.Tensor:
    """r = exp(clamp(logp - old)) ("token"), or exp(clamp(sg(seq_lr) + logp - sg(logp))) ("sequence", GSPO-token)."""
    if seq_log_ratio is None:
        log_r = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    else:
        log_r = seq_log_ratio.detach().to(logp.dtype) + logp - logp.detach()
        log_r = torch.clamp(log_r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_r)


def _clipped_surrogate(r_hat, adv, old_logp, behav_logp, on_mask, o: LossOptions):
    """pg = max(-A r_hat, -A clip(r_hat, 1 - eps_low, 1 + eps_high)), dual-clipped for A < 0, times the TIS weight.
    Returns (pg, clipped, dual_clipped, tis weight or None)."""
    pg1 = -adv * r_hat
    pg2 = -adv * torch.clamp(r_hat, 1.0 - o.eps_low, 1.0 + o.eps_high)
    clipped = pg2 > pg1
    pg = torch.maximum(pg1, pg2)
    dual = torch.zeros_like(on_mask)
    if o.dual_clip is not None:
        pg3 = -adv * o.dual_clip
        dual = (adv < 0) & (pg > pg3)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    tis_w = None
    if o.tis_cap is not None:
        lw = torch.clamp(old_logp - behav_logp.detach().to(old_logp.dtype), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        tis_w = torch.clamp(torch.exp(lw), max=o.tis_cap)
        pg = pg * tis_w
    return pg, clipped, dual, tis_w


def _offpolicy_loss(logp, adv, behav_logp, o: LossOptions):
    """The loss of a retrieved token trained off-policy and its weight: -A p / (p + gamma) ("shaped"), or
    -A w logp with w = sg(min(exp(logp - behav), is_cap)) ("truncated"); (None, None) for "none"."""
    if o.offpolicy_train == "shaped":
        p = torch.exp(logp)
        off_w = p / (p + o.gamma)
        return -adv * off_w, off_w
    if o.offpolicy_train == "truncated":
        lw = torch.clamp(logp.detach() - behav_logp.detach().to(logp.dtype), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        off_w = torch.clamp(torch.exp(lw), max=o.is_cap)
        return -adv * off_w * logp, off_w
    return None, None


def _as_rows(x: torch.Tensor | None, cu: list[int] | None, width: int, fill=0) -> torch.Tensor | None:
    """Flat [N, ...] -> padded [S, width, ...] (rows = cu_seqlens segments); padded input is returned unchanged."""
    if x is None or cu is None:
        return x
    out = x.new_full((len(cu) - 1, width) + tuple(x.shape[1:]), fill)
    for s in range(len(cu) - 1):
        out[s, : cu[s + 1] - cu[s]] = x[cu[s] : cu[s + 1]]
    return out


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp_min(1)


@dataclass
class _Rows:
    """rapo_loss_ref's per-token inputs as padded rows [S, width] (valid: positions inside a row's segment)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    old: torch.Tensor
    adv: torch.Tensor
    behav: torch.Tensor | None
    ref: torch.Tensor | None
    lm: torch.Tensor
    ret: torch.Tensor
    resp: torch.Tensor
    width: int


def _padded_rows(
    logp, entropy, old_logp, advantages, behav_logp, ref_logp, loss_mask, retrieved_mask, response_mask, cu_seqlens
) -> _Rows:
    """Padded [B, T] inputs as they are; flat [N] inputs padded segment by segment (a Python loop), with one
    advantage per segment broadcast over it."""
    flat = logp.dim() == 1
    if flat:
        cu = [0, logp.shape[0]] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
        width = max([b - a for a, b in zip(cu[:-1], cu[1:])] + [0])
        valid = _as_rows(torch.ones_like(logp, dtype=torch.bool), cu, width, False)
        if advantages.shape != logp.shape:  # one advantage per segment
            seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
            advantages = advantages[seg.to(advantages.device)]
    else:
        cu, width = None, logp.shape[-1]
        valid = torch.ones_like(logp, dtype=torch.bool)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(logp)
    rows = lambda x, fill=0: _as_rows(x, cu, width, fill)  # noqa: E731
    return _Rows(
        logp=rows(logp),
        entropy=rows(entropy),
        old=rows(old_logp),
        adv=rows(advantages),
        behav=rows(behav_logp),
        ref=rows(ref_logp),
        lm=rows(loss_mask != 0, False) & valid,
        ret=valid & (rows(retrieved_mask != 0, False) if retrieved_mask is not None else torch.zeros_like(valid)),
        resp=valid & (rows(response_mask != 0, False) if response_mask is not None else valid),
        width=width,
    )


def rapo_loss_ref(
    logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    *,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    retrieved_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    behav_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    global_num_tokens=None,
    options: LossOptions | None = None,
    **option_kwargs: Any,
):
    """The spec of rapo_fast.rapo_loss (same arguments and meaning; the options are LossOptions', checked by it, and
    nothing else is validated). Either `logp` (and `entropy` when entropy_coef != 0) shaped like targets, or logits
    [..., V] / hidden [..., H] + weight [V, H] with targets. Returns a 0-dim loss, or (loss, metrics)."""
    o = LossOptions.from_call(options, option_kwargs, caller="rapo_loss_ref")
    if logp is None:
        if logits is not None:
            logp, entropy = token_logprobs_ref(logits, targets, o.temperature, True)
        else:
            logp, entropy = linear_token_logprobs_ref(hidden, weight, targets, bias, o.temperature, True)
    r = _padded_rows(
        logp, entropy, old_logp, advantages, behav_logp, ref_logp, loss_mask, retrieved_mask, response_mask, cu_seqlens
    )
    on = r.lm & ~r.ret
    off = r.lm & r.ret if o.offpolicy_train != "none" else torch.zeros_like(on)
    active = on | off
    scale, seq_lr = _row_ratio_terms(r, on, o)
    tok, terms = policy_token_loss_ref(
        r.logp,
        r.old,
        r.adv,
        on_mask=on,
        off_mask=off,
        ratio_scale=scale,
        seq_log_ratio=seq_lr,
        behav_logp=r.behav,
        ref_logp=r.ref,
        entropy=r.entropy,
        options=o,
    )
    tok = torch.where(active, tok, torch.zeros_like(tok))
    loss = _agg_loss(tok, active, o.loss_agg, global_num_tokens, r.width)
    if not o.return_metrics:
        return loss
    return loss, _metrics_ref(terms, r, on, off, active, o)


def _row_ratio_terms(r: _Rows, on: torch.Tensor, o: LossOptions):
    """Per row: the shaping scale 1 + m F_s ([S, 1]) and, for GSPO, the mean on-policy log-ratio ([S, T], detached)."""
    cd = r.logp.dtype
    frac = r.ret.sum(-1).to(cd) / r.resp.sum(-1).clamp_min(1).to(cd)
    scale = (1.0 + o.shaping_m * frac)[:, None]
    seq_lr = None
    if o.importance_sampling_level == "sequence":
        lr = torch.where(on, r.logp.detach() - r.old.to(cd), torch.zeros_like(r.logp))
        seq_lr = (lr.sum(-1) / on.sum(-1).clamp_min(1).to(cd))[:, None].expand_as(r.logp)
    return scale, seq_lr


def _agg_loss(tok: torch.Tensor, active: torch.Tensor, loss_agg: str, global_num_tokens, width: int) -> torch.Tensor:
    """verl's agg_loss (the version with global normalisers), with the mask = tokens in the loss."""
    cd = tok.dtype
    g = None if global_num_tokens is None else torch.as_tensor(global_num_tokens, dtype=cd, device=tok.device)
    if loss_agg == "token-mean":
        return tok.sum() / (g if g is not None else active.sum().clamp_min(1).to(cd))
    if loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        n = active.sum(-1)
        seq = tok.sum(-1)
        if loss_agg == "seq-mean-token-mean":
            seq = seq / n.clamp_min(1).to(cd)
        nonempty = n > 0
        return torch.where(nonempty, seq, torch.zeros_like(seq)).sum() / (
            g if g is not None else nonempty.sum().clamp_min(1).to(cd)
        )
    if loss_agg == "seq-mean-token-sum-norm":
        return tok.sum() / (g if g is not None else torch.tensor(float(max(width, 1)), dtype=cd))
    raise ValueError(f"loss_agg: expected a known mode, got {loss_agg!r}")


def _metrics_ref(terms: dict, r: _Rows, on, off, active, o: LossOptions) -> dict[str, torch.Tensor]:
    cd = r.logp.dtype

    def mean(x, m):
        return _masked_mean(x.to(cd), m).detach()

    return {
        "clip_frac_high": mean(terms["clipped_high"], on),
        "clip_frac_low": mean(terms["clipped_low"], on),
        "dual_clip_frac": mean(terms["dual_clipped"], on),
        "ratio_mean": mean(terms["ratio"].expand_as(r.logp), on),
        "approx_kl": mean(terms["approx_kl"], on),
        "kl": mean(terms["kl"], active) if "kl" in terms else torch.zeros((), dtype=cd),
        "entropy": mean(r.entropy, active) if r.entropy is not None else torch.full((), float("nan"), dtype=cd),
        "retrieved_frac": (r.ret.sum().to(cd) / r.resp.sum().clamp_min(1).to(cd)),
        "tis_weight_mean": mean(terms["tis_weight"], on) if "tis_weight" in terms else torch.ones((), dtype=cd),
        "offpolicy_weight_mean": (
            mean(terms["offpolicy_weight"], off) if "offpolicy_weight" in terms else torch.zeros((), dtype=cd)
        ),
        "num_tokens": active.sum().to(cd),
        "num_offpolicy_tokens": off.sum().to(cd),
    }
