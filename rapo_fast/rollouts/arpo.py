"""ARPO's entropy-adaptive branching (arXiv 2507.19849) inside the lockstep rollout.

What this is: the branching policy. Each prompt has `group_size` row slots; `initial` of them start. A row's initial
entropy H_init is the mean entropy of the first k generated tokens of its step 0. After each tool result, once the next
step has k tokens (or ends), its mean entropy H_t gives the normalised rise dH = (H_t - H_init) / H_init, and the row
branches with probability alpha + beta * dH (clamped to [0, 1]): up to beam - 1 free slots of its group become copies
of the row as it was right after the tool result (same tokens, same cache columns) and sample that step afresh. When
all started rows of a prompt have ended and slots remain, fresh rollouts start from the prompt. A branch does not
branch again on the step it was created at. What this is not: advantage
attribution (rapo_fast.train.trainer.hard_attribution).
"""

from __future__ import annotations

import random

import torch


class ArpoBrancher:
    """The branching state of one ARPO rollout over its rows (see the module docstring); `rollout` calls
    before_sample / after_sample around each sampled token and `refresh` when every started row has ended."""

    def __init__(
        self,
        rows,
        engine,
        group_size: int,
        initial: int,
        beam: int,
        k: int,
        alpha: float,
        beta: float,
        coin: random.Random,
    ):
        if not 1 <= initial <= group_size:
            raise ValueError(f"rollout: arpo_initial must be in [1, group_size={group_size}], got {initial!r}")
        if beam < 1 or k < 1:
            raise ValueError(f"rollout: arpo_beam and arpo_k must be >= 1, got {beam!r}, {k!r}")
        self.rows, self.engine, self.G, self.initial = rows, engine, group_size, initial
        self.beam, self.k, self.alpha, self.beta, self.coin = beam, k, alpha, beta, coin
        self.groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            self.groups.setdefault(r.pidx, []).append(i)
            r.arpo = {"h_init": None, "ents": [], "step": -1, "checked": False, "snap": None, "logits": None}
        self.num_branches = 0

    def before_sample(self, samp: list[int]) -> None:
        for i in samp:
            r = self.rows[i]
            if r.cur_start is None:  # the first token of a new step: remember where a branch would restart
                a = r.arpo
                a["step"], a["ents"] = len(r.steps), []
                if a["step"] > 0 and not a.pop("skip_check", False):
                    a["checked"] = False
                    a["snap"] = r.snapshot()
                    a["logits"] = self.engine.last_logits[i].clone()
                elif a["step"] > 0:
                    a["checked"] = True

    def after_sample(self, samp: list[int]) -> None:
        for i in samp:
            r = self.rows[i]
            a = r.arpo
            a["ents"].append(r.ent[-1])
            step_over = r.cur_start is None or r.done
            if len(a["ents"]) != self.k and not step_over:
                continue
            if len(a["ents"]) > self.k:
                continue
            h = sum(a["ents"]) / len(a["ents"])
            if a["step"] == 0:
                if a["h_init"] is None:
                    a["h_init"] = h
            elif not a["checked"]:
                a["checked"] = True
                self._maybe_branch(i, h)

    def _maybe_branch(self, src: int, h: float) -> None:
        r = self.rows[src]
        h0 = r.arpo["h_init"]
        rise = (h - h0) / h0 if h0 and h0 > 0 else 0.0
        p = min(1.0, max(0.0, self.alpha + self.beta * rise))
        if self.coin.random() >= p:
            return
        free = [j for j in self.groups[r.pidx] if not self.rows[j].active]
        for dst in free[: self.beam - 1]:
            self._branch(src, dst)

    def _branch(self, src: int, dst: int) -> None:
        s, d = self.rows[src], self.rows[dst]
        snap = s.arpo["snap"]
        d.restore(snap)
        d.active, d.done, d.hybrid, d.to_feed, d.at_boundary = True, False, False, [], False
        d.parent, d.branch_at = src, len(snap["tokens"])
        d.arpo = {
            "h_init": s.arpo["h_init"],
            "ents": [],
            "step": -1,
            "checked": True,
            "snap": None,
            "logits": None,
            "skip_check": True,
        }
        self.engine.copy_row(
            src, dst, torch.tensor(snap["cols"], dtype=torch.long), len(snap["tokens"]), s.arpo["logits"]
        )
        self.num_branches += 1

    def refresh(self) -> bool:
        """Start fresh rollouts for prompts whose started rows all ended while slots remain; True if any started."""
        started = False
        for idx in self.groups.values():
            rows = [self.rows[j] for j in idx]
            if any(r.active and not r.done for r in rows):
                continue
            free = [j for j in idx if not self.rows[j].active]
            for j in free[: self.initial]:
                self.rows[j].active = True
                started = True
        return started
