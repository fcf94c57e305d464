"""TrainerConfig: every knob of RAPOTrainer as nested sections that round-trip to YAML/JSON, with presets.

What this is: `TrainerConfig` (a rapo_fast._sections.Section: errors name the dotted field) and the presets RAPO (the
paper's defaults), GRPO (retrieval off, the same loss), ARPO and OFFPOLICY_TRAJ.
What this is not: the trainer (rapo_fast/train/trainer.py). Spec: docs/training.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapo_fast._atomic import write_file_atomic
from rapo_fast._checks import brief
from rapo_fast._sections import Section, option, rule_bool, rule_choice, rule_int, rule_real, rule_type, section
from rapo_fast.loss import presets
from rapo_fast.loss.advantages import RET_NORMS
from rapo_fast.loss.options import OPTION_DEFAULTS, LossOptions
from rapo_fast.rollouts.config import RolloutConfig

__all__ = [
    "TrainerConfig",
    "AdvantageConfig",
    "OptimConfig",
    "BufferConfig",
    "LoggingConfig",
    "RolloutConfig",
    "LossOptions",
    "TRAINER_LOSS",
    "TRAINER_SET_LOSS_OPTIONS",
]

# the default loss of TrainerConfig: the RAPO preset, with tis_cap 2.0 (used in splice mode only: docs/training.md)
TRAINER_LOSS = LossOptions(**presets.RAPO, tis_cap=2.0)
# rapo_loss options the trainer sets, not the config (the sampling temperature is rollout.temperature, metrics are
# always returned): TrainerConfig's `loss` refuses them and does not save them
TRAINER_SET_LOSS_OPTIONS = ("temperature", "return_metrics")


@dataclass(frozen=True)
class AdvantageConfig(Section):
    """ret_coef (a), ret_norm (the rows A_ret is z-scored over: "group" or "retrieved"; rapo_fast.loss.advantages.
    rapo_advantages) and advantage_attribution ("soft", or ARPO's "hard": a token shared by branches gets their mean
    advantage)."""

    PATH = "advantages"
    ret_coef: float = option(0.2, rule_real())
    ret_norm: str = option("group", rule_choice(*RET_NORMS))
    advantage_attribution: str = option("soft", rule_choice("soft", "hard"))


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW's lr and weight_decay, gradient clipping, passes over a rollout batch (verl's ppo_epochs) and prompt
    groups per optimiser step (verl's ppo_mini_batch_size; None: all)."""

    PATH = "optim"
    lr: float = option(1e-3, rule_real(0.0))
    weight_decay: float = option(0.0, rule_real(0.0))
    max_grad_norm: float | None = option(1.0, rule_real(0.0, lo_open=True, allow_none=True))
    updates_per_step: int = option(1, rule_int(1))
    mini_batch_groups: int | None = option(None, rule_int(1, allow_none=True))


@dataclass(frozen=True)
class BufferConfig(Section):
    """add_onpolicy_steps: successful tool steps go into the step buffer; refresh_kv_every: steps between K/V
    refreshes of the buffer in splice mode."""

    PATH = "buffer"
    add_onpolicy_steps: bool = option(False, rule_bool())
    refresh_kv_every: int = option(1, rule_int(1))


@dataclass(frozen=True)
class LoggingConfig(Section):
    PATH = "logging"
    log_csv: str | None = option(None, rule_type((str, type(None)), "a path string or None"))
    tensorboard_dir: str | None = option(None, rule_type((str, type(None)), "a path string or None"))


def _loss_from(current: LossOptions, d: Mapping) -> LossOptions:
    """A dict given for `loss`: the current options with its keys replaced (names and values checked)."""
    bad_keys = [k for k in d if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"loss: expected option names as strings, got {brief(bad_keys)}")
    allowed = set(LossOptions.names()) - set(TRAINER_SET_LOSS_OPTIONS)
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"loss: expected rapo_loss options among {sorted(allowed)}, got unknown options {unknown}")
    try:
        return current.replace(**d)
    except (TypeError, ValueError) as e:
        raise type(e)(f"loss.{e}") from None


def _check_loss(name: str, loss: Any) -> None:
    if not isinstance(loss, LossOptions):
        raise TypeError(f"{name}: expected a LossOptions or a dict of rapo_loss options, got {type(loss).__name__}")
    for k in TRAINER_SET_LOSS_OPTIONS:
        if getattr(loss, k) != OPTION_DEFAULTS[k]:
            raise ValueError(
                f"{name}.{k}: expected the default {OPTION_DEFAULTS[k]!r} (the trainer sets it: rollout.temperature; "
                f"metrics always), got {brief(getattr(loss, k))}"
            )
    if loss.beta != 0.0:
        raise ValueError(f"{name}.beta: expected 0 (the thin trainer keeps no reference model), got {brief(loss.beta)}")


def _loss_dict(loss: LossOptions) -> dict[str, Any]:
    return {k: v for k, v in loss.to_dict().items() if k not in TRAINER_SET_LOSS_OPTIONS}


@dataclass
class TrainerConfig(Section):
    """Rollout, advantage, loss, optimiser, buffer and logging options of one RL run (see the module docstring)."""

    rollout: RolloutConfig = section(RolloutConfig)
    advantages: AdvantageConfig = section(AdvantageConfig)
    # rapo_loss's options; loss.tis_cap applies to splice-mode batches with retrieved tokens (behav_logp)
    loss: LossOptions = field(
        default_factory=lambda: TRAINER_LOSS,
        metadata={"coerce": _loss_from, "check": _check_loss, "to_dict": _loss_dict},
    )
    optim: OptimConfig = section(OptimConfig)
    buffer: BufferConfig = section(BufferConfig)
    logging: LoggingConfig = section(LoggingConfig)
    prompts_per_step: int = option(4, rule_int(1))
    seed: int = option(0, rule_int(0, 2**63 - 1))

    def check_together(self) -> None:
        r = self.rollout
        if r.strategy != "hybrid" and r.hybrid.n_hybrid:
            raise ValueError(
                f"rollout.hybrid.n_hybrid: expected 0 with strategy={brief(r.strategy)}, got {r.hybrid.n_hybrid}"
            )
        if callable(r.hybrid.retrieve_prob):
            raise TypeError(
                "rollout.hybrid.retrieve_prob: expected a number in [0, 1] (the config is saved), got a callable"
            )
        rule_real(0.0, lo_open=True)("rollout.temperature", r.temperature)  # the trainer samples: no greedy

    @classmethod
    def RAPO(cls, overrides: Mapping[str, Any] | None = None, /, **sections: Any) -> TrainerConfig:
        """RAPO's defaults updated by `overrides` (dotted keys allowed: {"rollout.group_size": 8}) and `sections`
        (rollout={"group_size": 8}, loss=LossOptions(...), seed=1)."""
        return cls._preset({}, overrides, sections)

    @classmethod
    def GRPO(cls, overrides: Mapping[str, Any] | None = None, /, **sections: Any) -> TrainerConfig:
        """RAPO with retrieval off (no hybrid rows, no retrieval reward, no shaping): the same loss otherwise."""
        base = {
            "rollout": {"strategy": "on_policy", "hybrid": {"n_hybrid": 0}},
            "advantages": {"ret_coef": 0.0},
            "loss": TRAINER_LOSS.replace(shaping_m=0.0),
        }
        return cls._preset(base, overrides, sections)

    @classmethod
    def ARPO(cls, overrides: Mapping[str, Any] | None = None, /, **sections: Any) -> TrainerConfig:
        """Entropy-adaptive branching, soft attribution, ARPO's loss preset."""
        base = {
            "rollout": {"strategy": "arpo", "hybrid": {"n_hybrid": 0}},
            "advantages": {"ret_coef": 0.0},
            "loss": LossOptions(**presets.ARPO, tis_cap=2.0),
        }
        return cls._preset(base, overrides, sections)

    @classmethod
    def OFFPOLICY_TRAJ(cls, overrides: Mapping[str, Any] | None = None, /, **sections: Any) -> TrainerConfig:
        """Trajectory-level off-policy (LUFFY-style): rollout.offpolicy_traj.n_offpolicy members of each group are
        whole off-policy trajectories, their tokens trained with the shaped weight p / (p + gamma); no step
        retrieval, no shaping."""
        base = {
            "rollout": {"strategy": "offpolicy_traj", "hybrid": {"n_hybrid": 0}},
            "advantages": {"ret_coef": 0.0},
            "loss": TRAINER_LOSS.replace(shaping_m=0.0, offpolicy_train="shaped"),
        }
        return cls._preset(base, overrides, sections)

    @classmethod
    def preset(cls, name: str, overrides: Mapping[str, Any] | None = None, /, **sections: Any) -> TrainerConfig:
        makers = {"RAPO": cls.RAPO, "GRPO": cls.GRPO, "ARPO": cls.ARPO, "OFFPOLICY_TRAJ": cls.OFFPOLICY_TRAJ}
        if not isinstance(name, str) or name.upper() not in makers:
            raise ValueError(f"TrainerConfig.preset: name: expected one of {sorted(makers)}, got {brief(name)}")
        return makers[name.upper()](overrides, **sections)

    @classmethod
    def _preset(cls, base: dict, overrides: Mapping[str, Any] | None, sections: dict[str, Any]) -> TrainerConfig:
        return cls().replace(base).replace(overrides).replace(sections)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainerConfig:
        """The defaults updated by `d`, nested ({"rollout": {"arpo": {"beam": 3}}}) or dotted."""
        if not isinstance(d, Mapping):
            raise TypeError(f"TrainerConfig.from_dict: expected a dict, got {type(d).__name__}")
        try:
            return cls().replace(d)
        except RecursionError:  # a mapping nested thousands deep (dotted keys that collide at every level)
            raise ValueError("TrainerConfig.from_dict: expected a mapping of bounded depth, got one too deep") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainerConfig:
        """Parse JSON text (a parse error is a ValueError: json.JSONDecodeError) and validate it (from_dict)."""
        try:
            d = json.loads(text)
        except RecursionError:  # arrays or objects nested thousands deep
            raise ValueError("TrainerConfig: expected JSON, got malformed JSON: nested too deeply") from None
        return cls.from_dict(d)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=True)

    @classmethod
    def from_yaml(cls, text: str) -> TrainerConfig:
        """Parse YAML text and validate it (from_dict). Malformed YAML raises ValueError (not yaml.YAMLError, so that
        every bad config is one kind of error), giving the parser's line and column."""
        import yaml

        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"TrainerConfig: expected YAML, got malformed YAML: {exc}") from exc
        except RecursionError:  # flow collections nested thousands deep
            raise ValueError("TrainerConfig: expected YAML, got malformed YAML: nested too deeply") from None
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        """Write YAML (.yaml/.yml) or JSON (anything else), atomically: an exception or a kill during the save leaves
        the previous file or the new one (rapo_fast._atomic.write_file_atomic)."""
        p = Path(path)
        text = self.to_yaml() if p.suffix in (".yaml", ".yml") else self.to_json()
        write_file_atomic(p, lambda f: f.write(text.encode("utf-8")))

    @classmethod
    def load(cls, path: str | Path) -> TrainerConfig:
        """Read YAML (.yaml/.yml) or JSON (anything else). A file that is not UTF-8, not valid YAML/JSON or not a valid
        config raises ValueError (TypeError for a wrong-typed field) whose message starts with the file's path."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
            return cls.from_yaml(text) if p.suffix in (".yaml", ".yml") else cls.from_json(text)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{p}: expected UTF-8 text, got {exc.reason} at byte {exc.start}") from exc
        except (ValueError, TypeError) as exc:  # the same kind, with the file named (a message alone names no file)
            raise (ValueError if isinstance(exc, ValueError) else TypeError)(f"{p}: {exc}") from exc
