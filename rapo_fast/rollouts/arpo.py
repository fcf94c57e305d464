"""ARPO's entropy-adaptive branching (arXiv 2507.19849) inside the lockstep rollout, by two rules.

What this is: the branching policy: a branch makes up to beam - 1 free row slots of its group copies of the row as it
was right after a tool result. The rules "paper" and "released" (dongguanting/ARPO at e257337), exactly:
docs/rollout.md section 2 ("arpo").
What this is not: advantage attribution (rapo_fast.train.trainer.hard_attribution).
"""

from __future__ import annotations

import math
import random

import torch

from rapo_fast._checks import check_int

RULES = ("paper", "released")
PAPER_RISE_BOUND = 1.0


def paper_branch_prob(h: float, h_init: float | None, alpha: float, beta: float) -> float:
    """The paper rule's branching probability: alpha + beta * dH, dH = (h - h_init) / h_init bounded to
    [-PAPER_RISE_BOUND, PAPER_RISE_BOUND] (0 when h_init is missing or 0), clamped to [0, 1]."""
    rise = (h - h_init) / h_init if h_init and h_init > 0 else 0.0
    rise = max(-PAPER_RISE_BOUND, min(PAPER_RISE_BOUND, rise))
    return min(1.0, max(0.0, alpha + beta * rise))


def topk_entropy(logits: torch.Tensor, temperature: float, topk: int) -> float:
    """-sum p log p over the `topk` most likely tokens of softmax(logits / T) (T = 1 for greedy): the entropy the
    released ARPO code takes from vLLM's top-k log-probs of one position (not renormalised)."""
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits.float() / t, dim=-1).topk(min(topk, logits.shape[-1])).values
    return float(-(lp.exp() * lp.clamp_min(-1e30)).sum())


def released_segment_entropy(topk_entropy_sum: float, vocab_size: int) -> float:
    """The released rule's segment entropy: the sum over its first k positions of topk_entropy, over log |V|."""
    return topk_entropy_sum / math.log(vocab_size)


def released_copies(coin: random.Random, attempts: int, rise: float, alpha: float, beta: float) -> int:
    """How many of `attempts` copies the released rule makes: copy j when clamp(u_j - beta * rise, 0, 1) <= alpha."""
    return sum(min(1.0, max(0.0, coin.random() - beta * rise)) <= alpha for _ in range(attempts))


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
        rule: str = "paper",
        topk: int = 10,
        temperature: float = 1.0,
    ):
        if not 1 <= initial <= group_size:
            raise ValueError(f"rollout.arpo.initial: expected an int in [1, group_size={group_size}], got {initial!r}")
        for name, v in (("beam", beam), ("k", k), ("topk", topk)):
            check_int(f"rollout.arpo.{name}", v, lo=1)
        if rule not in RULES:
            raise ValueError(f"rollout.arpo.rule: expected one of {RULES}, got {rule!r}")
        self.rows, self.engine, self.G, self.initial = rows, engine, group_size, initial
        self.beam, self.k, self.alpha, self.beta, self.coin = beam, k, alpha, beta, coin
        self.rule, self.topk, self.temperature = rule, topk, temperature
        self.groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            self.groups.setdefault(r.pidx, []).append(i)
            r.arpo = self._fresh_state(None)
        self.num_branches = 0

    @staticmethod
    def _fresh_state(h_init: float | None, **extra) -> dict:
        # ents: the paper rule's entropies of the step's first k tokens; seg_sum / seg_n / seg_h: the released rule's
        return {
            "h_init": h_init,
            "ents": [],
            "step": -1,
            "checked": False,
            "snap": None,
            "logits": None,
            "seg_sum": 0.0,
            "seg_n": 0,
            "seg_h": None,
        } | extra

    def before_sample(self, samp: list[int]) -> None:
        for i in samp:
            r = self.rows[i]
            if r.cur_start is not None:
                continue
            a = r.arpo
            a["step"], a["ents"], a["seg_sum"], a["seg_n"] = len(r.steps), [], 0.0, 0
            if a["step"] > 0 and not a.pop("skip_check", False):
                a["checked"] = False
                a["snap"] = r.snapshot()
                a["logits"] = self.engine.last_logits[i].clone()
                if self.rule == "released":  # decided at the tool result, on the segment that ended in the call
                    a["checked"] = True
                    self._released_branch(i)
            elif a["step"] > 0:
                a["checked"] = True

    def after_sample(self, samp: list[int]) -> None:
        for i in samp:
            r = self.rows[i]
            a = r.arpo
            step_over = r.cur_start is None or r.done
            if self.rule == "released":
                if a["seg_n"] < self.k:
                    a["seg_sum"] += topk_entropy(self.engine.last_logits[i], self.temperature, self.topk)
                    a["seg_n"] += 1
                if step_over:
                    a["seg_h"] = released_segment_entropy(a["seg_sum"], self.engine.last_logits.shape[-1])
                    if a["h_init"] is None:
                        a["h_init"] = a["seg_h"]
                continue
            a["ents"].append(r.ent[-1])
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

    def _free_slots(self, src: int) -> list[int]:
        return [j for j in self.groups[self.rows[src].pidx] if not self.rows[j].active][: self.beam - 1]

    def _maybe_branch(self, src: int, h: float) -> None:
        """The paper rule: one coin for all copies."""
        if self.coin.random() >= paper_branch_prob(h, self.rows[src].arpo["h_init"], self.alpha, self.beta):
            return
        for dst in self._free_slots(src):
            self._branch(src, dst)

    def _released_branch(self, src: int) -> None:
        """The released rule: one coin per copy, on the absolute rise of the last segment's entropy."""
        a = self.rows[src].arpo
        rise = a["seg_h"] - a["h_init"] if a["seg_h"] is not None and a["h_init"] is not None else 0.0
        free = self._free_slots(src)
        for dst in free[: released_copies(self.coin, len(free), rise, self.alpha, self.beta)]:
            self._branch(src, dst)

    def _branch(self, src: int, dst: int) -> None:
        s, d = self.rows[src], self.rows[dst]
        snap = s.arpo["snap"]
        d.restore(snap)
        d.start()
        d.hybrid, d.to_feed = False, []
        d.parent, d.branch_at = src, len(snap["tokens"])
        # paper: the copy inherits H_init; released: a copy's H_init is its own first segment's
        d.arpo = self._fresh_state(s.arpo["h_init"] if self.rule == "paper" else None, checked=True, skip_check=True)
        self.engine.copy_row(
            src, dst, torch.tensor(snap["cols"], dtype=torch.long), len(snap["tokens"]), s.arpo["logits"]
        )
        self.num_branches += 1

    def refresh(self) -> bool:
        """Start fresh rollouts for prompts whose started rows all ended while slots remain (`initial` of them under
        the paper rule, one under the released rule); True if any started."""
        started = False
        for idx in self.groups.values():
            rows = [self.rows[j] for j in idx]
            if any(r.active and not r.done for r in rows):
                continue
            free = [j for j in idx if not self.rows[j].active]
            for j in free[: self.initial if self.rule == "paper" else 1]:
                self.rows[j].start()
                started = True
        return started
