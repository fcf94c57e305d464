"""The RAPO loss inside verl's actor update: how the per-token retrieved flags and the per-sequence F reach it.

What it is: `rapo_ppo_loss` (reads the micro-batch's RAPO fields into a context variable and calls verl's own
`ppo_loss`) and `register()`, which installs that route in verl's workers. The route, and why not
rollout_is_weights: docs/verl.md section 3, "The loss".
What it is not: the policy-loss math (policy_loss.py) or the log-probs (verl's model forward gives them).
Importable without verl (verl is imported inside `rapo_ppo_loss` without `base_loss`, and in `register()`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rapo_fast.integrations.verl import verl_compat
from rapo_fast.integrations.verl.logprobs import register as register_fused_logprobs
from rapo_fast.integrations.verl.policy_loss import (
    F_RET_KEY,
    RETRIEVED_MASK_KEY,
    RapoTokenFields,
    current_rapo_fields,
    rapo_token_fields,
)
from rapo_fast.integrations.verl.policy_loss import register as register_policy_losses

__all__ = [
    "RETRIEVED_MASK_KEY",
    "F_RET_KEY",
    "RapoTokenFields",
    "rapo_fields_from_tensordict",
    "current_rapo_fields",
    "rapo_ppo_loss",
    "wrap_loss_fn",
    "register",
    "rapo_token_fields",
]

EXTRA_FIELDS_KEY = verl_compat.EXTRA_FIELDS_KEY  # the v1 trainer keeps an agent loop's extra_fields per sample


def _rows(data: Any, key: str) -> list[Any] | None:
    """The per-sample values of `key`: a top-level NonTensorStack (legacy trainer) or a key of each sample's
    extra_fields dict (v1 trainer); None when neither holds it."""
    keys = set(data.keys())
    if key in keys:
        return list(data[key])
    if EXTRA_FIELDS_KEY in keys:
        extra = list(data[EXTRA_FIELDS_KEY])
        if extra and all(isinstance(e, dict) and key in e for e in extra):
            return [e[key] for e in extra]
    return None


def _response_lens(data: Any) -> list[int]:
    """Per row the number of response tokens (verl's `responses`: nested in the engine, or padded with the response
    part of attention_mask), as verl's no_padding_2_padding counts them."""
    responses = data["responses"]
    if responses.is_nested:
        return responses.offsets().diff().tolist()
    width = responses.shape[1]
    return data["attention_mask"][:, -width:].sum(1).tolist()


def rapo_fields_from_tensordict(data: Any) -> RapoTokenFields | None:
    """The RAPO fields of a verl actor micro-batch (a TensorDict as the engine hands it to the loss), or None when it
    holds no "rapo_retrieved_mask" (a batch from a loop without retrieval: F = 0, the loss is verl's vanilla one).

    Raises ValueError when a row's retrieved mask is not one flag per response token.
    """
    rows = _rows(data, RETRIEVED_MASK_KEY)
    if rows is None:
        return None
    lens = [int(n) for n in _response_lens(data)]
    retrieved = tuple(tuple(int(v) for v in (r if r is not None else ())) for r in rows)
    for i, (r, n) in enumerate(zip(retrieved, lens, strict=True)):
        if len(r) != n:
            raise ValueError(
                f"{RETRIEVED_MASK_KEY}: row {i}: expected {n} flags (one per response token), got {len(r)}"
            )
    f_rows = _rows(data, F_RET_KEY)
    f_ret = None if f_rows is None else tuple(float(f) for f in f_rows)
    return RapoTokenFields(retrieved=retrieved, response_lens=tuple(lens), f_ret=f_ret)


def rapo_ppo_loss(
    config: Any, model_output: Any, data: Any, dp_group: Any = None, *, base_loss: Callable[..., Any] | None = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's actor loss (`base_loss`, default verl.workers.utils.losses.ppo_loss) with the micro-batch's RAPO fields
    visible to the policy loss registered as "rapo". Same signature and return value as verl's ppo_loss."""
    if base_loss is None:
        base_loss = verl_compat.get("verl.workers.utils.losses:ppo_loss")
    with rapo_token_fields(rapo_fields_from_tensordict(data)):
        return base_loss(config=config, model_output=model_output, data=data, dp_group=dp_group)


def wrap_loss_fn(base_loss: Callable[..., Any]) -> Callable[..., Any]:
    """A loss function with verl's `(config, model_output, data, dp_group, ...)` signature that sets the RAPO context
    around `base_loss` (idempotent: a wrapped function is returned as it is)."""
    if getattr(base_loss, "_rapo_wrapped", False):
        return base_loss

    @functools.wraps(base_loss)
    def loss_fn(*args: Any, **kwargs: Any):
        data = kwargs["data"] if "data" in kwargs else args[2]
        with rapo_token_fields(rapo_fields_from_tensordict(data)):
            return base_loss(*args, **kwargs)

    loss_fn._rapo_wrapped = True  # type: ignore[attr-defined]
    return loss_fn


# The loss names verl's engine worker binds into its actor loss (verl/workers/engine_workers.py, init_model).
_WORKER_LOSS_NAMES: Sequence[str] = ("ppo_loss", "distillation_ppo_loss")


def register() -> None:
    """Register the RAPO policy losses (policy_loss.POLICY_LOSSES) in verl's registry and wrap verl's worker losses
    (idempotent). Imports verl."""
    register_policy_losses()
    register_fused_logprobs()  # opt-in: RAPO_FAST_VERL_FUSED_LOGPROBS=1
    for name in _WORKER_LOSS_NAMES:
        verl_compat.patch(f"verl.workers.engine_workers:{name}", wrap_loss_fn)
