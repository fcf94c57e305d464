"""TrainerConfig: every knob of RAPOTrainer as a dataclass that round-trips to YAML/JSON, with presets RAPO/GRPO/ARPO.

What this is: configuration and its validation (bad values raise ValueError/TypeError naming the field, what was
expected and what was given). Presets: RAPO (the paper's defaults: G=16, 8 hybrid, p=0.5, a=0.2, m=0.05, eps 0.28,
seq-mean-token-mean, no KL), GRPO (RAPO with retrieval off: no hybrid rollouts, no retrieval reward; the same loss
options, so a comparison isolates retrieval), ARPO (entropy-adaptive branching, soft attribution, ARPO's loss
preset). What this is not: the trainer (rapo_fast/train/trainer.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapo_fast import _checks as C
from rapo_fast.loss import presets
from rapo_fast.loss.advantages import RET_NORMS
from rapo_fast.loss.options import LossOptions
from rapo_fast.rollouts.config import MODES, STRATEGIES


@dataclass
class TrainerConfig:
    """Rollout, advantage, loss, optimiser and logging options of one RL run (see the module docstring)."""

    # rollout
    strategy: str = "hybrid"
    group_size: int = 16
    n_hybrid: int = 8
    retrieve_prob: float = 0.5
    mode: str = "exact"
    prompts_per_step: int = 4
    temperature: float = 1.0
    max_steps: int = 6
    max_step_tokens: int = 24
    exclude_own_group: bool | None = None
    # trajectory-level off-policy (strategy "offpolicy_traj"): whole off-policy trajectories per group
    n_offpolicy: int = 1
    # ARPO
    arpo_initial: int | None = None
    arpo_beam: int = 2
    arpo_k: int = 20
    arpo_alpha: float = 0.5
    arpo_beta: float = 0.2
    arpo_rule: str = "paper"  # "released": the released ARPO code's rule (rapo_fast/rollouts/arpo.py)
    arpo_topk: int = 10
    advantage_attribution: str = "soft"
    # advantages
    ret_coef: float = 0.2
    # rows A_ret is z-scored over: "group" (all, as written in the paper) or "retrieved" (the rows with a scored
    # retrieval; the others get A_ret = 0): rapo_fast.loss.advantages.rapo_advantages
    ret_norm: str = "group"
    # loss: keyword options of rapo_fast.rapo_loss (tensors excluded)
    loss: dict[str, Any] = field(default_factory=lambda: dict(presets.RAPO))
    tis_cap: float | None = 2.0
    # optimisation
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    updates_per_step: int = 1  # passes over the rollout batch (verl's ppo_epochs)
    mini_batch_groups: int | None = None  # prompt groups per optimiser step (verl's ppo_mini_batch_size); None: all
    # buffer
    add_onpolicy_steps: bool = False
    refresh_kv_every: int = 1
    # run
    seed: int = 0
    log_csv: str | None = None
    tensorboard_dir: str | None = None

    # -- presets ----------------------------------------------------------------------------------------------------
    @classmethod
    def RAPO(cls, **overrides: Any) -> TrainerConfig:
        return cls(**overrides).validate()

    @classmethod
    def GRPO(cls, **overrides: Any) -> TrainerConfig:
        kw = dict(strategy="on_policy", n_hybrid=0, ret_coef=0.0, loss=dict(presets.RAPO, shaping_m=0.0))
        return cls(**(kw | overrides)).validate()

    @classmethod
    def ARPO(cls, **overrides: Any) -> TrainerConfig:
        kw = dict(strategy="arpo", n_hybrid=0, ret_coef=0.0, loss=dict(presets.ARPO))
        return cls(**(kw | overrides)).validate()

    @classmethod
    def OFFPOLICY_TRAJ(cls, **overrides: Any) -> TrainerConfig:
        """Trajectory-level off-policy (LUFFY-style): n_offpolicy members of each group are whole off-policy
        trajectories, their tokens trained with the shaped weight p / (p + gamma); no step retrieval, no shaping."""
        kw = dict(strategy="offpolicy_traj", n_hybrid=0, ret_coef=0.0,
                  loss=dict(presets.RAPO, shaping_m=0.0, offpolicy_train="shaped"))  # fmt: skip
        return cls(**(kw | overrides)).validate()

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TrainerConfig:
        makers = {"RAPO": cls.RAPO, "GRPO": cls.GRPO, "ARPO": cls.ARPO, "OFFPOLICY_TRAJ": cls.OFFPOLICY_TRAJ}
        if not isinstance(name, str) or name.upper() not in makers:
            raise ValueError(f"TrainerConfig.preset: name must be one of {sorted(makers)}, got {name!r}")
        return makers[name.upper()](**overrides)

    # -- validation -------------------------------------------------------------------------------------------------
    def validate(self) -> TrainerConfig:
        """Check every field (type and range; the table of rules is _FIELD_RULES below); return self.

        A wrong type raises TypeError, a wrong value (NaN, inf, out of range, an unknown choice) ValueError, both
        naming the field. Every field of the dataclass has a rule (tests/train/test_config.py checks that)."""
        for name, rule in _FIELD_RULES.items():
            rule(f"TrainerConfig.{name}", getattr(self, name))
        if not self.n_hybrid <= self.group_size:
            raise ValueError(
                f"TrainerConfig.n_hybrid: expected an int in [0, group_size={self.group_size}], got {self.n_hybrid!r}"
            )
        if self.strategy != "hybrid" and self.n_hybrid:
            raise ValueError(f"TrainerConfig.n_hybrid: must be 0 with strategy={self.strategy!r}, got {self.n_hybrid}")
        if self.strategy == "offpolicy_traj" and not self.n_offpolicy < self.group_size:
            raise ValueError(
                f"TrainerConfig.n_offpolicy: expected an int in [1, group_size={self.group_size}) with "
                f"strategy='offpolicy_traj', got {self.n_offpolicy!r}"
            )
        if self.arpo_initial is not None and self.arpo_initial > self.group_size:
            raise ValueError(
                f"TrainerConfig.arpo_initial: expected None or an int in [1, group_size={self.group_size}], got "
                f"{self.arpo_initial!r}"
            )
        return self

    # -- serialisation ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainerConfig:
        if not isinstance(d, dict):
            raise TypeError(f"TrainerConfig.from_dict: expected a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"TrainerConfig: unknown fields {unknown}; expected a subset of {sorted(names)}")
        return cls(**d).validate()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainerConfig:
        """Parse JSON text (a parse error is a ValueError: json.JSONDecodeError) and validate it (from_dict)."""
        return cls.from_dict(json.loads(text))

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
            raise ValueError(f"TrainerConfig: malformed YAML: {exc}") from exc
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        """Write YAML (.yaml/.yml) or JSON (anything else)."""
        p = Path(path)
        p.write_text(self.to_yaml() if p.suffix in (".yaml", ".yml") else self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> TrainerConfig:
        """Read YAML (.yaml/.yml) or JSON (anything else). A file that is not UTF-8, not valid YAML/JSON or not a valid
        config raises ValueError (TypeError for a wrong-typed field) whose message starts with the file's path."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
            return cls.from_yaml(text) if p.suffix in (".yaml", ".yml") else cls.from_json(text)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except (ValueError, TypeError) as exc:  # the same kind, with the file named (a message alone names no file)
            raise (ValueError if isinstance(exc, ValueError) else TypeError)(f"{p}: {exc}") from exc


# -- the rule of each field -------------------------------------------------------------------------------------------
def _int(lo: int, hi: int | None = None, allow_none: bool = False) -> Callable[[str, Any], None]:
    """An int (bool refused) in [lo, hi]."""

    def check(name: str, v: Any) -> None:
        if v is None and allow_none:
            return
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"{name}: expected an int in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}")

    return check


def _real(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
          allow_none: bool = False) -> Callable[[str, Any], None]:  # fmt: skip
    """A finite real number (bool refused) in [lo, hi], or (lo, hi] with lo_open: rapo_fast._checks.check_float."""
    bounds = dict(min_value=lo, max_value=hi, min_inclusive=not lo_open, allow_none=allow_none)
    return lambda name, v: C.check_float(name, v, **bounds)


def _choice(*choices: str) -> Callable[[str, Any], None]:
    return lambda name, v: C.check_choice(name, v, choices)


def _of_type(kinds: tuple[type, ...], what: str) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if not isinstance(v, kinds):
            raise TypeError(f"{name}: expected {what}, got {type(v).__name__} {v!r}")

    return check


_FIELD_RULES: dict[str, Callable[[str, Any], None]] = {
    "strategy": _choice(*STRATEGIES),
    "group_size": _int(1),
    "n_hybrid": _int(0),  # and <= group_size (validate)
    "retrieve_prob": _real(0.0, 1.0),
    "mode": _choice(*MODES),
    "prompts_per_step": _int(1),
    "temperature": _real(0.0, lo_open=True),
    "max_steps": _int(1),
    "max_step_tokens": _int(1),
    "exclude_own_group": _of_type((bool, type(None)), "a bool or None"),
    "n_offpolicy": _int(1),
    "arpo_initial": _int(1, allow_none=True),  # and <= group_size (validate)
    "arpo_beam": _int(1),
    "arpo_k": _int(1),
    "arpo_alpha": _real(0.0, 1.0),
    "arpo_beta": _real(),
    "arpo_rule": _choice("paper", "released"),
    "arpo_topk": _int(1),
    "advantage_attribution": _choice("soft", "hard"),
    "ret_coef": _real(),
    "ret_norm": _choice(*RET_NORMS),
    "loss": lambda name, v: _check_loss(v),
    "tis_cap": _real(0.0, lo_open=True, allow_none=True),
    "lr": _real(0.0),
    "weight_decay": _real(0.0),
    "max_grad_norm": _real(0.0, lo_open=True, allow_none=True),
    "updates_per_step": _int(1),
    "mini_batch_groups": _int(1, allow_none=True),
    "add_onpolicy_steps": _of_type((bool,), "a bool"),
    "refresh_kv_every": _int(1),
    "seed": _int(0, 2**63 - 1),
    "log_csv": _of_type((str, type(None)), "a path string or None"),
    "tensorboard_dir": _of_type((str, type(None)), "a path string or None"),
}


def _check_loss(loss: Any) -> None:
    """TrainerConfig.loss: a dict of rapo_loss options (string keys, known names, beta 0), valid as LossOptions."""
    if not isinstance(loss, dict):
        raise TypeError(f"TrainerConfig.loss: expected a dict of rapo_loss options, got {type(loss).__name__}")
    bad_keys = [k for k in loss if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"TrainerConfig.loss: option names must be strings, got {bad_keys!r}")
    allowed = set(LossOptions.names()) - {"return_metrics", "tis_cap", "temperature"}
    unknown = sorted(set(loss) - allowed)
    if unknown:
        raise ValueError(
            f"TrainerConfig.loss: unknown rapo_loss options {unknown}; expected a subset of {sorted(allowed)}"
        )
    if loss.get("beta", 0.0) not in (0, 0.0):
        raise ValueError(
            f"TrainerConfig.loss['beta']: the thin trainer keeps no reference model, so the KL "
            f"coefficient must be 0, got {loss['beta']!r}"
        )
    try:  # the values, checked now as rapo_loss would check them at the first step
        LossOptions(**loss)
    except (TypeError, ValueError) as e:
        raise type(e)(f"TrainerConfig.loss: {e}") from None
