"""Retrieval in the paper's form for the aliased knowledge base: a retrieved step that advances this trajectory.

What this is: `AdvancingTraces`, a StepTraces whose `retrieve` keeps the search (the source's nearest step by
history) but shows, instead of the source's own step, that step's relation applied to THIS row's current entity in
THIS row's facts (`task`, the knowledge base the rollout's tool answers from), with its observation: the retrieved
step takes the hop for the trajectory and the policy continues from there. It never retrieves the last hop of a
question's chain or anything after it (the retrieved observation would be the answer, or the chain is complete):
a deviation from the paper, stated in experiments/table1/design.md. `advanced_step` is the rewrite alone,
`advance_step` the warm-up's retrieve style that matches it.
What this is not: a retrieval backend (the search, the keys and the payload ids are StepTraces'), or usable with
mode "splice" (the segment shown is not the stored one whose K/V the splice would copy).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

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


def advanced_step(task, history: str, source_step: str) -> str | None:
    """The step shown for `history` when the source's nearest step is `source_step` (text with a `search rel ent`
    call): `rel` applied to the history's current entity (its last observation, else the question's start) in
    `task`'s facts, with the observation the tool would return. None when the history has already taken
    chain_length - 1 steps (the next one is the last hop) or `source_step` has no search call."""
    body = history.split("ask", 1)[-1]
    done = body.count("</tool>")
    if done >= chain_length(task, history) - 1:
        return None
    call = _CALL.search(source_step)
    if call is None:
        return None
    obs = _OBS.findall(body)
    cur = obs[-1] if obs else body.split("<think>", 1)[0].split()[-1]
    rel = call.group(1)
    return task.step_text(rel, cur, task.execute(f"search {rel} {cur}").split()[1])


class AdvancingTraces(StepTraces):
    """StepTraces with the paper-form retrieval (module docstring). Set `task` to the knowledge base the rollout's
    tool answers from before each rollout (the step family's trainer does, every step)."""

    task = None

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
            step = None if seg is None else advanced_step(self.task, h, self.tokenizer.decode(seg))
            if step is None:
                pids[i] = -1
                out.append(None)
            else:
                # mid-sequence: the demo's word tokenizer adds no BOS to a plain encode
                out.append(list(self.tokenizer.encode(f"{RETRIEVE_OPEN} {step} {RETRIEVE_CLOSE}")))
        return out, pids, scores


def advance_step(problem, k: int, solution: Sequence[str]) -> tuple[str, bool] | None:
    """The warm-up's retrieve style of kb_alias_step (rapo_fast.train.sft.RetrieveStyle): as replace_step (the
    block stands for the step), but never the last step before the answer, which AdvancingTraces never supplies."""
    return None if k >= len(solution) - 2 else (solution[k], False)


__all__ = ["AdvancingTraces", "advance_step", "advanced_step", "chain_length"]
