"""Retrieval in the paper's form for the aliased knowledge base: a retrieved step that advances this trajectory.

What this is: `AdvancingTraces`, a StepTraces whose `retrieve` keeps the search (the source's nearest step by
history) but shows, instead of the source's own step, that step's relation applied to THIS row's current entity in
THIS row's facts (`task`, the knowledge base the rollout's tool answers from), with its observation: the retrieved
step takes the hop for the trajectory and the policy continues from there. It never retrieves the last hop of a
question's chain or anything after it (the retrieved observation would be the answer, or the chain is complete):
a deviation from the paper, stated in experiments/table1/design.md. `advanced_step` is the rewrite alone,
`advance_step` the warm-up's retrieve style that matches it. Two other sources of the same form: `NoisyTraces` (a
share of the steps shown apply a wrong relation: the fourth round's noisy arm) and `OracleTraces` (always the right
relation: the positive control's).
What this is not: a retrieval backend (the search, the keys and the payload ids are StepTraces'), or usable with
mode "splice" (the segment shown is not the stored one whose K/V the splice would copy).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import torch

from experiments.table1.kb import RELATIONS
from rapo_fast.retrieval.step_traces import RETRIEVE_CLOSE, RETRIEVE_OPEN, StepTraces

_CALL = re.compile(r"search\s+(\S+)\s+(\S+)")
_OBS = re.compile(r"<obs>\s*(\S+)\s*</obs>")
_ASK = re.compile(r"ask\s+(.*?)\s*(?:<think>|$)", re.S)


def chain_length(task, history: str) -> int:
    """Hops of the question `history` starts with: its alias's chain (task.alias_of) or, asked explicitly, the
    relations it names."""
    m = _ASK.search(history)
    if m is None:
        raise ValueError(f"chain_length: history must start with a question `ask ...`, got {history[:60]!r}")
    words = m.group(1).split()[:-1]  # the last word is the start entity
    by_alias = {a: c for c, a in task.alias_of.items()}
    if len(words) == 1 and words[0] in by_alias:
        return len(by_alias[words[0]])
    return len(words)


def _position(task, history: str) -> tuple[int, str]:
    """(hops the history has taken, its current entity: the last observation, else the question's start)."""
    body = history.split("ask", 1)[-1]
    obs = _OBS.findall(body)
    return body.count("</tool>"), obs[-1] if obs else body.split("<think>", 1)[0].split()[-1]


def advanced_step(task, history: str, source_step: str, relation: str | None = None) -> str | None:
    """The step shown for `history` when the source's nearest step is `source_step` (text with a `search rel ent`
    call): `rel` (or `relation`, when given) applied to the history's current entity (its last observation, else the
    question's start) in `task`'s facts, with the observation the tool would return. None when the history has
    already taken chain_length - 1 steps (the next one is the last hop) or `source_step` has no search call."""
    done, cur = _position(task, history)
    if done >= chain_length(task, history) - 1:
        return None
    call = _CALL.search(source_step)
    if call is None:
        return None
    rel = relation or call.group(1)
    return task.step_text(rel, cur, task.execute(f"search {rel} {cur}").split()[1])


class AdvancingTraces(StepTraces):
    """StepTraces with the paper-form retrieval (module docstring). Set `task` to the knowledge base the rollout's
    tool answers from before each rollout (the step family's trainer does, every step). `relation` picks the
    relation shown: the source's (here), a noisy source's (NoisyTraces) or the right one (OracleTraces)."""

    task = None
    label = "nearest source step"

    def relation(self, history: str, source_step: str) -> str | None:
        """The relation of the step shown: the source's nearest step's (None: the step's own, advanced_step)."""
        return None

    def retrieve(
        self,
        histories: Sequence[str],
        exclude_groups: Sequence[int] | None = None,
        min_score: float | None = None,
        backend: str = "auto",
    ) -> tuple[list[list[int] | None], torch.Tensor, torch.Tensor]:
        """StepTraces.retrieve, each found segment rewritten by `advanced_step` (payload id -1 and no segment where
        it gives none: no retrieval happened)."""
        if self.task is None:
            raise ValueError("AdvancingTraces.retrieve: set .task (the rollout's knowledge base) first, got None")
        segs, pids, scores = super().retrieve(histories, exclude_groups, min_score, backend)
        pids = pids.clone()
        out: list[list[int] | None] = []
        for i, (h, seg) in enumerate(zip(histories, segs)):
            src = None if seg is None else self.tokenizer.decode(seg)
            step = None if src is None else advanced_step(self.task, h, src, self.relation(h, src))
            if step is None:
                pids[i] = -1
                out.append(None)
            else:
                # mid-sequence: the demo's word tokenizer adds no BOS to a plain encode
                out.append(list(self.tokenizer.encode(f"{RETRIEVE_OPEN} {step} {RETRIEVE_CLOSE}")))
        return out, pids, scores


class NoisyTraces(AdvancingTraces):
    """A noisy source: with probability `noise` the step shown applies a wrong relation (another relation of the
    current entity's type where there is one, else any other), drawn from `rng` (seeded per run: reproducible;
    without one, no step is replaced). The fair family's own source is one too, with a small `noise`
    (families.HopOneFamily.source_noise): its nearest source step at hop 1 is nearly always right by itself."""

    noise = 0.45  # the near-oracle source is right ~0.9 after a right prefix: ~0.5 with this share replaced
    rng: random.Random | None = None
    label = "noisy source step"

    def relation(self, history: str, source_step: str) -> str | None:
        call = _CALL.search(source_step)
        if call is None or self.rng is None or self.rng.random() >= self.noise:
            return None
        rel, cur = call.group(1), _position(self.task, history)[1]
        kind = self.task.entity_type.get(cur)
        same = [r for r in RELATIONS if r != rel and RELATIONS[r][0] == kind]
        return self.rng.choice(same or [r for r in RELATIONS if r != rel])


class OracleTraces(AdvancingTraces):
    """An oracle source (the positive control's): the step shown applies the question's right next relation
    (its alias's chain, task.alias_of) to the current entity, whatever the nearest source step was."""

    label = "oracle"

    def relation(self, history: str, source_step: str) -> str | None:
        m = _ASK.search(history)
        words = m.group(1).split()[:-1] if m else []
        chains = {a: c for c, a in self.task.alias_of.items()}
        chain = chains.get(words[0]) if len(words) == 1 else tuple(words[::-1])
        done = _position(self.task, history)[0]
        return chain[done] if chain is not None and done < len(chain) else None


def advance_step(problem, k: int, solution: Sequence[str]) -> tuple[str, bool] | None:
    """The warm-up's retrieve style of kb_alias_step (rapo_fast.train.sft.RetrieveStyle): as replace_step (the
    block stands for the step), but never the last step before the answer, which AdvancingTraces never supplies."""
    return None if k >= len(solution) - 2 else (solution[k], False)


__all__ = ["AdvancingTraces", "NoisyTraces", "OracleTraces", "advance_step", "advanced_step", "chain_length"]
