"""Whole off-policy trajectories for trajectory-level off-policy training (LUFFY-style), the baseline that RAPO's
step-level retrieval is compared against.

What this is: `OffPolicyTrajectories` (the top-K trajectories per query of the step buffer's JSONL source) and
`trajectory_tokens` (one record in the rollout's token format), used by `rapo_fast.rollout(strategy="offpolicy_traj")`.
What this is not: step-level retrieval (rapo_fast.retrieval.step_traces) or the shaped loss (rapo_fast.rapo_loss with
offpolicy_train="shaped").
"""

from __future__ import annotations

import random
from pathlib import Path

from rapo_fast._checks import check_int
from rapo_fast._tokens import encode_plain
from rapo_fast.rollouts.batch import KIND_OFF, KIND_TOOL

__all__ = ["OffPolicyTrajectories", "split_step", "trajectory_tokens"]


def split_step(step: str, tokenizer) -> tuple[list[int], list[int]]:
    """One step's text in the rollout's token format: (the model's tokens up to and including `</tool>`, the tool
    output after it); a step without `</tool>` (the answer) is all model tokens. Shared with the SFT warm-up
    (rapo_fast/train/sft.py), which renders solutions the same way."""
    gen, sep, obs = step.partition("</tool>")
    gen_ids = encode_plain(tokenizer, gen + (" </tool>" if sep else ""))  # mid-sequence: no special tokens
    return gen_ids, (encode_plain(tokenizer, obs) if obs.strip() else [])


def trajectory_tokens(record: dict, tokenizer) -> tuple[list[int], list[int], list[list[int]]]:
    """(ids, kinds, steps) of a record's response (after its prompt): kinds KIND_OFF / KIND_TOOL per token; steps
    [start, end_model, end_with_tool_output] relative to the response's first token, the answer last (as a rollout
    records its steps)."""
    ids: list[int] = []
    kinds: list[int] = []
    steps: list[list[int]] = []
    for step in list(record["steps"]) + [record["answer"]]:
        gen_ids, obs_ids = split_step(step, tokenizer)
        start = len(ids)
        ids += gen_ids + obs_ids
        kinds += [KIND_OFF] * len(gen_ids) + [KIND_TOOL] * len(obs_ids)
        steps.append([start, start + len(gen_ids), len(ids)])
    return ids, kinds, steps


class OffPolicyTrajectories:
    """The top `top_k` trajectories per query id (highest reward first; ties: file order) of a JSONL source."""

    def __init__(self, records: list[dict], top_k: int = 5):
        from rapo_fast.retrieval.step_traces import top_k_by_reward

        check_int("OffPolicyTrajectories: top_k", top_k, lo=1)
        self.by_query: dict[int, list[dict]] = {}
        for r in top_k_by_reward(records, top_k):
            self.by_query.setdefault(int(r["query_id"]), []).append(r)

    @classmethod
    def from_jsonl(cls, path: str | Path, top_k: int = 5) -> OffPolicyTrajectories:
        from rapo_fast.retrieval.jsonl import read_jsonl

        return cls(read_jsonl(path), top_k)

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_query.values())

    def pick(self, qid: int, n: int, coin: random.Random) -> list[dict]:
        """n of query qid's trajectories, drawn without replacement by `coin` (cycling through them when fewer
        than n are kept); [] when the query has none (its group then stays on-policy)."""
        pool = self.by_query.get(int(qid), [])
        if not pool or n <= 0:
            return []
        order = coin.sample(range(len(pool)), len(pool))
        return [pool[order[j % len(pool)]] for j in range(n)]
