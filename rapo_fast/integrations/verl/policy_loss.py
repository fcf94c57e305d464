"""verl adapter: a RAPO policy loss with verl's policy-loss registry signature.

What it is: `rapo_policy_loss` (verl's `PolicyLossFn` signature; with retrieval off it equals verl's vanilla loss),
its registration (`register_rapo_policy_loss` / `register()`), and `rapo_token_fields` / `current_rapo_fields`, which
carry the micro-batch's fields that actor_loss.py sets. Options and the registered losses: docs/verl.md section 3.
What it is not: a verl actor or trainer, and not the fused logits->loss kernel: verl hands the loss log-probs already
computed, so the loss is `rapo_fast.loss.policy_loss_from_logp` on them. Importing this module imports no verl.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from rapo_fast.integrations.verl import verl_compat
from rapo_fast.loss.options import LossOptions
from rapo_fast.loss.policy_loss import LossMetrics, policy_loss_from_logp

__all__ = [
    "rapo_policy_loss",
    "make_rapo_registry_loss",
    "register_rapo_policy_loss",
    "verl_normaliser",
    "RapoTokenFields",
    "current_rapo_fields",
    "rapo_token_fields",
    "POLICY_LOSSES",
    "register",
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
# Options of the adapter itself (not LossOptions fields passed through).
_ADAPTER_KEYWORDS = ("dual_clip",)
DUAL_CLIP_FROM_CONFIG = "config"


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
                raise ValueError("batch_num_tokens: expected the (global) count with dp_size > 1, got None")
            g = mask.sum().clamp_min(1).float()
        else:
            g = torch.as_tensor(batch_num_tokens, dtype=torch.float32, device=dev)
        return "token-mean", g, dp_size
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size: expected one with dp_size > 1, got None")
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
    trajectory_mask: torch.Tensor | None = None,
    dual_clip: float | str | None = DUAL_CLIP_FROM_CONFIG,
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
        trajectory_mask: [B, T] every response token of the trajectory (model, tool, retrieved): F's denominator, as
            rapo_fast's trainer counts it. Default: response_mask (right only when there are no tool tokens).
        dual_clip: "config" (verl: c = config.clip_ratio_c), None (no dual clip, as rapo_fast's RAPO preset), or c > 1.
        rapo_options: shaping_m, offpolicy_train, gamma, is_cap, tis_cap, importance_sampling_level (fields of
            rapo_fast.loss.options.LossOptions).
    Metrics (floats, verl's keys): actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower, plus rapo/ratio_mean and
    rapo/retrieved_frac.
    """
    _check_rapo_options(rapo_options, "rapo_policy_loss")
    eps_low, eps_high, clip_ratio_c = _clip_ratios(config, dual_clip)
    if trajectory_mask is not None and tuple(trajectory_mask.shape) != tuple(response_mask.shape):
        raise ValueError(
            f"trajectory_mask: expected shape {tuple(response_mask.shape)} (response_mask's), "
            f"got {tuple(trajectory_mask.shape)}"
        )
    f_denominator = response_mask if trajectory_mask is None else trajectory_mask
    loss_agg, g, dp_size = _verl_aggregation(config, response_mask, loss_agg_mode)
    adv = advantages if rollout_is_weights is None else advantages * rollout_is_weights.detach()
    behav, rapo_options = _behaviour_logp(config, rollout_log_probs, rapo_options)
    opts = LossOptions(
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=clip_ratio_c,
        loss_agg=loss_agg,
        return_metrics=True,
        **rapo_options,
    )
    loss, m = policy_loss_from_logp(
        log_prob,
        old_logp=old_log_prob,
        advantages=adv,
        loss_mask=response_mask.bool(),
        retrieved_mask=None if retrieved_mask is None else retrieved_mask.bool(),
        response_mask=f_denominator.bool(),
        behav_logp=behav,
        global_num_tokens=g,
        options=opts,
    )
    return loss * dp_size, _verl_metrics(m)


def _check_rapo_options(options: Mapping[str, Any], caller: str, extra: tuple[str, ...] = ()) -> None:
    allowed = _RAPO_KEYWORDS + extra
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"{caller}: unknown option(s) {unknown}; expected some of {list(allowed)}")


def _clip_ratios(
    config: Any, dual_clip: float | str | None = DUAL_CLIP_FROM_CONFIG
) -> tuple[float, float, float | None]:
    """(eps_low, eps_high, dual clip c or None) from verl's clip_ratio, clip_ratio_low / _high and, with
    dual_clip="config", clip_ratio_c (verl's vanilla loss always applies it)."""
    clip_ratio = _cfg(config, "clip_ratio", 0.2)
    eps_low = float(_cfg(config, "clip_ratio_low", clip_ratio))
    eps_high = float(_cfg(config, "clip_ratio_high", clip_ratio))
    if dual_clip is None:
        return eps_low, eps_high, None
    if isinstance(dual_clip, str):
        if dual_clip != DUAL_CLIP_FROM_CONFIG:
            raise ValueError(f"dual_clip: expected {DUAL_CLIP_FROM_CONFIG!r}, None or a float > 1, got {dual_clip!r}")
        clip_ratio_c = float(_cfg(config, "clip_ratio_c", 3.0))
        if not clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c: expected a dual-clip bound > 1.0, got {clip_ratio_c}")
        return eps_low, eps_high, clip_ratio_c
    if isinstance(dual_clip, bool) or not isinstance(dual_clip, (int, float)) or not float(dual_clip) > 1.0:
        raise ValueError(f"dual_clip: expected {DUAL_CLIP_FROM_CONFIG!r}, None or a float > 1, got {dual_clip!r}")
    return eps_low, eps_high, float(dual_clip)


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
            raise ValueError("rollout_log_probs: expected them with tis_cap or offpolicy_train='truncated', got None")
        return rollout_log_probs, opts
    return None, opts


def _verl_metrics(m: LossMetrics) -> dict[str, float]:
    """rapo_loss's metrics under verl's keys (floats: one host sync, as verl's own loss does)."""
    return {
        "actor/pg_clipfrac": (m.clip_frac_high + m.clip_frac_low).item(),
        "actor/ppo_kl": m.approx_kl.item(),
        "actor/pg_clipfrac_lower": m.dual_clip_frac.item(),
        "rapo/ratio_mean": m.ratio_mean.item(),
        "rapo/retrieved_frac": m.retrieved_frac.item(),
        "rapo/clip_frac_high": m.clip_frac_high.item(),
        "rapo/clip_frac_low": m.clip_frac_low.item(),
        "rapo/approx_kl": m.approx_kl.item(),
    }


RETRIEVED_MASK_KEY = "rapo_retrieved_mask"
F_RET_KEY = "rapo_f_ret"
F_RET_ATOL = 1e-5  # the agent loop's F (a float) against the one recomputed from the mask

_CURRENT: ContextVar[RapoTokenFields | None] = ContextVar("rapo_verl_token_fields", default=None)
# Whether the call runs inside the actor-loss route (rapo_token_fields), to tell "no retrieval in this micro-batch"
# from "the route is not installed" (then the registered loss warns once: F would silently be 0).
_IN_ROUTE: ContextVar[bool] = ContextVar("rapo_verl_in_route", default=False)
_warned_no_route = False


@dataclass(frozen=True)
class RapoTokenFields:
    """The RAPO fields of one micro-batch: per row the retrieved flags (one per response token) and the response
    length (model + tool + retrieved tokens, from verl's `responses`), and the agent loop's F if it sent one."""

    retrieved: tuple[tuple[int, ...], ...]
    response_lens: tuple[int, ...]
    f_ret: tuple[float, ...] | None = None

    def loss_kwargs(self, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"retrieved_mask", "trajectory_mask"} as [B, T] bool tensors on response_mask's device (T = its width).

        Raises ValueError when the rows do not match response_mask, a retrieved token is in response_mask (it must be
        0 there: no gradient), or the agent loop's F disagrees with the mask.
        """
        B, T = response_mask.shape
        if len(self.retrieved) != B:
            raise ValueError(f"{RETRIEVED_MASK_KEY}: expected {B} rows (response_mask's), got {len(self.retrieved)}")
        if self.response_lens and max(self.response_lens) > T:
            raise ValueError(f"responses: expected at most T = {T} tokens, got one of {max(self.response_lens)}")
        retrieved = torch.zeros(B, T, dtype=torch.bool)
        for i, row in enumerate(self.retrieved):
            retrieved[i, : len(row)] = torch.as_tensor(row, dtype=torch.bool) if row else False
        lens = torch.as_tensor(self.response_lens, dtype=torch.int64)
        trajectory = torch.arange(T)[None, :] < lens[:, None]
        retrieved, trajectory = retrieved.to(response_mask.device), trajectory.to(response_mask.device)
        if bool((retrieved & response_mask.bool()).any()):
            raise ValueError(f"{RETRIEVED_MASK_KEY}: expected retrieved tokens at response_mask 0, got one at 1")
        if self.f_ret is not None:
            f = retrieved.sum(1).double().cpu() / lens.clamp_min(1).double()
            got = torch.as_tensor(self.f_ret, dtype=torch.float64)
            if not torch.allclose(f, got, atol=F_RET_ATOL, rtol=0):
                raise ValueError(
                    f"{F_RET_KEY}: expected retrieved / response tokens per row {f.tolist()}, got {got.tolist()}"
                )
        return {"retrieved_mask": retrieved, "trajectory_mask": trajectory}


@contextmanager
def rapo_token_fields(fields: RapoTokenFields | None) -> Iterator[None]:
    """Make `fields` the micro-batch fields the registered RAPO policy loss reads while the block runs."""
    token, route = _CURRENT.set(fields), _IN_ROUTE.set(True)
    try:
        yield
    finally:
        _IN_ROUTE.reset(route)
        _CURRENT.reset(token)


def current_rapo_fields() -> RapoTokenFields | None:
    """The RAPO fields of the micro-batch whose loss is being computed (set by actor_loss.rapo_ppo_loss), or None."""
    return _CURRENT.get()


def _warn_no_route(name: str) -> None:
    global _warned_no_route
    if not _warned_no_route:
        _warned_no_route = True
        warnings.warn(
            f"rapo_fast: policy loss {name!r} called outside rapo_fast's actor-loss route (actor_loss.register() or "
            "set_loss_fn(partial(actor_loss.rapo_ppo_loss, ...)) not installed): no retrieved mask reaches it, so "
            "the shaping's F is 0 (the loss is verl's vanilla one)",
            stacklevel=3,
        )


def make_rapo_registry_loss(name: str = "rapo", **options: Any) -> Callable[..., Any]:
    """`rapo_policy_loss` with `options` bound, as a function of verl's `PolicyLossFn` signature (no verl import).

    When the caller passes no `retrieved_mask` (verl's ppo_loss never does), the function takes the retrieved mask
    and the trajectory mask of the current micro-batch from `actor_loss.current_rapo_fields()` (set by
    `actor_loss.rapo_ppo_loss` around verl's ppo_loss); with none set, the batch has no retrieval (F = 0).
    """
    _check_rapo_options(options, "make_rapo_registry_loss", _ADAPTER_KEYWORDS)

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
        kw = {**options, **kwargs}
        if kw.get("retrieved_mask") is None:
            fields = current_rapo_fields()
            if fields is not None:
                kw.update(fields.loss_kwargs(response_mask))
            elif not _IN_ROUTE.get():
                _warn_no_route(name)
        return rapo_policy_loss(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, **kw
        )

    policy_loss.__name__ = f"rapo_policy_loss_{name}"
    policy_loss.__doc__ = f"rapo_policy_loss with options {options!r} (registered as {name!r})."
    return policy_loss


def register_rapo_policy_loss(name: str = "rapo", **options: Any) -> Callable[..., Any]:
    """Register `make_rapo_registry_loss(name, **options)` in verl's policy-loss registry under `name`.

    options: shaping_m, offpolicy_train, gamma, is_cap, tis_cap, importance_sampling_level, dual_clip. Returns the
    registered function. Registering a name again replaces it (verl's registry allows that). Raises ImportError
    when verl is not installed.
    """
    register_policy_loss = verl_compat.get("verl.trainer.ppo.core_algos:register_policy_loss")
    _check_rapo_options(options, "register_rapo_policy_loss", _ADAPTER_KEYWORDS)
    return register_policy_loss(name)(make_rapo_registry_loss(name, **options))


# The policy losses registered: "rapo" applies verl's dual clip (config.clip_ratio_c), so that it equals verl's
# vanilla loss with retrieval off; "rapo_no_dual_clip" is rapo_fast's RAPO preset exactly (the paper has none).
RAPO_SHAPING_M = 0.05
POLICY_LOSSES: dict[str, dict[str, Any]] = {
    "rapo": {"shaping_m": RAPO_SHAPING_M, "dual_clip": "config"},
    "rapo_no_dual_clip": {"shaping_m": RAPO_SHAPING_M, "dual_clip": None},
}


def register() -> None:
    """Register POLICY_LOSSES in verl's policy-loss registry (idempotent: a name registered again is replaced)."""
    for name, options in POLICY_LOSSES.items():
        register_rapo_policy_loss(name, **options)
