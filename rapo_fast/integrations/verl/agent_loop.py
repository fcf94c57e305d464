"""The RAPO agent loop for verl: verl's multi-turn tool loop (`ToolAgentLoop`) with RAPO's hybrid-policy step.

What it is: `RAPOToolAgentLoop` (the agent loop "rapo_tool_agent"), which runs `ToolAgentLoop` unchanged and, at a
hybrid member's step boundary, may insert the nearest step from the step buffer; with retrieve_prob = 0, a non-hybrid
member or validation the trajectory is exactly ToolAgentLoop's. Data contract and configuration: docs/verl.md
section 2.
What it is not: the step buffer (buffer_actor.py serves it; see `set_step_buffer_client`), the reward or advantage
(advantage.py) or the loss. Not importable without verl.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rapo_fast._checks import brief
from rapo_fast._sections import Section, option, rule_bool, rule_choice, rule_int, section
from rapo_fast.integrations.verl import verl_compat
from rapo_fast.integrations.verl.history_text import HistoryText
from rapo_fast.rollouts.config import HybridConfig

AgentState = verl_compat.get("verl.experimental.agent_loop.tool_agent_loop:AgentState")
ToolAgentLoop = verl_compat.get("verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop")

__all__ = [
    "AGENT_LOOP_NAME",
    "LOOP_KEYS",
    "RapoLoopConfig",
    "RAPOToolAgentLoop",
    "register",
    "resolve_loop_config",
    "set_step_buffer_client",
    "retrieved_fraction",
    "step_entropy_estimate",
]

AGENT_LOOP_NAME = "rapo_tool_agent"
HYBRID_SELECTIONS = ("count", "coin")
_MAX_TRACKED_UIDS = 1 << 16  # member counters kept per process (oldest dropped first)
_MEMBERS: OrderedDict[str, int] = OrderedDict()
# Why an insertion the coin allowed did not happen: the search found nothing; the segment is longer than
# max_retrieve_tokens; it would leave no room for one generated token.
SKIP_REASONS = ("no_result", "too_long", "no_room")
_IN_FLIGHT = 0  # buffer searches this process is awaiting (the queue depth one more search joins)
_CLIENTS: dict[str, Any] = {}


def _nonempty_str(name: str, v: Any) -> None:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected a non-empty str, got {type(v).__name__} {brief(v)}")
    if not v:
        raise ValueError(f"{name}: expected a non-empty str, got ''")


@dataclass(frozen=True)
class _LoopHybrid(HybridConfig):
    """rapo_fast's HybridConfig (n_hybrid, retrieve_prob) as the loop reads it: at the top of the `rapo` section."""

    PATH = "rapo"


@dataclass(frozen=True)
class RapoLoopConfig(Section):
    """The RAPO settings of the agent loop (see the module docstring): which members are hybrid and how often they
    retrieve (`hybrid`, rapo_fast's HybridConfig), the buffer and the group ids. `resolve_loop_config` builds one."""

    PATH = "rapo"
    hybrid: HybridConfig = section(_LoopHybrid)
    group_size: int = option(16, rule_int(1))
    exclude_own_group: bool = option(True, rule_bool())
    buffer_name: str = option("rapo_step_buffer", _nonempty_str)
    max_retrieve_tokens: int | None = option(None, rule_int(1, allow_none=True))
    hybrid_selection: str = option("count", rule_choice(*HYBRID_SELECTIONS))
    group_key: str = option("index", _nonempty_str)
    seed: int | None = option(None, rule_int(0, allow_none=True))
    history_skip_special_tokens: bool = option(True, rule_bool())

    def check_together(self) -> None:
        G, n_hybrid = self.group_size, self.hybrid.n_hybrid
        if n_hybrid > G:
            raise ValueError(f"rapo.n_hybrid: expected an int in [0, group_size={G}], got {n_hybrid}")


# The keys the loop reads from its YAML entry and the trainer config's `rapo` section: flat (rapo.n_hybrid).
LOOP_KEYS = (*HybridConfig.names(), *(n for n in RapoLoopConfig.names() if n != "hybrid"))


def resolve_loop_config(
    trainer_section: Mapping[str, Any] | None, overrides: Mapping[str, Any], rollout_n: int
) -> RapoLoopConfig:
    """The loop's RapoLoopConfig: defaults <- trainer config's `rapo` section <- YAML kwargs (`overrides`, None values
    ignored); unknown keys of the trainer section are ignored (the loss and the buffer read the same section).
    n_hybrid None -> group_size // 2; group_size None -> rollout_n. A bad value raises ValueError (TypeError for a
    wrong type) naming its key ("rapo.n_hybrid")."""
    values: dict[str, Any] = {}
    for source in (trainer_section or {}), overrides:
        for k in LOOP_KEYS:
            v = source.get(k) if hasattr(source, "get") else None
            if v is not None:
                values[k] = v
    hybrid = {k: values.pop(k) for k in HybridConfig.names() if k in values}
    g = values.setdefault("group_size", rollout_n)
    hybrid.setdefault("n_hybrid", g // 2 if type(g) is int else 0)  # a bad group_size is refused below, by name
    return RapoLoopConfig(hybrid=hybrid, **values)


def set_step_buffer_client(name: str, client: Any | None) -> None:
    """Install (or with None remove) the step-buffer client used for buffer `name` in this process. Without one, the
    loop looks up the job's actor(s) `name` (rapo_fast.integrations.verl.buffer_actor.get_step_buffer) on its first
    retrieval."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"set_step_buffer_client: name: expected a non-empty str, got {brief(name)}")
    if client is None:
        _CLIENTS.pop(name, None)
    elif not callable(getattr(client, "retrieve", None)):
        raise TypeError(f"set_step_buffer_client: client: expected an async retrieve(), got {type(client).__name__}")
    else:
        _CLIENTS[name] = client


async def _client(name: str, loop: Any) -> Any:
    """The process's client for buffer `name`: an installed one, else the job's existing named actor(s), looked up
    once per process off the event loop (the lookup blocks on Ray). The driver creates the actors, not the loop."""
    if name not in _CLIENTS:
        from rapo_fast.integrations.verl.buffer_actor import get_step_buffer

        try:
            client = await loop.run_in_executor(None, get_step_buffer, name)
        except ValueError as e:
            raise ValueError(
                f"rapo agent loop: buffer_name: expected a step buffer actor {name!r}, got none; create it on the "
                "driver with rapo_fast.integrations.verl.buffer_actor.get_or_create_step_buffer before rollouts start"
            ) from e
        _CLIENTS.setdefault(name, client)
    return _CLIENTS[name]


def _claim_member(key: str) -> int:
    """The next member number of `key` (a group's uid) in this process: 0, 1, 2, ... in the order runs start."""
    n = _MEMBERS.pop(key, 0)
    _MEMBERS[key] = n + 1
    while len(_MEMBERS) > _MAX_TRACKED_UIDS:
        _MEMBERS.popitem(last=False)
    return n


def retrieved_fraction(retrieved_mask: list[int]) -> float:
    """F = retrieved tokens / response tokens (every response token counts; 0 for an empty response)."""
    return float(sum(retrieved_mask)) / max(1, len(retrieved_mask))


def step_entropy_estimate(logprobs: list[float], response_mask: list[int], start: int, end: int) -> float | None:
    """Mean of -log p over the generated (mask 1) tokens in [start, end) of the response; None when there is none."""
    vals = [-logprobs[j] for j in range(start, min(end, len(response_mask), len(logprobs))) if response_mask[j]]
    return sum(vals) / len(vals) if vals else None


@dataclass
class _RunState:
    """RAPO's per-trajectory state (one agent-loop instance runs one trajectory, as verl instantiates them)."""

    hybrid: bool
    active: bool
    group: int | None
    coin: random.Random
    steps: list[list[int]] = field(default_factory=list)  # [start, end) of each assistant turn, response coords
    retrievals: list[list[int]] = field(default_factory=list)  # [start, end, step before, step after or -1, pid]
    validate: bool = False  # a validation rollout (recorded for the buffer growth: it never adds these)
    group_id: int | None = None  # the sample's group id whether or not this member retrieves
    # what the retrievals did, for verl's metrics stream (metrics.py): searches asked, insertions skipped by reason,
    # each search's top score, its latency as this loop saw it and the searches then in flight in this process
    calls: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    scores: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    history: HistoryText | None = None  # the running history's text, made at the first retrieval


class RAPOToolAgentLoop(ToolAgentLoop):
    """verl's ToolAgentLoop plus RAPO's retrieval at step boundaries (module docstring). Constructed by verl through
    hydra like every agent loop; the RAPO knobs are keyword arguments (YAML) or the trainer config's `rapo` section."""

    def __init__(self, *args: Any, **kwargs: Any):
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in LOOP_KEYS}
        super().__init__(*args, **kwargs)
        section = self.config.get("rapo") if hasattr(self.config, "get") else None
        self.rapo = resolve_loop_config(section, overrides, int(self.rollout_config.n))
        self._rapo_state: _RunState | None = None

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any):
        # Everything up to the first await runs in task-start order: member numbers follow verl's batch order.
        self._rapo_state = self._start_state(kwargs)
        output = await super().run(sampling_params, priority=priority, **kwargs)
        output.extra_fields.update(self._rapo_fields(output))
        return output

    def _start_state(self, kwargs: Mapping[str, Any]) -> _RunState:
        cfg = self.rapo
        validate = kwargs.get("validate")
        validate = verl_compat.validate_flag() if validate is None else bool(validate)
        uid = kwargs.get(verl_compat.UID_KEY)
        key = str(uid if uid is not None else kwargs.get(cfg.group_key))
        # verl's v1 worker (AgentLoopWorkerTQ, the default trainer) passes each copy's index in [0, n) as session_id:
        # exact for any num_workers. The legacy worker passes none: the per-process counter then stands in.
        session = kwargs.get(verl_compat.SESSION_KEY)
        if isinstance(session, int) and not isinstance(session, bool) and session >= 0:
            member = session
        else:
            member = _claim_member(key)
        seed = None if cfg.seed is None else f"{cfg.seed}:{key}:{member}"
        coin = random.Random(seed)
        if cfg.hybrid_selection == "count":
            hybrid = member % cfg.group_size < cfg.hybrid.n_hybrid
        else:
            hybrid = coin.random() < cfg.hybrid.n_hybrid / cfg.group_size
        hybrid = hybrid and not validate
        p = cfg.hybrid.retrieve_prob
        active = hybrid and (callable(p) or p > 0.0)
        group = None
        if active and cfg.exclude_own_group:
            if kwargs.get(cfg.group_key) is None:
                raise ValueError(
                    f"rapo agent loop: {cfg.group_key!r} (group_key): expected the sample's group id in this non-tensor"
                    f" field (exclude_own_group), got fields {sorted(kwargs)}"
                )
            group = int(kwargs[cfg.group_key])
        gid = kwargs.get(cfg.group_key)
        try:
            gid = None if gid is None else int(gid)
        except (TypeError, ValueError):
            gid = None  # not a group id: an error only where one is needed (exclusion above, buffer growth)
        return _RunState(hybrid=hybrid, active=active, group=group, coin=coin, validate=bool(validate), group_id=gid)

    async def ct_merge_assistant_token(self, runtime_token_ids, assistant_token_ids, response_mask, *args, **kwargs):
        merge_result, mask, logprobs = await super().ct_merge_assistant_token(
            runtime_token_ids, assistant_token_ids, response_mask, *args, **kwargs
        )
        st = self._rapo_state
        if st is not None:
            st.steps.append([len(mask) - merge_result.appended_token_count, len(mask)])
            for r in st.retrievals:
                if r[3] < 0:
                    r[3] = len(st.steps) - 1
        return merge_result, mask, logprobs

    async def _handle_processing_tools_state(self, agent_data) -> AgentState:
        state = await super()._handle_processing_tools_state(agent_data)
        st = self._rapo_state
        if state != AgentState.GENERATING or st is None or not st.active:
            return state
        p = self.rapo.hybrid.retrieve_prob
        p = p(len(st.steps)) if callable(p) else p
        if st.coin.random() < p:
            await self._retrieve_into(agent_data, st)
        return state

    async def _retrieve_into(self, agent_data, st: _RunState) -> None:
        """Search the buffer with the running history's text and append the step's segment as context tokens."""
        if st.history is None:  # the trajectory's text, decoded only where it grew since the last retrieval
            skip = self.rapo.history_skip_special_tokens
            st.history = HistoryText(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip))
        history = await self.loop.run_in_executor(None, st.history, agent_data.prompt_ids)
        exclude = [st.group] if self.rapo.exclude_own_group else None
        client = await _client(self.rapo.buffer_name, self.loop)
        global _IN_FLIGHT
        st.calls += 1
        st.in_flight.append(_IN_FLIGHT)
        _IN_FLIGHT += 1
        t0 = time.perf_counter()
        try:
            results = await client.retrieve([history], exclude)
        finally:
            _IN_FLIGHT -= 1
        st.latency_s.append(time.perf_counter() - t0)
        seg, pid = results[0][0], results[0][1]
        if seg is None or len(seg) == 0:
            st.skipped["no_result"] += 1
            return
        st.scores.append(float(results[0][2]))
        if self.rapo.max_retrieve_tokens is not None and len(seg) > self.rapo.max_retrieve_tokens:
            st.skipped["too_long"] += 1
            return
        start = len(agent_data.response_mask)
        if start + len(seg) >= self.response_length:  # no room left for the next step
            st.skipped["no_room"] += 1
            return
        seg = [int(t) for t in seg]
        agent_data.prompt_ids = list(agent_data.prompt_ids) + seg
        agent_data.response_mask = list(agent_data.response_mask) + [0] * len(seg)
        if agent_data.response_logprobs:
            agent_data.response_logprobs = list(agent_data.response_logprobs) + [0.0] * len(seg)
        st.retrievals.append([start, start + len(seg), len(st.steps) - 1, -1, int(pid)])

    def _rapo_fields(self, output) -> dict[str, Any]:
        """The data-contract fields, computed on the final (truncated) response that verl's batch holds."""
        st = self._rapo_state
        n = len(output.response_ids)
        flags = [0] * n
        for start, end, *_ in st.retrievals:
            flags[start : min(end, n)] = [1] * max(0, min(end, n) - start)
        mask, logprobs = list(output.response_mask), output.response_logprobs
        ents = [step_entropy_estimate(logprobs, mask, s, e) if logprobs is not None else None for s, e in st.steps]
        h_before, h_after, pairs = [], [], []
        for *_, before, after, _pid in st.retrievals:
            if after < 0 or ents[before] is None or ents[after] is None:
                continue
            h_before.append(ents[before])
            h_after.append(ents[after])
            pairs.append([before, after])
        return {
            "rapo_retrieved_mask": flags,
            "rapo_f_ret": retrieved_fraction(flags),
            "rapo_h_before": h_before,
            "rapo_h_after": h_after,
            "rapo_hybrid": st.hybrid,
            "rapo_num_retrievals": len(st.retrievals),
            "rapo_step_spans": [[min(s, n), min(e, n)] for s, e in st.steps],
            "rapo_step_obs_end": _obs_ends(st, n),
            "rapo_retrieval_steps": pairs,
            "rapo_validate": st.validate,
            "rapo_group": st.group_id,
            "rapo_retrieve_calls": st.calls,
            **{f"rapo_skipped_{reason}": n for reason, n in st.skipped.items()},
            "rapo_retrieval_scores": list(st.scores),
            "rapo_retrieve_latency_s": list(st.latency_s),
            "rapo_retrieve_in_flight": list(st.in_flight),
        }


def _obs_ends(st: _RunState, n: int) -> list[int]:
    """Per step, where its observation ends: the next retrieved segment's or step's start, else the response end."""
    starts = sorted([r[0] for r in st.retrievals] + [s for s, _ in st.steps])
    return [min(next((x for x in starts if x >= e), n), n) for _, e in st.steps]


def register() -> None:
    """Register RAPOToolAgentLoop as verl's agent loop "rapo_tool_agent" (idempotent). An agent_loop_config_path
    entry with the same name, loaded later by verl's AgentLoopWorker, replaces it (with its YAML kwargs)."""
    verl_compat.get("verl.experimental.agent_loop.agent_loop:register")(AGENT_LOOP_NAME)(RAPOToolAgentLoop)
