"""The former flat TrainerConfig format (33 top-level fields: n_hybrid, arpo_beam, tis_cap, lr, ... and `loss` as a
dict) and its conversion to the nested one: `convert_flat_config`, `is_flat_config`, `FLAT_FIELDS`.

What this is: the table of where each flat field went (FLAT_FIELDS: old name -> dotted new place) and the converter,
which keeps the old meaning exactly: the flat `loss` dict replaced the whole loss (options it left out were
rapo_loss's defaults) and `tis_cap` (default 2.0) sat beside it, so the converted `loss` lists every option.
TrainerConfig.from_dict / load call it on a flat config, with a FutureWarning. What this is not: the configuration
itself (rapo_fast/train/config.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rapo_fast._sections import expand_dotted
from rapo_fast.loss import presets
from rapo_fast.loss.options import OPTION_DEFAULTS
from rapo_fast.rollouts.config import LEGACY_KEYWORDS

__all__ = ["FLAT_FIELDS", "convert_flat_config", "is_flat_config", "new_name_of"]

# former flat field -> its dotted place in the nested TrainerConfig
FLAT_FIELDS: dict[str, str] = {
    **{old: f"rollout.{new}" for old, new in LEGACY_KEYWORDS.items()},
    "prompts_per_step": "prompts_per_step", "seed": "seed",
    "advantage_attribution": "advantages.advantage_attribution", "ret_coef": "advantages.ret_coef",
    "ret_norm": "advantages.ret_norm",
    "loss": "loss", "tis_cap": "loss.tis_cap",
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "max_grad_norm": "optim.max_grad_norm",
    "updates_per_step": "optim.updates_per_step", "mini_batch_groups": "optim.mini_batch_groups",
    "add_onpolicy_steps": "buffer.add_onpolicy_steps", "refresh_kv_every": "buffer.refresh_kv_every",
    "log_csv": "logging.log_csv", "tensorboard_dir": "logging.tensorboard_dir",
}  # fmt: skip
_FLAT_ONLY = frozenset(k for k, v in FLAT_FIELDS.items() if k != v)
_FLAT_TIS_CAP = 2.0  # the former top-level default
# rapo_loss options the trainer sets, not the config (the sampling temperature is rollout.temperature, metrics are
# always returned): TrainerConfig's `loss` refuses them (rapo_fast/train/config.py reads this too)
_TRAINER_SET = ("temperature", "return_metrics")


def new_name_of(flat_name: str) -> str | None:
    """The dotted place of a former flat field (None: not one)."""
    return FLAT_FIELDS.get(flat_name)


def is_flat_config(d: Mapping[str, Any]) -> bool:
    """True when `d` has a field only the flat format has (a nested config's keys are its section names)."""
    return any(isinstance(k, str) and k in _FLAT_ONLY for k in d)


def convert_flat_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """A flat config dict -> the nested dict of the same configuration (TrainerConfig.from_dict of it equals the
    flat config as it loaded before). Keys that are not flat fields pass through unchanged (and are then refused
    or read by from_dict); values are not checked here."""
    if not isinstance(d, Mapping):
        raise TypeError(f"convert_flat_config: expected a dict, got {type(d).__name__}")
    dotted = {FLAT_FIELDS.get(k, k): v for k, v in d.items() if k not in ("loss", "tis_cap")}
    loss = d.get("loss", presets.RAPO)
    if isinstance(loss, Mapping):  # the whole loss, as the flat format meant it; a bad value is left to from_dict
        defaults = {k: v for k, v in OPTION_DEFAULTS.items() if k not in _TRAINER_SET}
        loss = {**defaults, **loss, "tis_cap": d.get("tis_cap", _FLAT_TIS_CAP)}
    return expand_dotted(dotted) | {"loss": loss}  # a loss that is no dict: refused by from_dict, naming it
