"""The rollout strategies as small classes with one interface, registered by name: `STRATEGY_REGISTRY`, `strategy_for`.

What this is: `RolloutStrategy` (the hooks the lockstep loop calls) and its four built-ins, "on_policy", "hybrid",
"arpo" and "offpolicy_traj", each reading its own sub-config of RolloutConfig. Spec: docs/rollout.md section 2.
What this is not: the loop (rapo_fast/rollouts/loop.py) or the settings (rapo_fast/rollouts/config.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from rapo_fast.rollouts.batch import KIND_RET
from rapo_fast.rollouts.config import STRATEGIES, STRATEGY_CONFIG_FIELDS, RolloutConfig
from rapo_fast.rollouts.rows import Row, RowState, prompt_ids

__all__ = [
    "RolloutStrategy",
    "OnPolicyStrategy",
    "HybridStrategy",
    "ARPOStrategy",
    "OffPolicyTrajStrategy",
    "STRATEGY_REGISTRY",
    "register_strategy",
    "strategy_for",
]

STRATEGY_REGISTRY: dict[str, type[RolloutStrategy]] = {}


def register_strategy(cls: type[RolloutStrategy]) -> type[RolloutStrategy]:
    """Class decorator: register a strategy under cls.name (one of STRATEGIES, its sub-config field matching)."""
    if cls.name not in STRATEGIES or STRATEGY_CONFIG_FIELDS[cls.name] != cls.config_field:
        raise ValueError(f"register_strategy: expected an entry of STRATEGIES, got {cls.name!r} / {cls.config_field!r}")
    STRATEGY_REGISTRY[cls.name] = cls
    return cls


def strategy_for(cfg: RolloutConfig, *, traces=None, offpolicy=None) -> RolloutStrategy:
    """The strategy object of one rollout (its resources checked: ValueError naming what is missing)."""
    strategy = STRATEGY_REGISTRY[cfg.strategy](cfg, traces=traces, offpolicy=offpolicy)
    strategy.check()
    return strategy


class RolloutStrategy:
    """The hooks of the lockstep loop (rapo_fast/rollouts/loop.py), each a no-op here: on-policy sampling."""

    name: ClassVar[str]
    config_field: ClassVar[str | None] = None  # the RolloutConfig field this strategy reads
    # True when a finished row's cache may be needed again (ARPO copies rows into slots and restarts them): the loop
    # then never drops finished rows from the engine
    reuses_rows: ClassVar[bool] = False

    def __init__(self, cfg: RolloutConfig, *, traces=None, offpolicy=None):
        self.cfg, self.traces, self.offpolicy = cfg, traces, offpolicy
        self.sub = getattr(cfg, self.config_field) if self.config_field else None

    def check(self) -> None:
        """Refuse a rollout whose resources (step buffer, off-policy source) are missing."""

    @property
    def n_hybrid(self) -> int:
        """Hybrid rows at the start of each group."""
        return 0

    def plan(self, problems: Sequence, coin: random.Random) -> list[int]:
        """Generated rows per problem (the first coin draws of the rollout happen here, if any)."""
        return [self.cfg.group_size] * len(problems)

    def start(self, loop: Any) -> None:
        """Called once after the prompts are prefilled."""

    def at_boundaries(self, loop: Any, rows: list[int]) -> None:
        """Rows (indices) just past a tool result, before their next token; the loop then marks them RUNNING."""

    def before_sample(self, rows: list[int]) -> None:
        """Rows about to sample a token."""

    def after_sample(self, rows: list[int]) -> None:
        """Rows that just sampled (and recorded) a token."""

    def refresh(self) -> bool:
        """Every started row has ended: start more (True if any started)."""
        return False

    def extra_rows(self, tokenizer, problems: Sequence) -> list[Row]:
        """Finished rows appended after the generated ones."""
        return []


@register_strategy
class OnPolicyStrategy(RolloutStrategy):
    name = "on_policy"


@register_strategy
class HybridStrategy(RolloutStrategy):
    """RAPO: the first n_hybrid rows of a group retrieve the top-1 step with probability retrieve_prob at each tool
    result boundary; the step is queued (mode "exact") or its K/V spliced into the cache (mode "splice")."""

    name, config_field = "hybrid", "hybrid"

    def check(self) -> None:
        if self.sub.n_hybrid > 0 and self.traces is None:
            raise ValueError("rollout: traces: expected a StepTraces with strategy='hybrid' and n_hybrid > 0, got None")

    @property
    def n_hybrid(self) -> int:
        return self.sub.n_hybrid

    def start(self, loop: Any) -> None:
        own = self.cfg.exclude_own_group
        self.exclude = self.traces is not None and (self.traces.has_on_policy if own is None else own)
        if self.sub.at_prompt:  # the prompt's end is a boundary too: a hybrid row may retrieve before step 0
            for r in loop.rows:
                if r.hybrid and r.state is RowState.RUNNING:
                    r.state = RowState.BOUNDARY

    def at_boundaries(self, loop: Any, rows: list[int]) -> None:
        """A hybrid row retrieves with probability retrieve_prob(step) (one coin draw per hybrid row, in row order)."""
        p_of = self.sub.retrieve_prob
        cand = []
        for i in rows:
            r = loop.rows[i]
            if r.hybrid:
                p = p_of(len(r.steps)) if callable(p_of) else p_of
                if loop.coin.random() < p:
                    cand.append(i)
        if cand:
            self._retrieve(loop, cand)

    def _retrieve(self, loop: Any, cand: list[int]) -> None:
        """Top-1 step for each candidate row's history, queued (exact mode) or spliced into the cache (splice)."""
        t0 = time.perf_counter()
        hist = [loop.tokenizer.decode(loop.rows[i].tokens) for i in cand]
        segs, pids, _ = self.traces.retrieve(hist, [loop.rows[i].group for i in cand] if self.exclude else None)
        loop.timings["retrieval"] += time.perf_counter() - t0
        spliced = []
        for i, seg, pid in zip(cand, segs, pids.tolist()):
            if seg is None:
                continue
            r = loop.rows[i]
            r.retrievals.append([len(r.steps), pid, len(seg)])
            if self.cfg.mode == "splice":
                spliced.append((i, seg, pid))
            else:
                r.append(seg, KIND_RET)
                r.to_feed.extend(seg)
        if spliced:
            from rapo_fast.rollouts.splice import splice_segments

            t0 = time.perf_counter()
            splice_segments(loop.engine, loop.rows, spliced, self.traces)
            loop.timings["splice"] += time.perf_counter() - t0


@register_strategy
class ARPOStrategy(RolloutStrategy):
    """ARPO: `initial` rows per group start; the brancher copies rows after tool results and restarts slots."""

    name, config_field = "arpo", "arpo"
    reuses_rows = True

    def start(self, loop: Any) -> None:
        from rapo_fast.rollouts.arpo import ArpoBrancher

        a = self.sub
        self.brancher = ArpoBrancher(
            loop.rows,
            loop.engine,
            self.cfg.group_size,
            self.cfg.n_initial,
            a.beam,
            a.k,
            a.alpha,
            a.beta,
            loop.coin,
            rule=a.rule,
            topk=a.topk,
            temperature=self.cfg.temperature,
        )

    def before_sample(self, rows: list[int]) -> None:
        self.brancher.before_sample(rows)

    def after_sample(self, rows: list[int]) -> None:
        self.brancher.after_sample(rows)

    def refresh(self) -> bool:
        return self.brancher.refresh()


@register_strategy
class OffPolicyTrajStrategy(RolloutStrategy):
    """n_offpolicy members of each group are whole trajectories of `offpolicy` (an OffPolicyTrajectories), drawn by
    the coin before any token is sampled and appended after the on-policy rows; a prompt without any stays
    on-policy."""

    name, config_field = "offpolicy_traj", "offpolicy_traj"

    def check(self) -> None:
        if self.offpolicy is None:
            raise ValueError("rollout: offpolicy: expected OffPolicyTrajectories for 'offpolicy_traj', got None")

    def plan(self, problems: Sequence, coin: random.Random) -> list[int]:
        self.picks = [self.offpolicy.pick(p.qid, self.sub.n_offpolicy, coin) for p in problems]
        return [self.cfg.group_size - len(pk) for pk in self.picks]

    def extra_rows(self, tokenizer, problems: Sequence) -> list[Row]:
        """The picked trajectories as finished rows (never fed to the model: the trainer scores them with the current
        policy like every row)."""
        from rapo_fast.rollouts.offpolicy import trajectory_tokens

        out = []
        for pi, (prob, records) in enumerate(zip(problems, self.picks)):
            for rec in records:
                r = Row(prompt_ids(tokenizer, prob), int(prob.qid), pi, False, RowState.DONE)
                ids, kinds, steps = trajectory_tokens(rec, tokenizer)
                base = len(r.tokens)
                r.append(ids, kinds)
                r.steps = [[a + base, b + base, c + base] for a, b, c in steps]
                out.append(r)
        return out
