"""The "rapo" advantage estimator for verl: GRPO group advantages times RAPO's retrieval factor (1 + a A_ret).

What it is: `compute_rapo_outcome_advantage` (verl's estimator signature; A_acc is verl's own GRPO advantage, called,
not restated) and `register()`. The formula and options: docs/loss.md section 8; the route: docs/verl.md section 3.
What it is not: the per-token loss (actor_loss.py, policy_loss.py) or the entropies (the agent loop records them).
Importable without verl; verl is imported inside the functions and `register()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

from rapo_fast import _checks as C
from rapo_fast.integrations.verl import metrics as rapo_metrics
from rapo_fast.integrations.verl import verl_compat
from rapo_fast.loss.advantages import RET_NORMS, group_normalize, retrieval_reward

__all__ = [
    "ESTIMATOR_NAME",
    "H_BEFORE_KEY",
    "H_AFTER_KEY",
    "retrieval_rewards_from_fields",
    "compute_rapo_outcome_advantage",
    "rapo_non_tensor_batch",
    "register",
]

ESTIMATOR_NAME = "rapo"
H_BEFORE_KEY = "rapo_h_before"
H_AFTER_KEY = "rapo_h_after"
HYBRID_KEY = "rapo_hybrid"
EXTRA_FIELDS_KEY = verl_compat.EXTRA_FIELDS_KEY
DEFAULT_RET_COEF = 0.2  # RAPO's a
DEFAULT_RET_NORM = "group"  # rapo_advantages' default: the paper's formula as written (docs/loss.md section 8)
TQ_TRAIN_PARTITION = verl_compat.TQ_TRAIN_PARTITION

_NON_TENSOR: ContextVar[Mapping[str, Any] | None] = ContextVar("rapo_verl_non_tensor_batch", default=None)


def _cfg(config: Any, name: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping) or hasattr(config, "get"):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _field_rows(non_tensor_batch: Mapping[str, Any], key: str, batch_size: int) -> list[Any] | None:
    """Per-row values of `key`: a non_tensor_batch key (legacy trainer) or a key of each row's extra_fields dict."""
    if key in non_tensor_batch:
        rows = list(non_tensor_batch[key])
    elif EXTRA_FIELDS_KEY in non_tensor_batch:
        extra = list(non_tensor_batch[EXTRA_FIELDS_KEY])
        if not all(isinstance(e, Mapping) for e in extra):
            return None
        rows = [e.get(key) for e in extra]
        if all(r is None for r in rows):
            return None
    else:
        return None
    if len(rows) != batch_size:
        raise ValueError(f"{key}: expected {batch_size} rows (token_level_rewards'), got {len(rows)}")
    return rows


def retrieval_rewards_from_fields(non_tensor_batch: Mapping[str, Any] | None, batch_size: int) -> torch.Tensor | None:
    """Z [B] fp64 (rapo_fast's retrieval_reward of each row's rapo_h_before / rapo_h_after lists; 0 for a row with
    none), or None when the batch carries no such fields. Raises ValueError when a row's two lists differ in length."""
    out = _retrieval_fields(non_tensor_batch, batch_size)
    return None if out is None else out[0]


def _retrieval_fields(
    non_tensor_batch: Mapping[str, Any] | None, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(Z [B] fp64, scored [B] bool: the rows with at least one scored retrieval) or None: retrieval_rewards_from_fields
    with the rows ret_norm="retrieved" normalises over."""
    if non_tensor_batch is None:
        return None
    before = _field_rows(non_tensor_batch, H_BEFORE_KEY, batch_size)
    after = _field_rows(non_tensor_batch, H_AFTER_KEY, batch_size)
    if before is None and after is None:
        return None
    if before is None or after is None:
        raise ValueError(f"{H_BEFORE_KEY}/{H_AFTER_KEY}: expected both fields, got only one")
    before = [list(b) if b is not None else [] for b in before]
    after = [list(a) if a is not None else [] for a in after]
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if len(b) != len(a):
            raise ValueError(
                f"{H_BEFORE_KEY}/{H_AFTER_KEY}: row {i}: expected equal lengths, got {len(b)} and {len(a)}"
            )
    R = max([1] + [len(b) for b in before])
    hb = torch.full((batch_size, R), float("nan"), dtype=torch.float64)
    ha = hb.clone()
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if b:
            hb[i, : len(b)] = torch.as_tensor(b, dtype=torch.float64)
            ha[i, : len(a)] = torch.as_tensor(a, dtype=torch.float64)
    # the agent loop records one pair per retrieval with a step after it: a non-empty list is a measured Z, as the
    # trainer's retrieved = (scored retrievals > 0)
    scored = torch.tensor([len(b) > 0 for b in before], dtype=torch.bool)
    return retrieval_reward(hb, ha), scored


def _group_ids(index: Any) -> torch.Tensor:
    """verl's `index` (uid labels, any hashable) as int64 group ids, in order of first appearance."""
    ids: dict[Any, int] = {}
    return torch.as_tensor([ids.setdefault(k, len(ids)) for k in list(index)], dtype=torch.int64)


def compute_rapo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    non_tensor_batch: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RAPO advantages [B, T] (returned twice, as verl's GRPO estimator returns (advantages, returns)).

    token_level_rewards, response_mask: [B, T]; index: [B] prompt uids (the groups). norm_adv_by_std_in_grpo: None
    reads config.norm_adv_by_std_in_grpo (default True), as verl's trainer passes it to GRPO. config.rapo_ret_coef
    (default 0.2) is a; config.rapo_ret_norm ("group", the default, or "retrieved") is rapo_advantages' ret_norm, the
    rows A_ret is normalised over (checked before any work: ValueError/TypeError naming it). non_tensor_batch: the
    rows' "rapo_h_before"/"rapo_h_after" (or "extra_fields" dicts holding them); None reads the context set by
    `rapo_non_tensor_batch` (the wrapped verl trainer sets it). Other keyword arguments verl passes (e.g. batch,
    reward_baselines) are ignored.
    """
    compute_grpo_outcome_advantage = verl_compat.get("verl.trainer.ppo.core_algos:compute_grpo_outcome_advantage")

    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards: expected [B, T], got shape {tuple(token_level_rewards.shape)}")
    ret_norm = C.check_choice("algorithm.rapo_ret_norm", _cfg(config, "rapo_ret_norm", DEFAULT_RET_NORM), RET_NORMS)
    norm = (
        bool(_cfg(config, "norm_adv_by_std_in_grpo", True))
        if norm_adv_by_std_in_grpo is None
        else bool(norm_adv_by_std_in_grpo)
    )
    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=index,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm,
        config=config,
    )
    fields = non_tensor_batch if non_tensor_batch is not None else _NON_TENSOR.get()
    got = _retrieval_fields(fields, token_level_rewards.shape[0])
    hybrid = None if fields is None else _field_rows(fields, HYBRID_KEY, token_level_rewards.shape[0])
    if got is None or not bool((got[0] != 0).any()):
        if got is not None:  # a RAPO batch without any retrieval reward: Z = A_ret = 0 on every row
            rapo_metrics.record(rapo_metrics.advantage_metrics(got[0], torch.zeros_like(got[0]), hybrid))
        return adv, adv  # no retrieval reward: exactly verl's GRPO
    z, scored = got
    a = float(_cfg(config, "rapo_ret_coef", DEFAULT_RET_COEF))
    groups = _group_ids(index)
    if ret_norm == "retrieved":
        # rapo_advantages' rule: the same group_normalize over the retrieving rows only, the others A_ret = 0
        rows = torch.nonzero(scored).flatten()
        a_ret = torch.zeros_like(z)
        a_ret[rows] = group_normalize(z[rows], groups[rows], epsilon)
    else:
        a_ret = group_normalize(z, groups, epsilon)
    rapo_metrics.record(rapo_metrics.advantage_metrics(z, a_ret, hybrid))
    factor = (1.0 + a * a_ret).to(adv.dtype).to(adv.device)
    adv = adv * factor[:, None]
    return adv, adv


@contextmanager
def rapo_non_tensor_batch(non_tensor_batch: Mapping[str, Any] | None) -> Iterator[None]:
    """Make `non_tensor_batch` the one the "rapo" estimator reads while the block runs."""
    token = _NON_TENSOR.set(non_tensor_batch)
    try:
        yield
    finally:
        _NON_TENSOR.reset(token)


def _is_rapo(adv_estimator: Any) -> bool:
    return getattr(adv_estimator, "value", adv_estimator) == ESTIMATOR_NAME


def _wrap_compute_advantage(fn: Callable[..., Any]) -> Callable[..., Any]:
    """verl's compute_advantage(data, adv_estimator, ...) with data.non_tensor_batch visible to "rapo"."""
    if getattr(fn, "_rapo_wrapped", False):
        return fn

    @functools.wraps(fn)
    def compute_advantage(data: Any, adv_estimator: Any, *args: Any, **kwargs: Any):
        if not _is_rapo(adv_estimator) or _NON_TENSOR.get() is not None:
            return fn(data, adv_estimator, *args, **kwargs)
        with rapo_non_tensor_batch(getattr(data, "non_tensor_batch", None)):
            return fn(data, adv_estimator, *args, **kwargs)

    compute_advantage._rapo_wrapped = True  # type: ignore[attr-defined]
    return compute_advantage


def _extra_fields_from_tq(batch_keys: list[str]) -> dict[str, Any] | None:
    """{"extra_fields": object array, one dict per key} read from TransferQueue, or None without that field."""
    kv_batch_get = verl_compat.get("transfer_queue:kv_batch_get")
    td = kv_batch_get(keys=batch_keys, partition_id=TQ_TRAIN_PARTITION, select_fields=[EXTRA_FIELDS_KEY])
    if EXTRA_FIELDS_KEY not in td.keys():
        return None
    rows = np.empty(len(batch_keys), dtype=object)
    rows[:] = list(td[EXTRA_FIELDS_KEY])
    return {EXTRA_FIELDS_KEY: rows}


def _wrap_multi_trajectories(fn: Callable[..., Any]) -> Callable[..., Any]:
    """v1's compute_advantage_for_multi_trajectories(data, batch_keys, adv_estimator, ...) with the extra_fields of
    batch_keys (from TransferQueue) visible to "rapo"."""
    if getattr(fn, "_rapo_wrapped", False):
        return fn

    @functools.wraps(fn)
    def compute_advantage_for_multi_trajectories(data: Any, batch_keys: list[str], adv_estimator: Any, *a, **kw):
        if not _is_rapo(adv_estimator):
            return fn(data, batch_keys, adv_estimator, *a, **kw)
        fields = _extra_fields_from_tq(list(batch_keys))
        if fields is not None:  # for the step's rapo/rollout/* figures (metrics.py)
            tlr = data.batch["token_level_rewards"] if "token_level_rewards" in data.batch else None
            rewards = None if tlr is None else tlr.sum(-1).tolist()
            rapo_metrics.record_rows(fields[EXTRA_FIELDS_KEY], rewards)
        with rapo_non_tensor_batch(fields):
            return fn(data, batch_keys, adv_estimator, *a, **kw)

    compute_advantage_for_multi_trajectories._rapo_wrapped = True  # type: ignore[attr-defined]
    return compute_advantage_for_multi_trajectories


def register() -> None:
    """Register "rapo" in verl's estimator registry and wrap verl's trainer entry points (idempotent). Imports verl."""
    registry = verl_compat.get("verl.trainer.ppo.core_algos:ADV_ESTIMATOR_REGISTRY")
    if registry.get(ESTIMATOR_NAME) is not compute_rapo_outcome_advantage:
        registry.pop(ESTIMATOR_NAME, None)
        verl_compat.get("verl.trainer.ppo.core_algos:register_adv_est")(ESTIMATOR_NAME)(compute_rapo_outcome_advantage)
    # a verl without one of these trainers (e.g. no transfer_queue for v1): nothing to wrap there (optional rows)
    for target, wrap in (
        ("verl.trainer.ppo.ray_trainer:compute_advantage", _wrap_compute_advantage),
        ("verl.trainer.ppo.v1.utils:compute_advantage", _wrap_compute_advantage),
        ("verl.trainer.ppo.v1.trainer_base:compute_advantage_for_multi_trajectories", _wrap_multi_trajectories),
    ):
        verl_compat.patch(target, wrap)
