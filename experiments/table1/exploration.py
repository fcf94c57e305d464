"""Exploration, RAPO's mechanism, measured per run: when a run first sees a reward, how many of its groups carry a
learning signal, and where its retrievals happen.

What this is: `ExplorationReader`, a trainer callback that reads every step's rollouts (trainer.last_batch against
trainer.last_problems, diagnostics.read_batch) and keeps, per run: the first step with a rewarded row (any row, and
an on-policy row: the policy on its own), the share of groups whose rewards are not all equal per step (a group whose
rewards are equal has zero group-relative advantage: no signal), and the retrieved steps by hop (hop 1 is the step
right after the prompt). `figures()` gives the CSV columns. What this is not: the held-out evaluation or the checks.
"""

from __future__ import annotations

import math

from experiments.table1.diagnostics import read_batch
from rapo_fast.train.callbacks import TrainerCallback

HOPS = 3  # the chains' length: retrievals are counted at hops 1..HOPS


class ExplorationReader(TrainerCallback):
    """Per-run exploration figures (module docstring)."""

    def __init__(self):
        self.first_reward: int | None = None
        self.first_onpolicy_reward: int | None = None
        self.signal: list[float] = []  # per step: share of groups with non-zero reward variance
        self.retrievals = [0] * HOPS
        self.hybrid_rows = 0

    def on_step_end(self, trainer, step: int, metrics: dict):
        batch, problems = trainer.last_batch, trainer.last_problems
        off = getattr(batch, "offpolicy_rows", None)
        groups: dict[int, set[bool]] = {}
        for i, r in enumerate(read_batch(problems, batch, hint_copies=False)):
            if off is not None and bool(off[i]):
                continue  # a whole off-policy trajectory: its reward is the source's, not the run's exploration
            groups.setdefault(int(batch.group_ids[i]), set()).add(bool(r["success"]))
            hybrid = bool(batch.hybrid[i])
            self.hybrid_rows += hybrid
            if r["success"] and self.first_reward is None:
                self.first_reward = step
            if r["success"] and not hybrid and self.first_onpolicy_reward is None:
                self.first_onpolicy_reward = step
            own = [s for s in r["segments"] if s["kind"] != "answer"]
            for hop, s in enumerate(own[:HOPS]):
                self.retrievals[hop] += s["kind"] == "ret"
        self.signal.append(sum(len(v) > 1 for v in groups.values()) / len(groups) if groups else math.nan)
        return None

    def figures(self) -> dict:
        """The run's CSV columns: first_reward_step / first_onpolicy_reward_step ('' when never), signal_frac (mean
        over steps of the share of groups with a learning signal), retrievals_hop1..3 (retrieved steps at each hop
        over the run), hybrid_rows."""
        steps = [x for x in self.signal if not math.isnan(x)]
        out = {
            "first_reward_step": "" if self.first_reward is None else self.first_reward,
            "first_onpolicy_reward_step": "" if self.first_onpolicy_reward is None else self.first_onpolicy_reward,
            "signal_frac": sum(steps) / len(steps) if steps else math.nan,
            "hybrid_rows": self.hybrid_rows,
        }
        out |= {f"retrievals_hop{h + 1}": n for h, n in enumerate(self.retrievals)}
        return out


def hop_split(reads: list[dict]) -> dict:
    """Greedy held-out success split at the first hop (diagnostics.read_greedy's reads): `hop1_right`, the share of
    questions whose first step is the policy's right hop 1, and `success_after_hop1`, the success among those (NaN
    without any): what retrieval at hop 1 can and cannot teach (the retrieved step itself gets no gradient)."""
    first = [bool(r["segments"]) and r["segments"][0]["kind"] == "own" and bool(r["segments"][0]["hop"]) for r in reads]
    right = [r for r, ok in zip(reads, first) if ok]
    return {
        "hop1_right": sum(first) / len(reads) if reads else math.nan,
        "success_after_hop1": sum(r["success"] for r in right) / len(right) if right else math.nan,
    }


def auc(curve: list[tuple[int, float]]) -> float:
    """The area under a (step, success) curve by the trapezoid rule, divided by its span of steps: the mean held-out
    success over training (the curve's one value when it has one point)."""
    if not curve:
        return math.nan
    if len(curve) == 1 or curve[-1][0] == curve[0][0]:
        return float(curve[-1][1])
    area = sum((s1 - s0) * (v0 + v1) / 2.0 for (s0, v0), (s1, v1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


__all__ = ["ExplorationReader", "HOPS", "auc", "hop_split"]
