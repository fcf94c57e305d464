"""Knowledge-base questions whose relation chain is named by an alias: the task of the Table-1 experiment's families.

What this is: `AliasKBTask`, the knowledge base of kb.py asked through alias words (`<bos> ask q7 e17`: the chain is
not in the prompt), and `AliasProblem.hints`, the foreign steps the SFT warm-up shows as retrieved blocks
(`foreign_step`, its retrieve style). Why the setting is built this way: runner.md and design.md beside this file.
What this is not: a model of retrieval over text, or a task a policy can solve without searching: the answer is an
entity two or three facts away, and held-out questions start from entities no training question starts from.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from experiments.table1.kb import RELATIONS, KBProblem, KnowledgeBaseTask

N_ALIASES = 18  # the relation chains of 2-3 hops whose types compose (enumerated by `all_chains`)
ALIASES: tuple[str, ...] = tuple(f"q{i}" for i in range(N_ALIASES))


def all_chains(min_hops: int = 2, max_hops: int = 3) -> list[tuple[str, ...]]:
    """Every relation chain (innermost first) of min_hops..max_hops whose types compose, in a fixed order. Depends
    on the relations' types only, not on any draw of the facts."""
    chains: list[tuple[str, ...]] = [(r,) for r in RELATIONS]
    out = []
    for hops in range(2, max_hops + 1):
        chains = [c + (r,) for c in chains for r, (s, _) in RELATIONS.items() if s == RELATIONS[c[-1]][1]]
        if hops >= min_hops:
            out += chains
    return out


def alias_table(alias_seed: int = 0) -> dict[tuple[str, ...], str]:
    """chain -> alias word: the 18 chains of 2-3 hops shuffled by `alias_seed` onto q0..q17 (some have no question:
    a chain that comes back to its start is no multi-hop question)."""
    chains = all_chains()
    if len(chains) != N_ALIASES:  # the relation table changed: the vocabulary must follow
        raise AssertionError(f"kb_alias: {len(chains)} chains of 2-3 hops, ALIASES holds {N_ALIASES}")
    order = list(range(len(chains)))
    random.Random(alias_seed).shuffle(order)
    return {chains[i]: ALIASES[j] for j, i in enumerate(order)}


@dataclass(frozen=True)
class AliasProblem(KBProblem):
    """A KBProblem asked through its chain's alias (None: asked explicitly, as in kb.py); `hints[k]`: a foreign step
    for hop k (see the module doc)."""

    alias: str | None = None
    hints: tuple[str, ...] = ()

    @property
    def prompt(self) -> str:
        return KBProblem.prompt.fget(self) if self.alias is None else f"<bos> ask {self.alias} {self.start}"


@dataclass(frozen=True)
class FromHopOne(AliasProblem):
    """A 3-hop question asked with its right hop 1 already taken (`first`, the step text, in the prompt as the
    policy's own step): the rest is a 2-hop question from `path[0]`, so `relations`, `path` and `start` are those of
    the rest (read_completion reads the completion from hop 2 on). Built by `from_hop_one`."""

    first: str = ""

    @property
    def prompt(self) -> str:
        return f"<bos> ask {self.alias} {self.origin} {self.first}"

    @property
    def origin(self) -> str:
        return self.first.split()[-5]  # `<think> rel <tool> search rel ENT </tool> <obs> X </obs>`: ENT


def from_hop_one(task: KnowledgeBaseTask, p: AliasProblem) -> FromHopOne:
    """`p` (by alias) with its right hop 1 taken: the state a retrieved hop 1 puts a row in."""
    first = task.solution(p)[0]
    return FromHopOne(p.qid, p.path[0], p.relations[1:], p.path[1:], p.alias, p.hints[1:], first)


class AliasKBTask(KnowledgeBaseTask):
    """KnowledgeBaseTask whose questions name their chain by alias.

    Args: chains (the relation chains, innermost first, that `make_problems` asks about; None: every chain of 2-3
    hops), alias_seed (which alias names which chain), by_alias (False: the questions name their relations, as in
    kb.py, and still carry hints: the warm-up's explicit demonstrations), and KnowledgeBaseTask's entity counts,
    kb_seed and fact_seed. Every instance has the same vocabulary (kb.py's words and all 18 aliases), so a policy
    warmed up on one set of chains or facts can be trained and evaluated on another.
    """

    def __init__(
        self, chains: Collection[tuple[str, ...]] | None = None, alias_seed: int = 0, by_alias: bool = True, **kb_kwargs
    ):
        self.alias_of, self.by_alias = alias_table(alias_seed), bool(by_alias)
        wanted = set(self.alias_of) if chains is None else {tuple(c) for c in chains}
        unknown = wanted - set(self.alias_of)
        if unknown:
            raise ValueError(f"AliasKBTask: chains must be relation chains of 2-3 hops, got {sorted(unknown)}")
        super().__init__(min_hops=2, max_hops=3, pattern_filter=lambda c: c in wanted, **kb_kwargs)

    def words(self) -> list[str]:
        return [*super().words(), *ALIASES]

    def make_problems(
        self, n: int, seed: int, start_qid: int = 0, starts: Collection[str] | None = None
    ) -> list[AliasProblem]:
        """As KnowledgeBaseTask.make_problems, each question asked by alias and carrying one foreign hint per hop
        (drawn from its own generator: the questions are those of the explicit task with the same arguments)."""
        rng = random.Random(f"hints/{seed}")
        return [
            AliasProblem(
                p.qid,
                p.start,
                p.relations,
                p.path,
                self.alias_of[p.relations] if self.by_alias else None,
                self._hints(p, rng),
            )
            for p in super().make_problems(n, seed, start_qid, starts)
        ]

    def all_problems(self, starts: Collection[str], start_qid: int = 0) -> list[AliasProblem]:
        """Every distinct question whose start is in `starts`, each once (chain order, then start order), with qids
        start_qid, start_qid + 1, ...: a held-out set that weights every question once."""
        allowed, rng, out = set(starts), random.Random("hints/all"), []
        for rels, pool in self.patterns:
            for start in (e for e in pool if e in allowed):
                p = KBProblem(start_qid + len(out), start, rels, tuple(self.walk(start, rels)))
                alias = self.alias_of[rels] if self.by_alias else None
                out.append(AliasProblem(p.qid, p.start, p.relations, p.path, alias, self._hints(p, rng)))
        return out

    def _hints(self, p: KBProblem, rng: random.Random) -> tuple[str, ...]:
        out, cur = [], p.start
        for rel, nxt in zip(p.relations, p.path):
            others = [e for e in self.entities[RELATIONS[rel][0]] if e != cur and (rel, e) in self.facts]
            x = rng.choice(others)
            out.append(self.step_text(rel, x, self.facts[(rel, x)]))
            cur = nxt
        return tuple(out)


def chain_split(rl_chains: Sequence[tuple[str, ...]]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """(the other chains, `rl_chains`): the aliases demonstrated in the warm-up and those left to RL."""
    rl = [tuple(c) for c in rl_chains]
    return [c for c in all_chains() if c not in rl], rl


def foreign_step(problem, k: int, solution: Sequence[str]) -> tuple[str, bool]:
    """The warm-up's retrieve style of kb_alias (rapo_fast.train.sft.RetrieveStyle): the block is another question's
    step with the same relation (`problem.hints[k]`), then the policy's own step, so that the policy learns to take a
    retrieved step's relation and apply it to its own entity."""
    hints = getattr(problem, "hints", ())
    if len(hints) <= k:
        raise ValueError(f"foreign_step: problem: expected one hint per step (an AliasProblem), got {problem!r}")
    return hints[k], True


__all__ = [
    "ALIASES",
    "AliasKBTask",
    "AliasProblem",
    "FromHopOne",
    "from_hop_one",
    "alias_table",
    "all_chains",
    "chain_split",
    "foreign_step",
]
