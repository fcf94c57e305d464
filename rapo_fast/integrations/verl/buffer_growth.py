"""Growing RAPO's step buffer from a verl job's own rollouts: the "rapo" reward manager.

What it is: `RapoRewardManager` (registered as "rapo" by `register()`), which wraps the job's own reward manager (the
score is unchanged) and adds a successful trajectory's tool steps to the step buffer. Why a reward manager, what is
not covered and the config keys: docs/verl.md section 5.
What it is not: the buffer (buffer_actor.py), the rule itself (buffer_setup.onpolicy_steps) or the agent loop
(agent_loop.py). Not importable without verl (it subclasses verl's RewardManagerBase).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rapo_fast._sections import Section, option, rule_bool, rule_real
from rapo_fast.integrations.verl import verl_compat
from rapo_fast.integrations.verl.agent_loop import _client, resolve_loop_config
from rapo_fast.integrations.verl.buffer_setup import onpolicy_steps

__all__ = [
    "REWARD_MANAGER_NAME",
    "GrowthConfig",
    "growth_config",
    "RapoRewardManager",
    "register",
]

RewardManagerBase = verl_compat.get("verl.experimental.reward_loop.reward_manager.base:RewardManagerBase")
REWARD_MANAGER_NAME = "rapo"
_log = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _inner_manager(name: str, v: Any) -> None:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected the name of another registered reward manager, got {type(v).__name__}")
    if not v or v == REWARD_MANAGER_NAME:
        raise ValueError(f"{name}: expected the name of another registered reward manager, got {v!r}")


@dataclass(frozen=True)
class GrowthConfig(Section):
    """The buffer-growth keys of the trainer config's `rapo` section (see the module docstring)."""

    PATH = "rapo"
    add_onpolicy_steps: bool = option(False, rule_bool())
    onpolicy_reward_threshold: float = option(0.5, rule_real())
    inner_reward_manager: str = option("naive", _inner_manager)
    onpolicy_add_window_s: float = option(0.05, rule_real(0.0))
    # the agent loop's keys (rapo.buffer_name), resolved by its rule: decode as it decodes its retrieval queries
    buffer_name: str = "rapo_step_buffer"
    history_skip_special_tokens: bool = True


def _section(config: Any) -> Mapping:
    rapo = config.get("rapo", None) if hasattr(config, "get") else None
    return rapo if rapo is not None else {}


def growth_config(config: Any) -> GrowthConfig:
    """The GrowthConfig of a verl trainer config. buffer_name and history_skip_special_tokens are resolved by the agent
    loop's own rule from the same `rapo` section (set them there, not only in an agent-loop YAML entry, when the buffer
    grows). Raises ValueError (TypeError for a wrong type) naming the key."""
    rapo = _section(config)
    keys = ("add_onpolicy_steps", "onpolicy_reward_threshold", "inner_reward_manager", "onpolicy_add_window_s")
    loop_cfg = resolve_loop_config(rapo, {}, int(config.actor_rollout_ref.rollout.n))
    return GrowthConfig(
        **{k: rapo.get(k) for k in keys if k in rapo},
        buffer_name=loop_cfg.buffer_name,
        history_skip_special_tokens=loop_cfg.history_skip_special_tokens,
    )


class _AddQueue:
    """Adds arriving within `window_s` of the first pending one go to the buffer as one add_steps call; every
    caller awaits the call that carried its steps (its error included)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.pending: list[tuple[list[str], list[str], list[int], asyncio.Future]] = []
        self.task: asyncio.Task | None = None

    async def add(self, client: Any, histories: list[str], steps: list[str], groups: list[int]) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((histories, steps, groups, fut))
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._drain(client))
        await fut

    async def _drain(self, client: Any) -> None:
        while self.pending:  # requests arriving during an add wait for the next one
            await asyncio.sleep(self.window_s)
            batch, self.pending = self.pending, []
            try:
                await client.add_steps(
                    [h for b in batch for h in b[0]], [s for b in batch for s in b[1]], [g for b in batch for g in b[2]]
                )
            except Exception as e:  # noqa: BLE001 - handed to every waiting caller
                for *_, fut in batch:
                    fut.set_exception(e)
            else:
                for *_, fut in batch:
                    fut.set_result(None)


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _log.warning(msg)


class RapoRewardManager(RewardManagerBase):
    """verl's reward manager "rapo": the inner manager's score, plus the buffer growth (module docstring). Built by
    verl's load_reward_manager in each RewardLoopWorker with (config, tokenizer, compute_score, **reward kwargs)."""

    rapo_grows_step_buffer = True  # marker for buffer_setup.check_growth_config (which must not import this module)

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any, **kwargs: Any):
        get_reward_manager_cls = verl_compat.get("verl.experimental.reward_loop.reward_manager:get_reward_manager_cls")
        super().__init__(config, tokenizer, compute_score)
        self.growth = growth_config(config)
        inner_cls = get_reward_manager_cls(self.growth.inner_reward_manager)
        if getattr(inner_cls, "rapo_grows_step_buffer", False):
            raise ValueError(f"rapo.inner_reward_manager: expected not a RapoRewardManager, got {inner_cls.__name__}")
        self.inner = inner_cls(config, tokenizer, compute_score, **kwargs)
        self._adds = _AddQueue(self.growth.onpolicy_add_window_s)

    async def run_single(self, data: Any) -> dict:
        result = await self.inner.run_single(data)
        if self.growth.add_onpolicy_steps:
            await self.grow(data, float(result[verl_compat.REWARD_SCORE_KEY]))
        return result

    async def grow(self, data: Any, reward: float) -> int:
        """Add the steps of `data`'s last trajectory (the one verl scores) when it is a successful training rollout
        of the RAPO agent loop; returns how many steps were added."""
        nt, i = data.non_tensor_batch, len(data) - 1
        extra = nt.get(verl_compat.TOOL_EXTRA_FIELDS_KEY)
        if extra is None:
            _warn_once(
                "extra", "rapo reward manager: no tool_extra_fields in the batch (scored outside the agent loop)"
            )
            return 0
        fields = extra[i]
        if not isinstance(fields, Mapping) or "rapo_step_spans" not in fields:
            return 0  # another agent loop's trajectory: nothing known about its steps
        if fields.get("rapo_validate", True):  # unknown counts as validation: never grow from it
            return 0
        if not reward > self.growth.onpolicy_reward_threshold:
            return 0
        group = fields.get("rapo_group")
        if group is None:
            raise ValueError(
                "rapo reward manager: rapo_group: expected the trajectory's group id (on-policy steps need one), got "
                "None: the sample lacks an int field named by the agent loop's group_key, default 'index'"
            )
        p_key, r_key = verl_compat.PROMPT_LEN_KEY, verl_compat.RESPONSE_LEN_KEY
        p_len = int(nt[p_key][i]) if p_key in nt else data.batch["prompts"].shape[-1]
        r_len = int(nt[r_key][i]) if r_key in nt else data.batch["responses"].shape[-1]
        prompt, response = data.batch["prompts"][i, :p_len].tolist(), data.batch["responses"][i, :r_len].tolist()
        skip = self.growth.history_skip_special_tokens
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip)  # noqa: E731
        loop = asyncio.get_running_loop()
        hist, steps = await loop.run_in_executor(
            None,
            lambda: onpolicy_steps(
                prompt,
                response,
                fields["rapo_step_spans"],
                fields["rapo_step_obs_end"],
                reward,
                decode,
                self.growth.onpolicy_reward_threshold,
            ),
        )
        if steps:
            client = await _client(self.growth.buffer_name, loop)
            await self._adds.add(client, hist, steps, [int(group)] * len(steps))
        return len(steps)


def register() -> None:
    """Register RapoRewardManager as verl's reward manager "rapo" (idempotent)."""
    registry = verl_compat.get("verl.experimental.reward_loop.reward_manager.registry:REWARD_MANAGER")
    if registry.get(REWARD_MANAGER_NAME) is not RapoRewardManager:
        verl_compat.get("verl.experimental.reward_loop.reward_manager.registry:register")(REWARD_MANAGER_NAME)(
            RapoRewardManager
        )
