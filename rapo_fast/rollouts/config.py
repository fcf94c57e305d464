"""RolloutConfig: every setting of `rapo_fast.rollout`, with one sub-config per strategy that has settings.

What this is: the vocabularies STRATEGIES and MODES (defined here only), `RolloutConfig` with its sub-configs (a
strategy reads its own; the others are ignored) and `STRATEGY_CONFIG_FIELDS`. Spec: docs/rollout.md.
What this is not: the loop (rapo_fast/rollouts/loop.py), the strategies (rapo_fast/rollouts/strategies.py), or the
trainer's configuration (rapo_fast/train/config.py, which holds a RolloutConfig as `rollout`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rapo_fast._sections import Section, option, rule_bool, rule_choice, rule_int, rule_real, section
from rapo_fast.rollouts.arpo import RULES as ARPO_RULES

__all__ = [
    "STRATEGIES",
    "MODES",
    "STRATEGY_CONFIG_FIELDS",
    "RolloutConfig",
    "HybridConfig",
    "ARPOConfig",
    "OffPolicyTrajConfig",
]

# strategy name -> the RolloutConfig field of its sub-config (None: the strategy has no settings of its own)
STRATEGY_CONFIG_FIELDS: dict[str, str | None] = {
    "hybrid": "hybrid",  # RAPO: step-level retrieval at tool-result boundaries
    "on_policy": None,  # GRPO
    "arpo": "arpo",  # entropy-adaptive branching (rapo_fast/rollouts/arpo.py)
    "offpolicy_traj": "offpolicy_traj",  # whole off-policy trajectories per group (rapo_fast/rollouts/offpolicy.py)
}
STRATEGIES = tuple(STRATEGY_CONFIG_FIELDS)
MODES = ("exact", "splice")


def _retrieve_prob(name: str, v: Any) -> None:
    if not callable(v):
        rule_real(0.0, 1.0)(name, v)


@dataclass(frozen=True)
class HybridConfig(Section):
    """Strategy "hybrid": the first n_hybrid rows of each group retrieve with probability retrieve_prob (a number,
    or a callable of the step index) at each step boundary after step 0, and, with at_prompt, also right after the
    prompt, before step 0 (a retrieval there has no step before it, so it earns no retrieval reward)."""

    PATH = "rollout.hybrid"
    n_hybrid: int = option(8, rule_int(0))  # and <= group_size (RolloutConfig, with this strategy)
    retrieve_prob: float | Callable[[int], float] = option(0.5, _retrieve_prob)
    at_prompt: bool = option(False, rule_bool())


@dataclass(frozen=True)
class ARPOConfig(Section):
    """Strategy "arpo": `initial` rows of each group start (None: group_size // 2, at least 1); a branch makes up to
    beam - 1 copies; k first tokens, alpha / beta the branching probability and entropy weight, rule "paper" or
    "released", topk the released rule's top-k log-probs (rapo_fast/rollouts/arpo.py)."""

    PATH = "rollout.arpo"
    initial: int | None = option(None, rule_int(1, allow_none=True))  # and <= group_size (RolloutConfig)
    beam: int = option(2, rule_int(1))
    k: int = option(20, rule_int(1))
    alpha: float = option(0.5, rule_real(0.0, 1.0))
    beta: float = option(0.2, rule_real())
    rule: str = option("paper", rule_choice(*ARPO_RULES))
    topk: int = option(10, rule_int(1))


@dataclass(frozen=True)
class OffPolicyTrajConfig(Section):
    """Strategy "offpolicy_traj": n_offpolicy members of each group are whole off-policy trajectories."""

    PATH = "rollout.offpolicy_traj"
    n_offpolicy: int = option(1, rule_int(1))  # and < group_size with this strategy (RolloutConfig)


@dataclass(frozen=True)
class RolloutConfig(Section):
    """The settings of one rollout() call (see the module docstring); temperature 0 is greedy decoding."""

    PATH = "rollout"
    strategy: str = option("hybrid", rule_choice(*STRATEGIES))
    group_size: int = option(16, rule_int(1))
    mode: str = option("exact", rule_choice(*MODES))
    temperature: float = option(1.0, rule_real(0.0))
    max_steps: int = option(6, rule_int(1))
    max_step_tokens: int = option(24, rule_int(1))
    # None: exclude the row's own group from retrieval exactly when the buffer holds on-policy steps
    exclude_own_group: bool | None = option(None, rule_bool(allow_none=True))
    hybrid: HybridConfig = section(HybridConfig)
    arpo: ARPOConfig = section(ARPOConfig)
    offpolicy_traj: OffPolicyTrajConfig = section(OffPolicyTrajConfig)

    def check_together(self) -> None:
        G, n_hybrid, initial = self.group_size, self.hybrid.n_hybrid, self.arpo.initial
        if self.strategy == "hybrid" and n_hybrid > G:  # another strategy ignores its hybrid sub-config
            raise ValueError(f"rollout.hybrid.n_hybrid: expected an int in [0, group_size={G}], got {n_hybrid}")
        if initial is not None and initial > G:
            raise ValueError(f"rollout.arpo.initial: expected None or an int in [1, group_size={G}], got {initial}")
        if self.strategy == "offpolicy_traj" and not self.offpolicy_traj.n_offpolicy < G:
            raise ValueError(
                f"rollout.offpolicy_traj.n_offpolicy: expected an int in [1, group_size={G}) with strategy="
                f"'offpolicy_traj' (at least one on-policy member per group), got {self.offpolicy_traj.n_offpolicy}"
            )

    @property
    def strategy_config(self) -> Section | None:
        """The sub-config of the configured strategy (None for "on_policy")."""
        name = STRATEGY_CONFIG_FIELDS[self.strategy]
        return None if name is None else getattr(self, name)

    @property
    def n_initial(self) -> int:
        """Rows of each group started at the beginning (ARPO starts `arpo.initial`, the others all)."""
        if self.strategy != "arpo":
            return self.group_size
        return self.arpo.initial or max(1, self.group_size // 2)
