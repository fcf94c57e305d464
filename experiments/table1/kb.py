"""Multi-hop questions over a synthetic knowledge base with a search tool: the Table-1 experiment's task family.

What this is: a Search-R1-style family where exploration is the bottleneck: `KnowledgeBaseTask` (a seeded knowledge
base of typed entities and functional relations; questions compose 2-3 relations, answered one search per relation)
and `kb_solver_trajectories`, the scripted off-policy solver with errors. It has the interface of
`ChainArithmeticTask`, so the rollout, the SFT warm-up and the trainer run on it unchanged. Format, solver and the
hop split are described in experiments/table1/runner.md ("The knowledge-base task").
What this is not: a model of real knowledge or of retrieval over text (the search is an exact lookup of one fact),
nor a benchmark; the knowledge base is fixed per `kb_seed`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from rapo_fast.demo.tiny_policy import WordTokenizer

TYPES: tuple[str, ...] = ("person", "city", "country", "company")
# relation -> (subject type, object type); every relation is a function (one object per subject)
RELATIONS: dict[str, tuple[str, str]] = {
    "born_in": ("person", "city"),
    "works_for": ("person", "company"),
    "located_in": ("city", "country"),
    "capital": ("country", "city"),
    "ceo": ("company", "person"),
    "hq_in": ("company", "city"),
}


def check_int(name: str, value, *, lo: int = -(2**63), hi: int = 2**63 - 1) -> int:
    """An int (bool refused) in [lo, hi], in the library's error voice."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
    return value


def check_float(name: str, value) -> float:
    """A real number (bool refused), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    return float(value)


@dataclass(frozen=True)
class KBProblem:
    """One question: `qid` (its prompt-group id), the start entity, the relations in the order they are applied
    (innermost first) and the entities each search returns (`path[-1]` is the answer)."""

    qid: int
    start: str
    relations: tuple[str, ...]
    path: tuple[str, ...]

    @property
    def answer(self) -> str:
        return self.path[-1]

    @property
    def prompt(self) -> str:
        """`<bos> ask r_k ... r_1 <start>`: the composition as written, outermost relation first."""
        return "<bos> ask " + " ".join(reversed(self.relations)) + " " + self.start


class KnowledgeBaseTask:
    """Knowledge base (built from `kb_seed`), question generator, search tool and verifier.

    Args: n_people, n_cities, n_countries, n_companies (entity counts; every entity is one token), min_hops..max_hops
    relations per question (2-3 by default), kb_seed (the knowledge base; problems have their own seed),
    pattern_filter (keeps the relation chains, innermost first, for which it returns True; None: all), fact_seed
    (None: the facts follow from kb_seed; else drawn from fact_seed over kb_seed's entities and types: another draw
    of the knowledge base in which every entity keeps its type, e.g. for demonstrations that teach the procedure
    without the facts).
    """

    tool_end = "</tool>"
    answer_start = "<answer>"

    def __init__(
        self,
        n_people: int = 96,
        n_cities: int = 32,
        n_countries: int = 12,
        n_companies: int = 16,
        min_hops: int = 2,
        max_hops: int = 3,
        kb_seed: int = 0,
        pattern_filter: Callable[[tuple[str, ...]], bool] | None = None,
        fact_seed: int | None = None,
    ):
        counts = {"person": n_people, "city": n_cities, "country": n_countries, "company": n_companies}
        for name, v in zip(("n_people", "n_cities", "n_countries", "n_companies"), counts.values()):
            check_int(f"KnowledgeBaseTask: {name}", v, lo=2, hi=500)
        if n_countries > n_cities:
            raise ValueError(
                f"KnowledgeBaseTask: n_countries: expected <= n_cities ({n_cities}: each country needs its own "
                f"capital city), got {n_countries}"
            )
        check_int("KnowledgeBaseTask: min_hops", min_hops, lo=2, hi=6)
        check_int("KnowledgeBaseTask: max_hops", max_hops, lo=min_hops, hi=6)
        self.min_hops, self.max_hops, self.kb_seed = min_hops, max_hops, kb_seed
        self.entities, self.facts = build_kb(counts, kb_seed, fact_seed)
        self.entity_type = {e: t for t, es in self.entities.items() for e in es}
        self.patterns = [(r, st) for r, st in self._patterns() if pattern_filter is None or pattern_filter(r)]
        if not self.patterns:
            raise ValueError("KnowledgeBaseTask: expected a multi-hop question, got none; use more entities")

    # -- vocabulary -------------------------------------------------------------------------------------------------
    def words(self) -> list[str]:
        ents = sorted(self.entity_type, key=lambda e: int(e[1:]))
        return ["ask", "search", "none", "error", *RELATIONS, *ents]

    def tokenizer(self) -> WordTokenizer:
        return WordTokenizer(self.words())

    # -- generation -------------------------------------------------------------------------------------------------
    def lookup(self, relation: str, entity: str) -> str | None:
        """The object of the fact (relation, entity), or None when the knowledge base has no such fact."""
        return self.facts.get((relation, entity))

    def make_problems(
        self, n: int, seed: int, start_qid: int = 0, starts: Collection[str] | None = None
    ) -> list[KBProblem]:
        """`n` random questions from `seed` (deterministic), with qids start_qid .. start_qid + n - 1.

        Each draws a relation pattern uniformly among those with min_hops..max_hops relations, then a start entity
        uniformly among the pattern's valid starts (distinct entities along the path; the answer is neither the
        start nor the result of any single search on it). `starts`: only these start entities (e.g. one side of
        `split_starts`, so that training and held-out questions ask about disjoint entities); None: all.
        """
        check_int("make_problems: n", n, lo=0)
        patterns = self.patterns
        if starts is not None:
            allowed = set(starts)
            patterns = [(r, [e for e in st if e in allowed]) for r, st in patterns]
            patterns = [(r, st) for r, st in patterns if st]
            if not patterns:
                raise ValueError(f"make_problems: starts: expected a start entity, got none of {len(allowed)}")
        rng = random.Random(seed)
        out = []
        for i in range(n):
            rels, pool = patterns[rng.randrange(len(patterns))]
            start = rng.choice(pool)
            out.append(KBProblem(start_qid + i, start, rels, tuple(self.walk(start, rels))))
        return out

    def split_starts(self, held_out_frac: float, seed: int) -> tuple[list[str], list[str]]:
        """The entities split in two (training starts, held-out starts), each type split in the same proportion,
        deterministic given `seed`: questions over one side never start from an entity of the other (their paths
        may still pass through shared entities: the knowledge base is one)."""
        if not 0.0 < check_float("split_starts: held_out_frac", held_out_frac) < 1.0:
            raise ValueError(f"split_starts: held_out_frac: expected a number in (0, 1), got {held_out_frac!r}")
        rng = random.Random(seed)
        train, held = [], []
        for t in TYPES:
            es = list(self.entities[t])
            rng.shuffle(es)
            k = max(1, round(len(es) * float(held_out_frac)))
            held += es[:k]
            train += es[k:]
        return train, held

    def walk(self, start: str, relations: Sequence[str]) -> list[str]:
        """The entities the searches of `relations` (in order) return from `start`; `none` once a fact is missing."""
        path, cur = [], start
        for r in relations:
            cur = self.facts.get((r, cur), "none")
            path.append(cur)
        return path

    def _patterns(self) -> list[tuple[tuple[str, ...], list[str]]]:
        """Every relation chain of min_hops..max_hops whose types compose, with its valid start entities."""
        chains: list[tuple[str, ...]] = [(r,) for r in RELATIONS]
        out = []
        for hops in range(2, self.max_hops + 1):
            chains = [c + (r,) for c in chains for r, (s, _) in RELATIONS.items() if s == RELATIONS[c[-1]][1]]
            if hops < self.min_hops:
                continue
            for c in chains:
                starts = [e for e in self.entities[RELATIONS[c[0]][0]] if self._is_multi_hop(e, c)]
                if starts:
                    out.append((c, starts))
        return out

    def _is_multi_hop(self, start: str, relations: Sequence[str]) -> bool:
        path = self.walk(start, relations)
        one_hop = {self.facts.get((r, start)) for r in RELATIONS}
        return len({start, *path}) == len(path) + 1 and path[-1] not in one_hop

    @staticmethod
    def step_text(relation: str, entity: str, result: str) -> str:
        """One step: thought (the relation to look up), tool call, observation."""
        return f"<think> {relation} <tool> search {relation} {entity} </tool> <obs> {result} </obs>"

    @staticmethod
    def answer_text(entity: str) -> str:
        return f"<answer> {entity} <eos>"

    def solution(self, problem: KBProblem) -> list[str]:
        """The correct searches, innermost relation first, followed by the answer step."""
        steps, cur = [], problem.start
        for r, nxt in zip(problem.relations, problem.path):
            steps.append(self.step_text(r, cur, nxt))
            cur = nxt
        return steps + [self.answer_text(cur)]

    # -- tool and verifier ------------------------------------------------------------------------------------------
    def execute(self, call: str) -> str:
        """The search tool: the text between <tool> and </tool> (`search born_in e17`) -> `<obs> e5 </obs>`.

        A well-formed search for a fact the knowledge base lacks observes `none`; a malformed call (not
        `search <relation> <entity>`) observes `error`.
        """
        parts = call.replace("<tool>", " ").replace("</tool>", " ").split()
        if len(parts) != 3 or parts[0] != "search" or parts[1] not in RELATIONS:
            return "<obs> error </obs>"
        found = self.lookup(parts[1], parts[2])
        return f"<obs> {found if found is not None else 'none'} </obs>"

    def verify(self, problem: KBProblem, completion: str) -> float:
        """Outcome reward (exact match): 1.0 when the completion's first `<answer> X` has X == the answer, else 0.0."""
        m = re.search(r"<answer>\s+(\S+)", completion)
        return 1.0 if m is not None and m.group(1) == problem.answer else 0.0


def build_kb(
    counts: dict[str, int], seed: int, fact_seed: int | None = None
) -> tuple[dict[str, list[str]], dict[tuple[str, str], str]]:
    """Entities per type and the facts {(relation, subject): object}, deterministic given `seed` (and `fact_seed`,
    which, when given, draws the facts instead of `seed`: the entities and their types stay `seed`'s).

    Entity names `e0`, `e1`, ... are shuffled across types (the name does not tell the type). Every subject has
    exactly one object per relation of its type; each country's capital is a distinct city located in it.
    """
    rng = random.Random(seed)
    total = sum(counts[t] for t in TYPES)
    ids = list(range(total))
    rng.shuffle(ids)
    entities: dict[str, list[str]] = {}
    k = 0
    for t in TYPES:
        entities[t] = [f"e{i}" for i in ids[k : k + counts[t]]]
        k += counts[t]
    if fact_seed is not None:
        rng = random.Random(fact_seed)
    cities, countries = entities["city"], entities["country"]
    facts: dict[tuple[str, str], str] = {}
    capitals = rng.sample(cities, len(countries))
    for country, city in zip(countries, capitals):
        facts[("capital", country)] = city
        facts[("located_in", city)] = country
    for r, (s, o) in RELATIONS.items():
        subjects = [e for e in entities[s] if (r, e) not in facts]
        for subj, obj in zip(subjects, _balanced(entities[o], len(subjects), rng)):
            facts[(r, subj)] = obj
    return entities, facts


def _balanced(objects: list[str], n: int, rng: random.Random) -> list[str]:
    """`n` objects drawn as evenly as possible (each used floor or ceil of n / len(objects) times), shuffled."""
    out: list[str] = []
    while len(out) < n:
        out += rng.sample(objects, len(objects))
    return out[:n]


def kb_solve(
    task: KnowledgeBaseTask, problem: KBProblem, rng: random.Random, error_rate: float | Sequence[float]
) -> dict:
    """One trajectory of the scripted solver on `problem`; step k goes wrong with probability `error_rate` (or
    `error_rate[k]`, the last entry for later steps: a solver whose reliability depends on the step).

    Errors: a wrong relation (another relation of the vocabulary), the wrong order (this relation swapped with the
    next one; a wrong relation at the last step) or a stale entity (the one searched before instead of the last
    observation; a wrong relation at the first step). The tool executes the wrong call faithfully, the solver goes
    on from what it observed, and its answer is the last observation.
    """
    rels = list(problem.relations)
    steps, cur, prev = [], problem.start, None
    for k in range(len(rels)):
        rel, ent = rels[k], cur
        rate = error_rate if isinstance(error_rate, float) else error_rate[min(k, len(error_rate) - 1)]
        if rng.random() < rate:
            kind = rng.randrange(3)
            if kind == 1 and k + 1 < len(rels):
                rels[k], rels[k + 1] = rels[k + 1], rels[k]
                rel = rels[k]
            elif kind == 2 and prev is not None:
                ent = prev
            else:
                rel = rng.choice([r for r in RELATIONS if r != rel])
        obs = task.execute(f"search {rel} {ent}")
        result = obs.split()[1]
        steps.append(task.step_text(rel, ent, result))
        prev, cur = ent, result
    answer = task.answer_text(cur)
    return {
        "query_id": problem.qid,
        "prompt": problem.prompt,
        "steps": steps,
        "answer": answer,
        "reward": task.verify(problem, " ".join(steps + [answer])),
    }


def kb_solver_trajectories(
    task: KnowledgeBaseTask,
    problems: Sequence[KBProblem],
    n_per_query: int = 16,
    error_rate: float | Sequence[float] = 0.2,
    seed: int = 0,
) -> list[dict]:
    """`n_per_query` scripted trajectories for each problem (deterministic given `seed`), in the JSONL record format
    of rapo_fast.retrieval.jsonl: {query_id, prompt, steps, answer, reward}. `error_rate`: one rate for every step,
    or one per step index (the last for later steps)."""
    check_int("kb_solver_trajectories: n_per_query", n_per_query, lo=1)
    rates = [error_rate] if isinstance(error_rate, (int, float)) else list(error_rate)
    if not rates or not all(isinstance(r, (int, float)) and 0.0 <= float(r) <= 1.0 for r in rates):
        raise ValueError(f"kb_solver_trajectories: error_rate: expected [0, 1] or a list of such, got {error_rate!r}")
    rate: float | list[float] = float(rates[0]) if isinstance(error_rate, (int, float)) else [float(r) for r in rates]
    rng = random.Random(seed)
    return [kb_solve(task, p, rng, rate) for p in problems for _ in range(n_per_query)]


__all__ = ["RELATIONS", "KBProblem", "KnowledgeBaseTask", "build_kb", "kb_solve", "kb_solver_trajectories"]
