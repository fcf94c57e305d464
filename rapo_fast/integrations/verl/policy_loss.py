"""verl adapter: a RAPO policy loss with verl's policy-loss registry signature.

What it is:
- `rapo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)`,
  the signature of verl's `PolicyLossFn` (verl/trainer/ppo/core_algos.py: `register_policy_loss`, `agg_loss`,
  `compute_policy_loss_vanilla`), returning `(pg_loss, pg_metrics)` like verl's vanilla loss. With retrieval off it
  equals verl's vanilla loss (PPO clip with clip_ratio_low/high, dual clip with clip_ratio_c, log-ratio clamped to
  +-20, `agg_loss` with `config.global_batch_info`: dp_size, batch_num_tokens, global_batch_size, loss_scale_factor).
  Keyword-only extras (retrieved_mask, shaping_m, offpolicy_train, ...) add RAPO's importance shaping and off-policy
  tokens for callers that have them (verl's own actor passes only the registry arguments).
  `register_rapo_policy_loss(name, **options)` registers it (with fixed RAPO options) in verl's registry; the verl
  plugin (rapo_fast/integrations/verl/plugin.py) registers "rapo" when verl loads its plugins.

What it is not: a verl actor or trainer, and not the fused logits->loss kernel: verl's registry hands the loss
log-probs that are already computed, so the loss here is `rapo_fast.loss.policy_loss_from_logp` on those log-probs
(rapo_loss after its log-prob step: the per-token policy-loss kernel over [B, T], with rapo_loss's validation); the
fused log-prob helpers are in rapo_fast/integrations/verl/logprobs.py. Importing this module imports no verl.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from rapo_fast.loss.options import LossOptions
from rapo_fast.loss.policy_loss import policy_loss_from_logp

__all__ = [
    "rapo_policy_loss",
    "register_rapo_policy_loss",
    "verl_normaliser",
]

VERL_LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# The LossOptions fields a verl caller may set; the clip and aggregation options come from verl's config.
_RAPO_KEYWORDS = ("shaping_m", "offpolicy_train", "gamma", "is_cap", "tis_cap", "importance_sampling_level")


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    """Read an option from verl's ActorConfig (attributes, `.get`) or a plain mapping / DictConfig."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get"):
        try:
            value = config.get(name, default)
        except (KeyError, AttributeError, TypeError):
            value = None
    return default if value is None else value


def verl_normaliser(
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
) -> tuple[str, torch.Tensor, int]:
    """verl's `agg_loss` as (rapo loss_agg, global normaliser, dp_size): loss = agg(loss_agg, normaliser) * dp_size.

    token-mean: masked sum / batch_num_tokens (default: this micro-batch's token count); token-sum: masked sum;
    seq-mean-token-sum / -mean: per-row sum or mean over non-empty rows / global_batch_size (default: the number of
    non-empty rows); seq-mean-token-sum-norm: the seq-mean-token-sum value / loss_scale_factor (default: T).
    Raises ValueError for an unknown mode or for dp_size > 1 without the global count, as verl does.
    """
    mask = loss_mask.bool()
    if loss_agg_mode not in VERL_LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: expected one of {list(VERL_LOSS_AGG_MODES)}, got {loss_agg_mode!r}")
    dev = loss_mask.device
    if loss_agg_mode in ("token-mean", "token-sum"):
        if loss_agg_mode == "token-sum":
            g = torch.ones((), dtype=torch.float32, device=dev)
        elif batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            g = mask.sum().clamp_min(1).float()
        else:
            g = torch.as_tensor(batch_num_tokens, dtype=torch.float32, device=dev)
        return "token-mean", g, dp_size
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        n_seq = mask.any(-1).sum().clamp_min(1).float()
    else:
        n_seq = torch.as_tensor(global_batch_size, dtype=torch.float32, device=dev)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        factor = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        # Sum over tokens / (sequences * factor): one token-mean normaliser gives the same number.
        return "token-mean", n_seq * float(factor), dp_size
    return loss_agg_mode, n_seq, dp_size


def rapo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    rollout_log_probs: torch.Tensor | None = None,
    retrieved_mask: torch.Tensor | None = None,
    **rapo_options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """RAPO policy loss with verl's `PolicyLossFn` signature; returns (pg_loss, pg_metrics) as verl's vanilla loss.

    Args:
        old_log_prob, log_prob, advantages, response_mask: [B, T] (log_prob carries the gradient).
        loss_agg_mode: verl's mode, one of VERL_LOSS_AGG_MODES.
        config: verl's ActorConfig (or a mapping): clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c (3.0),
            global_batch_info (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor), and, for the older
            rollout_log_probs interface, tis_imp_ratio_cap.
        rollout_is_weights: [B, T] detached rollout-correction weights (>= 0) multiplying each token's policy loss,
            applied by scaling the advantages (the clipped surrogate is linear in A for a non-negative weight).
        rollout_log_probs: older verl interface: behaviour log-probs; with config.tis_imp_ratio_cap > 0 they give
            truncated IS min(exp(old - rollout), cap).
        retrieved_mask: [B, T] tokens inserted by retrieval (RAPO); excluded from the loss unless offpolicy_train.
        rapo_options: shaping_m, offpolicy_train, gamma, is_cap, tis_cap, importance_sampling_level (fields of
            rapo_fast.loss.options.LossOptions).
    Metrics (floats, verl's keys): actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower, plus rapo/ratio_mean and
    rapo/retrieved_frac.
    """
    _check_rapo_options(rapo_options, "rapo_policy_loss")
    eps_low, eps_high, clip_ratio_c = _clip_ratios(config)
    loss_agg, g, dp_size = _verl_aggregation(config, response_mask, loss_agg_mode)
    adv = advantages if rollout_is_weights is None else advantages * rollout_is_weights.detach()
    behav, rapo_options = _behaviour_logp(config, rollout_log_probs, rapo_options)
    opts = LossOptions(eps_low=eps_low, eps_high=eps_high, dual_clip=clip_ratio_c, loss_agg=loss_agg,
                       return_metrics=True, **rapo_options)  # fmt: skip
    loss, m = policy_loss_from_logp(
        log_prob,
        old_logp=old_log_prob,
        advantages=adv,
        loss_mask=response_mask.bool(),
        retrieved_mask=None if retrieved_mask is None else retrieved_mask.bool(),
        response_mask=response_mask.bool(),
        behav_logp=behav,
        global_num_tokens=g,
        options=opts,
    )
    return loss * dp_size, _verl_metrics(m)


def _check_rapo_options(options: Mapping[str, Any], caller: str) -> None:
    unknown = sorted(set(options) - set(_RAPO_KEYWORDS))
    if unknown:
        raise TypeError(f"{caller}: unknown option(s) {unknown}; expected some of {list(_RAPO_KEYWORDS)}")


def _clip_ratios(config: Any) -> tuple[float, float, float]:
    """(eps_low, eps_high, dual clip c) from verl's clip_ratio, clip_ratio_low / _high and clip_ratio_c."""
    clip_ratio = _cfg(config, "clip_ratio", 0.2)
    eps_low = float(_cfg(config, "clip_ratio_low", clip_ratio))
    eps_high = float(_cfg(config, "clip_ratio_high", clip_ratio))
    clip_ratio_c = float(_cfg(config, "clip_ratio_c", 3.0))
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c: the dual-clip bound must be > 1.0, got {clip_ratio_c}")
    return eps_low, eps_high, clip_ratio_c


def _verl_aggregation(config: Any, response_mask: torch.Tensor, loss_agg_mode: str) -> tuple[str, torch.Tensor, int]:
    """verl_normaliser with config.global_batch_info's counts."""
    info = dict(_cfg(config, "global_batch_info", {}) or {})
    return verl_normaliser(
        response_mask,
        loss_agg_mode,
        dp_size=int(info.get("dp_size", 1) or 1),
        batch_num_tokens=info.get("batch_num_tokens"),
        global_batch_size=info.get("global_batch_size"),
        loss_scale_factor=info.get("loss_scale_factor"),
    )


def _behaviour_logp(
    config: Any, rollout_log_probs: torch.Tensor | None, rapo_options: Mapping[str, Any]
) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """The behaviour log-probs the options need (and the options, with tis_cap from config.tis_imp_ratio_cap when the
    older rollout_log_probs interface asks for truncated IS and the caller set none)."""
    opts = dict(rapo_options)
    cap = _cfg(config, "tis_imp_ratio_cap", 0.0)
    if rollout_log_probs is not None and cap and float(cap) > 0:
        opts.setdefault("tis_cap", float(cap))
        return rollout_log_probs, opts
    if opts.get("tis_cap") is not None or opts.get("offpolicy_train") == "truncated":
        if rollout_log_probs is None:
            raise ValueError("rollout_log_probs: required with tis_cap or offpolicy_train='truncated'")
        return rollout_log_probs, opts
    return None, opts


def _verl_metrics(m: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """rapo_loss's metrics under verl's keys (floats: one host sync, as verl's own loss does)."""
    return {
        "actor/pg_clipfrac": (m["clip_frac_high"] + m["clip_frac_low"]).item(),
        "actor/ppo_kl": m["approx_kl"].item(),
        "actor/pg_clipfrac_lower": m["dual_clip_frac"].item(),
        "rapo/ratio_mean": m["ratio_mean"].item(),
        "rapo/retrieved_frac": m["retrieved_frac"].item(),
    }


def register_rapo_policy_loss(name: str = "rapo", **options: Any) -> Callable[..., Any]:
    """Register `rapo_policy_loss` (with `options` bound, e.g. shaping_m) in verl's policy-loss registry.

    Returns the registered function. Raises ImportError when verl is not installed.
    """
    from verl.trainer.ppo.core_algos import register_policy_loss

    _check_rapo_options(options, "register_rapo_policy_loss")

    def policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
        **kwargs,
    ):
        return rapo_policy_loss(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            config,
            rollout_is_weights,
            **{**options, **kwargs},
        )

    policy_loss.__name__ = f"rapo_policy_loss_{name}"
    policy_loss.__doc__ = f"rapo_policy_loss with options {options!r} (registered as {name!r})."
    return register_policy_loss(name)(policy_loss)
