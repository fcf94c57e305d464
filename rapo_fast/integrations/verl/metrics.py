"""RAPO's figures in verl's step metrics (`rapo/*`: what verl's console, file and wandb loggers get every step).

What it is: `register()` wraps the v1 trainer's `PPOTrainer._compute_advantage(batch, metrics)` and merges the
figures recorded on the driver into that step's `metrics` (`rapo/rollout/*`, `rapo/adv/*`, `rapo/buffer/*`). The
figures and their meaning: docs/verl.md section 10; the loss's take verl's actor-metric route (policy_loss.py).
What it is not: a logger (verl logs), or the legacy trainer's route (its fit loop has no method to wrap).
Importable without verl; `register()` imports it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rapo_fast.integrations.verl import verl_compat

__all__ = [
    "PREFIX",
    "record",
    "record_rows",
    "take",
    "rollout_metrics",
    "advantage_metrics",
    "buffer_metrics",
    "register",
]

PREFIX = "rapo/"
TRAINER = "verl.trainer.ppo.v1.trainer_base:PPOTrainer"
SKIPPED = ("no_result", "too_long", "no_room")  # agent_loop.SKIP_REASONS (not imported: that module needs verl)
_log = logging.getLogger(__name__)
_PENDING: dict[str, float] = {}  # recorded on the driver during a step, merged into verl's metrics at its end
_ROWS: list[tuple[Sequence[Any], Sequence[float] | None]] = []  # the step's extra_fields rows and rewards
_clients: dict[str, Any] = {}
_HELD = ("size", "payloads", "add_calls", "steps_added", "steps_dropped")  # a replica's equal its primary's
_PEAKS = {"pending_max": "pending_max", "search_ms_max": "search_ms/max"}  # stats() key -> figure, max over actors


def record(figures: Mapping[str, float]) -> None:
    """Keep `figures` (keys under `rapo/`) for this step's metrics."""
    _PENDING.update(figures)


def record_rows(rows: Sequence[Any], rewards: Sequence[float] | None) -> None:
    """Keep a training batch's extra_fields rows (and the rows' rewards) for this step's `rapo/rollout/*`."""
    _ROWS.append((list(rows), None if rewards is None else [float(r) for r in rewards]))


def take(threshold: float = 0.5) -> dict[str, float]:
    """The figures recorded since the last call, with the rollout figures of the rows recorded (and forget them)."""
    out = dict(_PENDING)
    for rows, rewards in _ROWS:
        out.update(rollout_metrics(rows, rewards, threshold))
    _PENDING.clear()
    _ROWS.clear()
    return out


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return {}
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return {f"{prefix}/mean": mean, f"{prefix}/std": std, f"{prefix}/min": min(vals), f"{prefix}/max": max(vals)}


def _frac(flags: Sequence[bool]) -> float:
    return sum(bool(f) for f in flags) / len(flags) if flags else 0.0


def rollout_metrics(rows: Sequence[Any], rewards: Sequence[float] | None = None, threshold: float = 0.5) -> dict:
    """`rapo/rollout/*` of a training batch: `rows` are the agent loops' extra_fields dicts (rows of another loop
    are ignored); `rewards` the rows' scores, for `growth_steps` (the tool steps of trajectories with reward >
    threshold: what the `rapo` reward manager adds)."""
    keep = [(i, r) for i, r in enumerate(rows) if isinstance(r, Mapping) and "rapo_hybrid" in r]
    if not keep:
        return {}
    p = PREFIX + "rollout/"
    rs = [r for _, r in keep]
    hybrid = [r for r in rs if r.get("rapo_hybrid")]
    n_ret = [int(r.get("rapo_num_retrievals", 0)) for r in rs]
    out = {
        p + "trajectories": float(len(rs)),
        p + "hybrid_frac": len(hybrid) / len(rs),
        p + "retrievals_per_traj": sum(n_ret) / len(rs),
        p + "retrievals_per_hybrid_traj": (
            sum(int(r.get("rapo_num_retrievals", 0)) for r in hybrid) / len(hybrid) if hybrid else 0.0
        ),
        p + "scored_retrievals_per_traj": sum(len(r.get("rapo_h_before") or []) for r in rs) / len(rs),
        p + "retrieved_frac": sum(float(r.get("rapo_f_ret", 0.0)) for r in rs) / len(rs),
        p + "retrieve_calls": float(sum(int(r.get("rapo_retrieve_calls", 0)) for r in rs)),
    }
    for reason in SKIPPED:
        out[p + f"skipped_{reason}"] = float(sum(int(r.get(f"rapo_skipped_{reason}", 0)) for r in rs))
    flat = lambda key: [v for r in rs for v in (r.get(key) or [])]  # noqa: E731
    out.update(_stats(p + "retrieval_score", flat("rapo_retrieval_scores")))
    out.update(_stats(p + "search_latency_ms", [1000.0 * v for v in flat("rapo_retrieve_latency_s")]))
    out.update(_stats(p + "searches_in_flight", flat("rapo_retrieve_in_flight")))
    if rewards is not None:
        grown = 0
        for i, r in keep:
            if float(rewards[i]) > threshold and not r.get("rapo_validate", True):
                spans, ends = r.get("rapo_step_spans") or [], r.get("rapo_step_obs_end") or []
                grown += sum(1 for (_, e), o in zip(spans, ends) if o != e)
        out[p + "growth_steps"] = float(grown)
    return out


def advantage_metrics(z: Any, a_ret: Any, hybrid: Sequence[bool] | None) -> dict:
    """`rapo/adv/*`: Z and A_ret (per row, [B]) statistics; with the rows' hybrid flags, the fraction of hybrid and of
    non-hybrid rows with Z != 0 and with A_ret != 0."""
    p = PREFIX + "adv/"
    z, a_ret = [float(v) for v in z], [float(v) for v in a_ret]
    out = {**_stats(p + "z", z), **_stats(p + "a_ret", a_ret), p + "z_nonzero_frac": _frac([v != 0 for v in z])}
    out[p + "a_ret_nonzero_frac"] = _frac([v != 0 for v in a_ret])
    if hybrid is not None and len(hybrid) == len(z):
        for name, want in (("hybrid", True), ("non_hybrid", False)):
            rows = [i for i, h in enumerate(hybrid) if bool(h) is want]
            out[p + f"z_nonzero_frac/{name}"] = _frac([z[i] != 0 for i in rows])
            out[p + f"a_ret_nonzero_frac/{name}"] = _frac([a_ret[i] != 0 for i in rows])
    return out


def buffer_metrics(stats: Sequence[Mapping[str, Any]]) -> dict:
    """`rapo/buffer/*` from each actor's `stats()`: the numbers summed over the actors, except what a replica holds
    (its primary's steps again: counted once), the peaks (the most over the actors), and `search_ms/mean` (over the
    step's queries, from search_ms_sum)."""
    p = "rapo/buffer/"
    replicas = sum(s.get("role") == "replica" for s in stats)
    out: dict[str, float] = {p + "shards": float(len(stats) - replicas), p + "replicas": float(replicas)}
    for actor in stats:
        for key, value in actor.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key in _HELD and actor.get("role") == "replica":
                continue
            if key in _PEAKS:
                out[p + _PEAKS[key]] = max(out.get(p + _PEAKS[key], 0.0), float(value))
            else:
                out[p + key] = out.get(p + key, 0.0) + float(value)
    total = out.pop(p + "search_ms_sum", 0.0)
    if out.get(p + "step_queries", 0.0) > 0:
        out[p + "search_ms/mean"] = total / out[p + "step_queries"]
    else:  # no search this step: no search time to report
        out.pop(p + "search_ms/max", None)
    return out


def _buffer_stats(config: Any) -> dict:
    """The job's buffer counters, or {} when it has none (a job without the step buffer)."""
    from rapo_fast.integrations.verl.buffer_actor import DEFAULT_NAME, get_step_buffer

    rapo = config.get("rapo", None) or {}
    name = rapo.get("buffer_name", None) or (rapo.get("step_buffer", None) or {}).get("name", None) or DEFAULT_NAME
    try:
        client = _clients.get(name) or _clients.setdefault(name, get_step_buffer(name))
        return buffer_metrics(client.stats())
    except ValueError:  # no such actor: this job runs without a buffer
        return {}


def _wrap_compute_advantage(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "_rapo_wrapped", False):
        return fn

    @functools.wraps(fn)
    def _compute_advantage(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any):
        take()  # figures of another call (e.g. a validation batch) are not this step's
        out = fn(self, batch, metrics, *args, **kwargs)
        rapo = self.config.get("rapo", None) or {}
        figures = take(float(rapo.get("onpolicy_reward_threshold", 0.5)))
        if figures:  # a RAPO job (the estimator or the loop recorded something): its buffer too
            figures.update(_buffer_stats(self.config))
        metrics.update(figures)
        return out

    _compute_advantage._rapo_wrapped = True  # type: ignore[attr-defined]
    return _compute_advantage


def register() -> None:
    """Wrap the v1 trainer's `_compute_advantage` so the figures recorded during it reach its metrics (idempotent;
    nothing to wrap in a verl without the v1 trainer)."""
    try:
        trainer = verl_compat.get(TRAINER)
    except ImportError:
        return
    trainer._compute_advantage = _wrap_compute_advantage(trainer._compute_advantage)
