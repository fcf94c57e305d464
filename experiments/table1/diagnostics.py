"""What the Table-1 experiment measures beside the score: where a success came from, and whether the
setting can test RAPO's claim at all.

What this is: readers of knowledge-base completions (`read_completion`, `signature`), the leak and shortcut figures
(`leak_frac`, `unobserved_success`, `used_unobserved`), the retrieved steps' `source_quality`, the warm-up's
`conditioning_probe`, the off-policy source's `kept_trace_stats`, and `go_no_go` (the figures of table1_checks.json
and whether each passes); each function's docstring says what it measures, experiments/table1/runner.md and
experiments/table1/design.md how they are used.
What this is not: the runner (experiments/table1/run.py) or the statistics over seeds (stats.py).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import torch

from rapo_fast.train.callbacks import TrainerCallback

# One segment of a completion: a retrieved block, an answer, or an own tool step (whatever the policy wrote up to
# `</tool>`, then the tool's observation); scanned left to right, so every segment starts where the last one ended.
_SEGMENT = re.compile(
    r"<retrieve>(?P<ret>.*?)</retrieve>"
    r"|<answer>\s*(?P<ans>[^\s<]\S*)?"
    r"|(?P<gen>(?:(?!<retrieve>|<answer>|</tool>).)*?)</tool>\s*(?:<obs>\s*(?P<obs>\S+)\s*</obs>)?",
    re.S,
)
_CALL = re.compile(r"<tool>\s*search\s+(\S+)\s+(\S+)\s*(?:</tool>|$)")
_OBS = re.compile(r"<obs>\s*(\S+)\s*</obs>")


def _call(text: str) -> tuple[str | None, str | None]:
    """(relation, entity) of the last well-formed search call in `text`, else (None, None)."""
    calls = _CALL.findall(text)
    return calls[-1] if calls else (None, None)


def read_completion(problem, text: str, hint_copies: bool = True) -> dict:
    """The segments of `text` (a completion of `problem`, a KBProblem) in order: dicts with kind "own", "ret" or
    "answer", and for searches `hop` (True when it was the question's next correct hop from the entity reached so
    far, or, with `hint_copies`, the policy's own copy of the hop a retrieved step just took: the hint form), `obs`,
    `rel` and `ent` (the call's relation and entity, None when malformed). Also returns `answer` (None when there is
    none), `success`, `observed` (every observation) and `retrieved_obs` (those of retrieved blocks)."""
    hop, cur = 0, problem.start
    last: tuple | None = None  # (relation, entity, kind) of the last hop reached
    segs: list[dict] = []
    answer = None
    for m in _SEGMENT.finditer(text):
        if m.group(0).startswith("<answer>"):
            answer = m.group("ans")
            segs.append({"kind": "answer", "value": answer})
            break
        if m.group("ret") is not None:
            body = m.group("ret")
            rel, ent = _call(body + " </tool>")
            obs_m = _OBS.search(body)
            kind, obs = "ret", obs_m.group(1) if obs_m else None
        else:
            (rel, ent), kind, obs = _call(m.group("gen") + " </tool>"), "own", m.group("obs")
        ok = hop < len(problem.relations) and rel == problem.relations[hop] and ent == cur
        if ok:
            hop, cur = hop + 1, obs
            last = (rel, ent, kind)
        elif hint_copies and kind == "own" and last is not None and last[2] == "ret" and (rel, ent) == last[:2]:
            ok = True  # the policy takes a hop it was just shown retrieved (a hint): its own correct step
            last = (rel, ent, kind)
        segs.append({"kind": kind, "hop": ok, "obs": obs, "rel": rel, "ent": ent})
    observed = [s["obs"] for s in segs if s["kind"] != "answer" and s["obs"] is not None]
    return {
        "segments": segs,
        "answer": answer,
        "success": answer is not None and answer == problem.answer,
        "observed": observed,
        "retrieved_obs": [s["obs"] for s in segs if s["kind"] == "ret"],
    }


def signature(read: dict) -> str:
    """One letter per segment: S/s own search (next hop / not), R/r retrieved step (next hop / not), A/a answer
    (right / wrong), '-' when the completion has no answer."""
    out = []
    for s in read["segments"]:
        if s["kind"] == "answer":
            out.append("A" if read["success"] else "a")
        else:
            out.append(("S" if s["hop"] else "s") if s["kind"] == "own" else ("R" if s["hop"] else "r"))
    return "".join(out) + ("" if out and out[-1] in "Aa" else "-")


def leak_frac(reads: Sequence[dict]) -> float:
    """Among successes whose row retrieved at least once: the fraction whose answer is a retrieved observation (the
    retrieval handed over the answer). NaN when there is no such success."""
    hits = [r for r in reads if r["success"] and any(s["kind"] == "ret" for s in r["segments"])]
    if not hits:
        return math.nan
    return sum(r["answer"] in r["retrieved_obs"] for r in hits) / len(hits)


def used_unobserved(problem, read: dict) -> bool:
    """True when the row searched from an entity that was neither the question's start nor an earlier observation
    of the row, or answered one no observation showed: an entity it recalled (or guessed) rather than read."""
    seen = {problem.start}
    for s in read["segments"]:
        if s["kind"] == "answer":
            break
        if s["kind"] == "own" and s["ent"] is not None and s["ent"] not in seen:
            return True
        if s["obs"] is not None:
            seen.add(s["obs"])
    return read["answer"] not in seen


def source_quality(problems: Sequence, reads: Sequence[dict], advancing: bool = True) -> dict:
    """Over the retrieved steps of `reads` (read_completion of hybrid rows): the fraction whose relation is the
    chain's relation at the hop the row is at, after a prefix of right hops and after a prefix with a wrong one.
    advancing: a retrieved step takes a hop (the paper's form); else it is a hint for the policy's next step, which
    takes the hop (kb_alias's form). A fraction is None where no retrieved step had such a prefix (a value that
    compares equal to itself, unlike NaN, so runs' rows can be compared whole)."""
    n = {True: 0, False: 0}
    right = {True: 0, False: 0}
    for p, r in zip(problems, reads):
        prefix_ok, pos = True, 0
        for s in r["segments"]:
            if s["kind"] == "answer":
                break
            if s["kind"] == "ret" and pos < len(p.relations):
                n[prefix_ok] += 1
                right[prefix_ok] += s["rel"] == p.relations[pos]
            if s["kind"] == "own" or advancing:
                prefix_ok, pos = prefix_ok and bool(s["hop"]), pos + 1
    return {
        "right_prefix": right[True] / n[True] if n[True] else None,
        "wrong_prefix": right[False] / n[False] if n[False] else None,
        "n_right_prefix": n[True],
        "n_wrong_prefix": n[False],
    }


def unobserved_success(reads: Sequence[dict]) -> float:
    """The fraction of completions that are right with an answer no observation of the row showed."""
    if not reads:
        return math.nan
    return sum(r["success"] and r["answer"] not in r["observed"] for r in reads) / len(reads)


def chance_level(task, problems: Sequence) -> float:
    """The success of a uniform guess among the entities of the answer's type, averaged over `problems`: what
    `unobserved_success` would be without memorised facts."""
    if not problems:
        return math.nan
    return sum(1.0 / len(task.entities[task.entity_type[p.answer]]) for p in problems) / len(problems)


def chance_bound(chance: float, n: int, z: float = 3.0) -> float:
    """The largest `unobserved_success` over `n` questions still read as chance: chance + z binomial standard
    errors (z = 3: a 0.1% one-sided false alarm)."""
    return chance + z * math.sqrt(max(chance * (1 - chance), 0.0) / max(n, 1))


def signatures(reads: Sequence[dict], top: int = 6, successes_only: bool = True) -> dict[str, int]:
    """The `top` most frequent signatures of the successes (or of all completions), e.g. {"SSSSA": 30}."""
    return dict(Counter(signature(r) for r in reads if r["success"] or not successes_only).most_common(top))


# -- the conditioning probe --------------------------------------------------------------------------------------
@torch.no_grad()
def _greedy_steps(model, tok, contexts: list[str], max_tokens: int = 16) -> list[str]:
    """Greedy continuation of each context up to `</tool>`, <eos> or max_tokens (contexts of one token length are
    batched together: no padding)."""
    dev = next(model.parameters()).device
    stop = {tok.convert_tokens_to_ids("</tool>"), tok.eos_token_id}
    was = model.training
    model.eval()
    out: list[str] = [""] * len(contexts)
    enc = [tok.encode(c) for c in contexts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(enc):
        by_len.setdefault(len(ids), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([enc[i] for i in idx], device=dev)
        new = torch.zeros(len(idx), 0, dtype=torch.long, device=dev)
        done = torch.zeros(len(idx), dtype=torch.bool, device=dev)
        for _ in range(max_tokens):
            nxt = model(input_ids=torch.cat([ids, new], 1)).logits[:, -1].argmax(-1)
            new = torch.cat([new, nxt[:, None]], 1)
            done |= torch.tensor([int(t) in stop for t in nxt.tolist()], device=dev)
            if bool(done.all()):
                break
        for j, i in enumerate(idx):
            out[i] = tok.decode(new[j].tolist())
    if was:
        model.train()
    return out


def _own_hop_ok(text: str, relation: str, entity: str) -> bool:
    m = re.search(r"<tool>\s*search\s+(\S+)\s+(\S+)\s*</tool>", text)
    return m is not None and m.group(1) == relation and m.group(2) == entity


def conditioning_probe(model, tok, task, problems: Sequence) -> dict:
    """P(the policy's own next hop is right | the previous hop was shown retrieved) against P(... | the previous hop
    was its own), greedy, over every problem and every position k >= 1 with a next hop: the same correct hops
    0..k-1 before, hop k-1 written as the policy's step or as a retrieved block (the format of a hybrid rollout).
    A policy that can use a retrieved step scores the first close to the second."""
    ctx_own, ctx_ret, want = [], [], []
    for p in problems:
        steps = task.solution(p)[:-1]  # the hops, without the answer
        for k in range(1, len(steps)):
            prefix = p.prompt + " " + " ".join(steps[: k - 1])
            ctx_own.append(f"{prefix} {steps[k - 1]}")
            ctx_ret.append(f"{prefix} <retrieve> {steps[k - 1]} </retrieve>")
            want.append((p.relations[k], p.path[k - 1]))
    if not want:
        return {"p_next_given_retrieved": math.nan, "p_next_given_own": math.nan, "n": 0}
    own = _greedy_steps(model, tok, [" ".join(c.split()) for c in ctx_own])
    ret = _greedy_steps(model, tok, [" ".join(c.split()) for c in ctx_ret])
    ok_own = [_own_hop_ok(t, r, e) for t, (r, e) in zip(own, want)]
    ok_ret = [_own_hop_ok(t, r, e) for t, (r, e) in zip(ret, want)]
    return {
        "p_next_given_retrieved": sum(ok_ret) / len(want),
        "p_next_given_own": sum(ok_own) / len(want),
        "n": len(want),
    }


def hint_probe(model, tok, task, problems: Sequence) -> dict:
    """The probe of the aliased setting (kb_alias.py): P(the policy's own hop k is right | a
    foreign step for hop k shown retrieved) against P(... | nothing retrieved), greedy, over every problem and every
    position k >= 1 (retrieval never fires before the first step), the correct hops 0..k-1 before. The foreign step
    (`problem.hints[k]`) is the same relation on another entity, with another observation: a policy that can use it
    takes its relation and applies it to its own entity."""
    ctx_plain, ctx_hint, want = [], [], []
    for p in problems:
        steps = task.solution(p)[:-1]
        for k in range(1, len(steps)):
            prefix = " ".join([p.prompt, *steps[:k]])
            ctx_plain.append(prefix)
            ctx_hint.append(f"{prefix} <retrieve> {p.hints[k]} </retrieve>")
            want.append((p.relations[k], p.path[k - 1]))
    if not want:
        return {"p_next_given_hint": math.nan, "p_next_without_hint": math.nan, "n": 0}
    hint = _greedy_steps(model, tok, [" ".join(c.split()) for c in ctx_hint])
    plain = _greedy_steps(model, tok, [" ".join(c.split()) for c in ctx_plain])
    return {
        "p_next_given_hint": sum(_own_hop_ok(t, r, e) for t, (r, e) in zip(hint, want)) / len(want),
        "p_next_without_hint": sum(_own_hop_ok(t, r, e) for t, (r, e) in zip(plain, want)) / len(want),
        "n": len(want),
    }


# -- reading rollouts ----------------------------------------------------------------------------------------------
def read_batch(problems: Sequence, batch, rows=None, hint_copies: bool = True) -> list[dict]:
    """read_completion of the batch's rows (all, or the indices `rows`) against their questions."""
    idx = range(len(batch.completions)) if rows is None else rows
    return [read_completion(problems[int(batch.prompt_index[i])], batch.completions[i], hint_copies) for i in idx]


def rollout_figures(model, tok, task, problems: Sequence, traces, group_size: int, seed: int) -> dict:
    """One sampled on-policy and one sampled hybrid rollout (every row hybrid, retrieve_prob 0.5) of `problems`,
    read hop by hop: success rates, leak_frac, unobserved success and the successes' signatures."""
    from rapo_fast.rollouts.config import RolloutConfig
    from rapo_fast.rollouts.loop import rollout

    common = dict(group_size=group_size, temperature=1.0, max_step_tokens=16)
    on_cfg = RolloutConfig(strategy="on_policy", hybrid={"n_hybrid": 0}, **common)
    on = read_batch(problems, rollout(model, tok, task, problems, on_cfg, seed=seed))
    hy_cfg = RolloutConfig(strategy="hybrid", hybrid={"n_hybrid": group_size}, **common)
    hy = read_batch(problems, rollout(model, tok, task, problems, hy_cfg, traces=traces, seed=seed))
    return {
        "onpolicy_success": sum(r["success"] for r in on) / len(on),
        "onpolicy_unobserved_success": unobserved_success(on),
        "hybrid_success": sum(r["success"] for r in hy) / len(hy),
        "hybrid_leak_frac": leak_frac(hy),
        "onpolicy_signatures": signatures(on),
        "hybrid_signatures": signatures(hy),
        "n": len(on),
    }


def read_greedy(model, tok, task, problems: Sequence, max_step_tokens: int = 16) -> list[dict]:
    """The greedy evaluation rollout (no retrieval; as rapo_fast.train.sft.evaluate) read hop by hop."""
    from rapo_fast.rollouts.config import RolloutConfig
    from rapo_fast.rollouts.loop import rollout

    cfg = RolloutConfig(
        group_size=1, strategy="on_policy", hybrid={"n_hybrid": 0}, temperature=0.0, max_step_tokens=max_step_tokens
    )
    b = rollout(model, tok, task, problems, cfg)
    return read_batch(problems, b)


def greedy_with_retrieval(model, tok, task, problems: Sequence, traces, seed: int = 0) -> float:
    """Greedy success on `problems` with retrieval from `traces` (one hybrid row per problem, retrieve_prob 0.5 drawn
    from a fixed seed): what the policy does when it is shown the source's steps."""
    from rapo_fast.rollouts.config import RolloutConfig
    from rapo_fast.rollouts.loop import rollout

    cfg = RolloutConfig(group_size=1, strategy="hybrid", hybrid={"n_hybrid": 1}, temperature=0.0, max_step_tokens=16)
    b = rollout(model, tok, task, problems, cfg, traces=traces, seed=seed)
    return sum(task.verify(problems[int(i)], c) for i, c in zip(b.prompt_index, b.completions)) / len(problems)


class RolloutReader(TrainerCallback):
    """A trainer callback that reads every step's rollouts
    (trainer.last_batch against trainer.last_problems): counts the hybrid successes that retrieved and those whose
    answer was a retrieved observation (leak_frac over the run), the policy's successes that used an entity never
    observed in the row (recall_frac, `used_unobserved`), the retrieved steps' relation (source_quality), and the
    successes' signatures per row kind. hint_copies:
    as read_completion's."""

    def __init__(self, hint_copies: bool = True):
        self.hint_copies = hint_copies
        self.hybrid_successes = 0
        self.leaked = 0
        self.rows = self.successes = self.recalled = 0
        self.retrieved: list[tuple] = []  # (problem, read) of the hybrid rows that retrieved
        self.counts: dict[str, Counter] = {"hybrid": Counter(), "onpolicy": Counter()}

    def on_step_end(self, trainer, step: int, metrics: dict):
        batch, problems = trainer.last_batch, trainer.last_problems
        off = getattr(batch, "offpolicy_rows", None)
        for i, r in enumerate(read_batch(problems, batch, hint_copies=self.hint_copies)):
            if off is not None and bool(off[i]):
                continue  # a whole off-policy trajectory: not the policy's
            kind = "hybrid" if bool(batch.hybrid[i]) else "onpolicy"
            self.rows += 1
            if any(s["kind"] == "ret" for s in r["segments"]):
                self.retrieved.append((problems[int(batch.prompt_index[i])], r))
            if r["success"]:
                self.successes += 1
                self.recalled += used_unobserved(problems[int(batch.prompt_index[i])], r)
                self.counts[kind][signature(r)] += 1
                if kind == "hybrid" and r["retrieved_obs"]:
                    self.hybrid_successes += 1
                    self.leaked += r["answer"] in r["retrieved_obs"]
        return None

    def leak_frac(self) -> float:
        return self.leaked / self.hybrid_successes if self.hybrid_successes else math.nan

    def source_quality(self) -> dict:
        """source_quality over the run's retrieved steps."""
        return source_quality([p for p, _ in self.retrieved], [r for _, r in self.retrieved], not self.hint_copies)

    def recall_frac(self) -> float:
        """Among the policy's successes of the run: the fraction that used an entity never observed in the row."""
        return self.recalled / self.successes if self.successes else math.nan

    def signatures(self, top: int = 6) -> dict:
        return {k: dict(c.most_common(top)) for k, c in self.counts.items()}


# -- the off-policy source ---------------------------------------------------------------------------------------
def kept_trace_stats(records: Sequence[dict], top_k: int) -> dict:
    """The top-k-by-reward traces per query (what RAPO's buffer and OFFPOLICY_TRAJ keep): the correct fraction, the
    mean number of distinct trajectories per query and the fraction of queries without a correct one."""
    from rapo_fast.retrieval.step_traces import top_k_by_reward

    kept = top_k_by_reward(list(records), top_k)
    by_q: dict[int, list[dict]] = {}
    for r in kept:
        by_q.setdefault(int(r["query_id"]), []).append(r)
    if not by_q:
        return {
            "kept_trace_correct_frac": math.nan,
            "distinct_per_query": math.nan,
            "queries_without_correct": math.nan,
        }
    return {
        "kept_trace_correct_frac": sum(float(r["reward"]) > 0.5 for r in kept) / len(kept),
        "distinct_per_query": sum(len({tuple(r["steps"]) for r in v}) for v in by_q.values()) / len(by_q),
        "queries_without_correct": sum(all(float(r["reward"]) <= 0.5 for r in v) for v in by_q.values()) / len(by_q),
    }


# -- go / no-go ----------------------------------------------------------------------------------------------------
LEAK_MAX = 0.25  # the default setting keeps leak_frac at or under this
KEPT_CORRECT_MAX = 0.8  # an imperfect source: top-k keeps wrong trajectories (98.8% correct was the oracle)
PROBE_MIN_RATIO = 0.5  # a policy that uses a retrieved step: at least half its success after its own step
HINT_MIN = 0.5  # the aliased setting: a foreign retrieved step makes the right own hop at least this likely


def go_no_go(figures: dict) -> dict:
    """The checks of table1_checks.json from the measured figures: for each, the figure, its bound and `pass`.

    figures: unobserved_answer_success {family: {"value", "chance", "n"}}, kept_trace_correct_frac {family: x},
    conditioning_probe {family: {"p_next_given_retrieved", "p_next_given_own"}} (or, for the aliased setting,
    hint_probe {family: {"p_next_given_hint", "p_next_without_hint"}}: passes when the hint makes the right hop at
    least HINT_MIN likely and more likely than without it), leak_frac {family: x} (the mean
    over RAPO's runs; NaN, no success that retrieved, passes: nothing leaked)."""
    checks: dict = {}
    for fam, u in figures.get("unobserved_answer_success", {}).items():
        bound = chance_bound(u["chance"], u["n"])
        checks[f"no_shortcut/{fam}"] = {
            "value": u["value"],
            "chance": u["chance"],
            "bound": bound,
            "pass": bool(u["value"] <= bound),
        }
    for fam, x in figures.get("kept_trace_correct_frac", {}).items():
        checks[f"imperfect_source/{fam}"] = {"value": x, "bound": KEPT_CORRECT_MAX, "pass": bool(x <= KEPT_CORRECT_MAX)}
    for fam, pr in figures.get("conditioning_probe", {}).items():
        own, ret = pr["p_next_given_own"], pr["p_next_given_retrieved"]
        ok = own > 0 and ret >= PROBE_MIN_RATIO * own
        checks[f"uses_retrieved_step/{fam}"] = {"value": ret, "own": own, "bound": PROBE_MIN_RATIO * own, "pass": ok}
    for fam, pr in figures.get("hint_probe", {}).items():
        hint, plain = pr["p_next_given_hint"], pr["p_next_without_hint"]
        ok = bool(hint >= HINT_MIN and hint > plain)
        checks[f"uses_retrieved_step/{fam}"] = {"value": hint, "without": plain, "bound": HINT_MIN, "pass": ok}
    for fam, x in figures.get("leak_frac", {}).items():
        checks[f"no_answer_leak/{fam}"] = {"value": x, "bound": LEAK_MAX, "pass": bool(math.isnan(x) or x <= LEAK_MAX)}
    return checks
