"""The Table-1 experiment's two kinds of job: `prepare` (per family and seed: the SFT warm-up, the solver's
trajectories, the warm-up's figures) and `run_one` (one method from those files), and `add_targets`, the efficiency
measure over the finished rows.

What this is: what one worker does, at one thread; every job rebuilds its family's data (deterministic, cheap)
rather than receiving it. What this is not: the worker pool (run.py), the checks over a whole run (checks.py) or
the report.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from experiments.table1 import diagnostics as D
from experiments.table1.crn import StepSeeds
from experiments.table1.endpoint import distinct_questions, heldout_logp
from experiments.table1.exploration import ExplorationReader, auc, hop_split
from experiments.table1.families import get_family
from experiments.table1.kb_alias import from_hop_one
from experiments.table1.setting import config, encoder
from experiments.table1.stats import first_reach, mean_ci
from experiments.table1.step_checks import step_warmup_figures
from rapo_fast.demo.tasks import read_jsonl, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.offpolicy import OffPolicyTrajectories
from rapo_fast.train.callbacks import EvalCallback
from rapo_fast.train.sft import evaluate


def _needs_plain_warm_up(s: dict) -> bool:
    return "RAPO_SFT_NO_RETRIEVE" in s["methods"]


def prepare(family: str, seed: int, s: dict, out: Path) -> dict[str, Path]:
    """The shared inputs of one (family, seed)'s method runs, written into `out`: the SFT warm-up weights (and those
    of a warm-up without retrieved steps when RAPO_SFT_NO_RETRIEVE runs), RAPO's and OFFPOLICY_TRAJ's solver
    trajectories (one file when the family gives both the same source), and the warm-up's diagnostics
    (warmup_{family}_{seed}.json: the source's kept-trace figures; for readable families the hint/conditioning probe
    and the hybrid rollout's leak at the warm-up). Returns their paths."""
    fam = get_family(family)
    data = fam.data(seed, s)
    k = s["traces_top_k"]
    paths = {
        "warm": out / f"warm_{family}_{seed}.pt",
        "jsonl": out / f"traces_{family}_{seed}.jsonl",
        "checks": out / f"warmup_{family}_{seed}.json",
    }
    if s.get("reuse_prepared") and _prepared(paths, family, seed, s, out):
        return paths
    if s.get("reuse_prepared") and _prepared(paths, family, seed, s, out, but_checks=True):
        # weights and sources kept, the warm-up's figures measured again (a source form changed since, or a cut run)
        rapo_src, off_src = read_jsonl(paths["jsonl"]), read_jsonl(paths["off_jsonl"])
        warm = torch.load(paths["warm"], weights_only=True)
    else:
        rapo_src = fam.rapo_source(data, s, seed)
        write_jsonl(rapo_src, paths["jsonl"])
        if fam.same_source:
            off_src, paths["off_jsonl"] = rapo_src, paths["jsonl"]
        else:
            off_src, paths["off_jsonl"] = fam.offpolicy_source(data, s, seed), out / f"offpolicy_{family}_{seed}.jsonl"
            write_jsonl(off_src, paths["off_jsonl"])
        warm = fam.warm_up(data, s, seed)
        _save_atomic(warm, paths["warm"])
        if _needs_plain_warm_up(s):
            paths["warm_plain"] = out / f"warm_plain_{family}_{seed}.pt"
            _save_atomic(fam.warm_up(data, s, seed, retrieve_frac=0.0), paths["warm_plain"])
    checks = warmup_checks(fam, data, warm, rapo_src, off_src, paths["jsonl"], k, s, seed)
    write_atomic(paths["checks"], lambda f: f.write(json.dumps(checks, indent=1).encode()))
    return paths


def _prepared(paths: dict, family: str, seed: int, s: dict, out: Path, but_checks: bool = False) -> bool:
    """Whether every file `prepare` writes (`but_checks`: but the warm-up's figures) is in `out` already (each
    written atomically: present means whole); fills in the paths it would have chosen."""
    paths["off_jsonl"] = paths["jsonl"] if get_family(family).same_source else out / f"offpolicy_{family}_{seed}.jsonl"
    if _needs_plain_warm_up(s):
        paths["warm_plain"] = out / f"warm_plain_{family}_{seed}.pt"
    return all(Path(p).exists() for name, p in paths.items() if not (but_checks and name == "checks"))


def warmup_checks(
    fam, data: dict, warm: dict, rapo_src: list, off_src: list, jsonl: Path, k: int, s: dict, seed: int
) -> dict:
    """What the warm-up and the sources look like before any RL step: kept-trace figures of both sources, and for
    readable families the probe of whether the policy can use a retrieved step, and a hybrid rollout's success, leak
    and on-policy success on the training questions (sampled, seed-fixed)."""
    out = {
        "rapo_source": D.kept_trace_stats(rapo_src, k),
        "offpolicy_source": D.kept_trace_stats(off_src, k),
        "chance": fam.chance(data),
    }
    if not fam.readable:
        return out
    model = _load_policy(data["tok"], warm, seed)
    probes = data["train"][: min(32, len(data["train"]))]
    if fam.retrieve_style == "advance":
        traces = fam.step_traces(jsonl, encoder(s["encoder"]), data["tok"], k, seed=seed)
        figures = step_warmup_figures(
            model, data["tok"], data["task"], probes, traces, s["group_size"], seed, fam.hybrid, fam.first_probe_hop
        )
        return out | figures
    if fam.retrieve_style == "foreign":
        out["probe"] = D.hint_probe(model, data["tok"], data["task"], probes)
    else:
        out["probe"] = D.conditioning_probe(model, data["tok"], data["task"], probes)
    traces = StepTraces.from_jsonl(jsonl, encoder(s["encoder"]), data["tok"], top_k=k)
    out["warmup_rollouts"] = D.rollout_figures(model, data["tok"], data["task"], probes, traces, s["group_size"], seed)
    return out


def _load_policy(tok, state: dict, seed: int):
    torch.manual_seed(seed)
    model = build_tiny_policy(tok.vocab_size, seed=seed)
    model.load_state_dict(state)
    return model


def write_atomic(path: Path, write) -> None:
    """`write(file)` into a temporary beside `path`, then renamed over it: a run cut off mid-write never leaves a
    truncated file that a later job would load (the temporary gets a random name, created exclusively)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_atomic(obj, path: Path) -> None:
    write_atomic(path, lambda f: torch.save(obj, f))


def run_one(family: str, method: str, seed: int, s: dict, paths: dict[str, Path], enc: str) -> dict:
    """One method from the family's warm-up weights for `seed` (the files `prepare` wrote); returns its CSV row plus
    its curves. Readable families also get: leak_frac over the run's hybrid successes (RolloutReader), the final
    evaluation read hop by hop (successes with an answer no observation showed), and the final policy's greedy
    success on the training questions with retrieval from RAPO's source (eval_with_retrieval_train_final). Every row
    carries the continuous endpoint (endpoint.heldout_logp) at the warm-up and at the end; the sampler is
    reseeded per step in families with `step_seeds` (crn.StepSeeds: what the methods of a seed share)."""
    t0 = time.perf_counter()
    fam = get_family(family)
    data = fam.data(seed, s)
    task, tok = data["task"], data["tok"]
    warm = paths["warm_plain"] if method == "RAPO_SFT_NO_RETRIEVE" else paths["warm"]
    model = _load_policy(tok, torch.load(warm, weights_only=True), seed)
    logp_start = heldout_logp(model, tok, task, data["evals"])
    hops_start = hop_split(D.read_greedy(model, tok, task, data["evals"])) if fam.readable else {}
    cfg = config(method, s, seed, fam.hybrid)
    k = s["traces_top_k"]
    uses_traces = method.startswith("RAPO")
    noisy = method == "RAPO_NOISY"
    traces = fam.step_traces(paths["jsonl"], encoder(enc), tok, k, noisy=noisy, seed=seed) if uses_traces else None
    off = OffPolicyTrajectories.from_jsonl(paths["off_jsonl"], top_k=k) if method == "OFFPOLICY_TRAJ" else None
    trainer = fam.trainer(data, model, traces, cfg, off)
    held_out = EvalCallback(lambda t: evaluate(t.model, tok, task, data["evals"], max_step_tokens=16), s["eval_every"])
    reader = D.RolloutReader(hint_copies=fam.retrieve_style != "advance")
    # kb_alias's recorded run predates the reseeding: that family keeps one stream per run
    seeds = [StepSeeds(seed)] if getattr(fam, "step_seeds", False) else []
    explore = ExplorationReader()
    # the state a retrieved hop 1 puts a row in: held-out questions with their right hop 1 taken (the policy alone)
    from_hop1 = [from_hop_one(task, p) for p in data["evals"]] if fam.hybrid.get("at_prompt") else []
    after_hop1 = EvalCallback(
        lambda t: evaluate(t.model, tok, task, from_hop1, max_step_tokens=16), s["eval_every"], name="eval_from_hop1"
    )
    callbacks = [held_out] + ([after_hop1] if from_hop1 else []) + ([reader, explore] if fam.readable else []) + seeds
    history = trainer.train(s["rl_steps"], progress=False, callbacks=callbacks, desc=f"{family}/{method}/{seed}")
    tokens = [0]
    for h in history:
        tokens.append(tokens[-1] + int(h.get("tokens_generated", 0)))
    curve = held_out.curve
    row = {
        "task": family,
        "method": method,
        "seed": seed,
        "eval_start": curve[0][1],
        "eval_final": curve[-1][1],
        "eval_best": max(v for _, v in curve),
        "auc": auc(curve),
        "n_heldout": len(distinct_questions(data["evals"])),
        "auc_from_hop1": auc(after_hop1.curve) if from_hop1 else math.nan,
        "eval_from_hop1_start": after_hop1.curve[0][1] if from_hop1 else math.nan,
        "eval_from_hop1_final": after_hop1.curve[-1][1] if from_hop1 else math.nan,
        "heldout_logp_start": logp_start,
        "heldout_logp_final": heldout_logp(trainer.model, tok, task, data["evals"]),
        "tokens_generated": tokens[-1],
        "wall_s": math.nan,
        "encoder": enc,
        "arpo_rule": cfg.rollout.arpo.rule if method == "ARPO" else "",
        "leak_frac": math.nan,
        "hybrid_successes": 0,
        "unobserved_success_final": math.nan,
        "eval_with_retrieval_train_final": math.nan,
        "_curve": curve,
        "_tokens": tokens,
    }
    if fam.readable:
        row["leak_frac"], row["hybrid_successes"] = reader.leak_frac(), reader.hybrid_successes
        row["training_recall_frac"] = reader.recall_frac()
        row["training_rows"], row["training_successes"] = reader.rows, reader.successes
        row["training_recalled"] = reader.recalled
        row |= explore.figures()
        row["_training_source_quality"] = reader.source_quality()
        row["_signatures"] = reader.signatures()
        reads = D.read_greedy(trainer.model, tok, task, data["evals"])
        row |= {f"{k}_start": v for k, v in hops_start.items()} | {f"{k}_final": v for k, v in hop_split(reads).items()}
        row["unobserved_success_final"] = D.unobserved_success(reads)
        src = traces if traces is not None else fam.step_traces(paths["jsonl"], encoder(enc), tok, k, seed=seed)
        if hasattr(src, "task"):
            src.task = task  # the with-retrieval evaluation asks data["train"], in data["task"]'s facts
        row["eval_with_retrieval_train_final"] = D.greedy_with_retrieval(trainer.model, tok, task, data["train"], src)
    row["wall_s"] = time.perf_counter() - t0
    return row


def add_targets(rows: list[dict]) -> None:
    """steps_to_target / tokens_to_target of every run: the first evaluation reaching GRPO's final mean eval on the
    same task (the paper's efficiency measure), or '' when never reached."""
    for task in {r["task"] for r in rows}:
        grpo = [r["eval_final"] for r in rows if r["task"] == task and r["method"] == "GRPO"]
        level = mean_ci(grpo)[0] if grpo else math.nan
        for r in (r for r in rows if r["task"] == task):
            step = None if math.isnan(level) else first_reach(r["_curve"], level)
            r["target"] = level
            r["steps_to_target"] = "" if step is None else step
            r["tokens_to_target"] = "" if step is None else r["_tokens"][min(step, len(r["_tokens"]) - 1)]


__all__ = ["add_targets", "prepare", "run_one", "warmup_checks", "write_atomic"]
