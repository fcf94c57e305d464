"""What table1 measures for the family kb_alias_step beyond kb_alias's figures, and its checks that can fail.

What this is: the warm-up figures of the advancing retrieval form (`advance_probe`: teacher-forced P(the policy's
next hop is right) after a retrieved advancing step vs after its own; `source_quality`: how often a retrieved step
carries the right next relation after a right and after a wrong prefix, diagnostics.source_quality, at
the warm-up; `step_warmup_figures`: both plus sampled
on-policy and hybrid rollouts at the warm-up) and `step_checks` (no_training_recall per run, source quality,
no_answer_leak per seed). experiments/table1/design.md (section "kb_alias_step") says why each exists.
What this is not: the family (families.py StepFamily) or kb_alias's checks (diagnostics.go_no_go).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from experiments.table1 import diagnostics as D

SOURCE_RIGHT_MIN = 0.5  # a retrieved step after a right prefix carries the right next relation at least this often
LEAK_MAX = D.LEAK_MAX  # per seed, not only pooled
ORACLE_MIN = 0.95  # a source right more often than this after a right prefix is labelled an oracle
NEAR_ORACLE_MIN = 0.75
NOISY_RANGE = (0.35, 0.65)  # the noisy arm's source: right about half the time after a right prefix


@torch.no_grad()
def _step_prob(model, tok, context: str, step: str) -> float:
    """P(the policy writes `step`'s own part, `<think> ... </tool>`, after `context`), teacher-forced."""
    gen = step.split("<obs>")[0].split()
    ctx = tok.encode(" ".join(context.split()))
    tgt = list(tok.encode(" ".join(gen)))  # the demo's word tokenizer: no BOS on a plain encode
    ids = torch.tensor([ctx + tgt])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    pos = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(tgt))
    return float(logp[pos, torch.tensor(tgt)].sum().exp())


def advance_probe(model, tok, task, problems: Sequence, first: int = 2) -> dict:
    """The probe of the tested form: over every problem and every hop k whose previous hop k-1 retrieval can supply
    (first-1 <= k-1 <= hops-2: `first` 2 without retrieval at the prompt, 1 with; never the last hop), the right
    hops before, hop k-1 shown as a
    retrieved block (`<retrieve> step </retrieve>`, the advancing form) or as the policy's own step: the mean
    teacher-forced probability of the right hop k after each. A policy that continues after a retrieved step as
    after its own scores the first close to the second."""
    was = model.training
    model.eval()
    ret, own = [], []
    for p in problems:
        steps = task.solution(p)[:-1]
        for k in range(first, len(steps)):
            prefix = " ".join([p.prompt, *steps[: k - 1]])
            own.append(_step_prob(model, tok, f"{prefix} {steps[k - 1]}", steps[k]))
            ret.append(_step_prob(model, tok, f"{prefix} <retrieve> {steps[k - 1]} </retrieve>", steps[k]))
    if was:
        model.train()
    if not ret:
        return {"p_next_given_retrieved": math.nan, "p_next_given_own": math.nan, "n": 0}
    return {"p_next_given_retrieved": sum(ret) / len(ret), "p_next_given_own": sum(own) / len(own), "n": len(ret)}


def step_warmup_figures(
    model, tok, task, problems: Sequence, traces, group_size: int, seed: int, hybrid: dict, first_probe_hop: int = 2
) -> dict:
    """At the warm-up, `problems` in `task`'s facts: the advance probe, and one sampled on-policy and one hybrid
    rollout (every row hybrid, the family's `hybrid` options, retrieve_prob 0.5 by default, the advancing form from
    `traces`, an AdvancingTraces): success rates, leak, the retrieved steps' quality and the signatures (read
    without counting hint copies)."""
    from rapo_fast.rollouts.config import RolloutConfig
    from rapo_fast.rollouts.loop import rollout

    traces.task = task
    common = dict(group_size=group_size, temperature=1.0, max_step_tokens=16)
    on_cfg = RolloutConfig(strategy="on_policy", hybrid={"n_hybrid": 0}, **common)
    hy_cfg = RolloutConfig(strategy="hybrid", hybrid={"n_hybrid": group_size} | dict(hybrid), **common)
    on_b = rollout(model, tok, task, problems, on_cfg, seed=seed)
    hy_b = rollout(model, tok, task, problems, hy_cfg, traces=traces, seed=seed)
    on = D.read_batch(problems, on_b, hint_copies=False)
    hy = D.read_batch(problems, hy_b, hint_copies=False)
    rows_p = [problems[int(i)] for i in hy_b.prompt_index]
    on_p = [problems[int(i)] for i in on_b.prompt_index]
    return {
        "probe": advance_probe(model, tok, task, problems, first_probe_hop),
        "warmup_rollouts": {
            "onpolicy_success": sum(r["success"] for r in on) / len(on),
            "hybrid_success": sum(r["success"] for r in hy) / len(hy),
            "hybrid_leak_frac": D.leak_frac(hy),
            "onpolicy_first_hop_right": sum(_first_hop(r) for r in on) / len(on),
            "onpolicy_recall_frac": _recall(on_p, on),
            "hybrid_retrieved_rows": sum(any(s["kind"] == "ret" for s in r["segments"]) for r in hy) / len(hy),
            "onpolicy_signatures": D.signatures(on),
            "hybrid_signatures": D.signatures(hy),
            "onpolicy_top_signatures": D.signatures(on, successes_only=False),
            "n": len(on),
        },
        "source_quality": D.source_quality(rows_p, hy),
    }


def _first_hop(read: dict) -> bool:
    segs = [s for s in read["segments"] if s["kind"] != "answer"]
    return bool(segs) and segs[0]["kind"] == "own" and bool(segs[0]["hop"])


def _recall(problems: Sequence, reads: Sequence[dict]) -> float:
    hits = [(p, r) for p, r in zip(problems, reads) if r["success"]]
    return sum(D.used_unobserved(p, r) for p, r in hits) / len(hits) if hits else math.nan


def _fmax(xs) -> float:
    xs = [float(x) for x in xs if not math.isnan(float(x))]
    return max(xs) if xs else math.nan


def _recall_run(r: dict, chance: float) -> dict:
    """One run's training-time recall figures: its successes that used an entity never observed in the row, as a
    fraction of its successes and as a rate per row, and the rate's bound: guessing the answer among its type
    (chance + 3 standard errors)."""
    n, hits, rec = (
        int(r.get("training_rows", 0)),
        int(r.get("training_successes", 0)),
        int(r.get("training_recalled", 0)),
    )
    frac, rate = float(r.get("training_recall_frac", math.nan)), rec / n if n else math.nan
    bound = D.chance_bound(chance, n)
    return {
        "frac": frac,
        "recalled": rec,
        "successes": hits,
        "rows": n,
        "rate": rate,
        "rate_bound": bound,
        "pass": math.isnan(rate) or rate <= bound,
    }


def step_checks(fam: str, rows: Sequence[dict], warm: Sequence[dict]) -> dict:
    """The checks of one step family from its runs' rows and its per-seed warm-up figures: no_training_recall (every
    run's rate of successes through an unobserved entity per row within chance of guessing the answer: facts drawn
    afresh each step make a recalled entity right only as often as a guess, so a rate above chance would mean a
    shortcut the setting does not see; the fraction of successes beside it), source_quality (the retrieved steps'
    right relation after a right prefix, pooled over the seeds' warm-ups, at least SOURCE_RIGHT_MIN; the
    wrong-prefix figure and RAPO's runs' figures over training beside it; left out without warm-up figures for it),
    no_answer_leak_per_seed (every RAPO run's leak_frac at most LEAK_MAX)."""
    chance = sum(w["chance"] for w in warm) / len(warm) if warm else math.nan
    runs = {f"{r['method']}/{r['seed']}": _recall_run(r, chance) for r in rows}
    worst = _fmax(x["rate"] for x in runs.values())
    sq = [w["source_quality"] for w in warm if "source_quality" in w]
    n_r = sum(q["n_right_prefix"] for q in sq)
    n_w = sum(q["n_wrong_prefix"] for q in sq)
    right = sum(q["right_prefix"] * q["n_right_prefix"] for q in sq if q["n_right_prefix"]) / n_r if n_r else math.nan
    wrong = sum(q["wrong_prefix"] * q["n_wrong_prefix"] for q in sq if q["n_wrong_prefix"]) / n_w if n_w else math.nan
    leak = {str(r["seed"]): float(r["leak_frac"]) for r in rows if r["method"] == "RAPO"}
    in_training = {str(r["seed"]): r.get("_training_source_quality") for r in rows if r["method"] == "RAPO"}
    worst_leak = _fmax(leak.values())
    out = {
        f"no_training_recall/{fam}": {
            "value": worst,
            "bound": _fmax(x["rate_bound"] for x in runs.values()),
            "chance": chance,
            "worst_frac": _fmax(x["frac"] for x in runs.values()),
            "per_run": runs,
            "pass": all(x["pass"] for x in runs.values()),
        },
        f"source_quality/{fam}": {
            "value": right,
            "bound": SOURCE_RIGHT_MIN,
            "wrong_prefix": wrong,
            "n_right_prefix": n_r,
            "n_wrong_prefix": n_w,
            "rapo_training_per_seed": in_training,
            "pass": bool(not math.isnan(right) and right >= SOURCE_RIGHT_MIN),
        },
        f"no_answer_leak_per_seed/{fam}": {
            "value": worst_leak,
            "bound": LEAK_MAX,
            "per_seed": leak,
            "pass": bool(math.isnan(worst_leak) or worst_leak <= LEAK_MAX),
        },
    }
    if not sq:  # the hint variant: its retrieved steps are other questions' steps, read by no source_quality
        del out[f"source_quality/{fam}"]
    return out | source_bounds(fam, rows)


def pooled_training_quality(rows: Sequence[dict], method: str) -> tuple[float, int]:
    """(the share of `method`'s retrieved steps over training that carry the right relation after a right prefix,
    pooled over its runs; how many such steps)."""
    qs = [r.get("_training_source_quality") or {} for r in rows if r["method"] == method]
    n = sum(int(q.get("n_right_prefix") or 0) for q in qs)
    right = sum(float(q["right_prefix"]) * int(q["n_right_prefix"]) for q in qs if q.get("n_right_prefix"))
    return (right / n if n else math.nan), n


def source_label(right: float) -> str:
    """What a source is, by how often its step after a right prefix is right."""
    if math.isnan(right):
        return "unmeasured"
    return "oracle" if right > ORACLE_MIN else "near-oracle" if right >= NEAR_ORACLE_MIN else "noisy"


def source_bounds(fam: str, rows: Sequence[dict]) -> dict:
    """The source checked from above, over training: source_not_oracle (RAPO's retrieved steps after a right prefix
    right at most ORACLE_MIN of the time; a family whose source is an oracle by design, the positive control, passes
    it labelled "oracle") and, with RAPO_NOISY runs, noisy_source (its steps right after a right prefix in
    NOISY_RANGE: about half)."""
    from experiments.table1.families import get_family

    out: dict = {}
    right, n = pooled_training_quality(rows, "RAPO")
    if n:
        oracle = get_family(fam).traces_cls.label == "oracle"
        out[f"source_not_oracle/{fam}"] = {
            "value": right,
            "bound": ORACLE_MIN,
            "n": n,
            "label": source_label(right) + (" (by design: the positive control)" if oracle else ""),
            "pass": bool(oracle or right <= ORACLE_MIN),
        }
    right, n = pooled_training_quality(rows, "RAPO_NOISY")
    if n:
        lo, hi = NOISY_RANGE
        out[f"noisy_source/{fam}"] = {
            "value": right,
            "bound": hi,
            "low": lo,
            "n": n,
            "label": source_label(right),
            "pass": bool(lo <= right <= hi),
        }
    return out


__all__ = [
    "advance_probe",
    "pooled_training_quality",
    "source_bounds",
    "source_label",
    "step_warmup_figures",
    "step_checks",
    "SOURCE_RIGHT_MIN",
]
