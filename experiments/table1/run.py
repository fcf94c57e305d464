"""The Table-1 experiment's runner: `python -m experiments.table1` (README.md beside this file says what it runs).

What this is: the worker pool: per family and seed one "prepare" job, then one job per method (jobs.py), in
`--workers` one-thread worker processes; it writes table1.csv, table1.md, table1.png and table1_checks.json. The
jobs, the workers and the output files are described in runner.md.
What this is not: the statistics (stats.py) or a claim: the numbers are whatever the run measures.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

import torch

from experiments.table1.checks import build_checks, withheld_by
from experiments.table1.jobs import add_targets, prepare, run_one, write_atomic
from experiments.table1.report import write_outputs
from experiments.table1.setting import encoder_name, parser, setting_from
from rapo_fast.train.progress import PlainProgress, progress_bar

# Which ready job a free worker takes first: the lowest seed's (a run cut off then leaves whole seeds, every method's
# row of a seed: the pairs the tables need; rows.jsonl keeps them), its prepare job (which unlocks its method runs),
# then its longest runs (measured on a full run of the setting before kb_alias: RAPO 110-150 s, ARPO and
# OFFPOLICY_TRAJ 50-75 s, GRPO 40-60 s).
_COST = {
    "RAPO": 3,
    "RAPO_NO_RET_REWARD": 3,
    "RAPO_NO_SHAPING": 3,
    "RAPO_SFT_NO_RETRIEVE": 3,
    "RAPO_NOISY": 3,
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


def _priority(job: tuple) -> tuple[int, int, int]:
    kind, args = job
    return (args[1], 0, 0) if kind == "prepare" else (args[2], 1, -_COST.get(args[1], 1))


def _job_name(kind: str, args: tuple) -> str:
    return f"family {args[0]}, seed {args[1]}" if kind == "prepare" else f"{args[0]}/{args[1]}/seed {args[2]}"


ROWS = "rows.jsonl"  # every finished run's row, appended as it lands: a run cut off keeps what it finished


def _keep_row(out: Path, row: dict) -> None:
    """Append `row` to out/rows.jsonl in one write (a line cut by a crash is skipped when read back)."""
    with open(out / ROWS, "a") as f:
        f.write(json.dumps(row) + "\n")


def _kept_rows(out: Path) -> dict[tuple[str, str, int], dict]:
    """The rows out/rows.jsonl holds, by (family, method, seed); a line a crash cut is skipped."""
    got: dict[tuple[str, str, int], dict] = {}
    if (out / ROWS).exists():
        for line in (out / ROWS).read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            r["_curve"] = [tuple(x) for x in r["_curve"]]
            got[(r["task"], r["method"], int(r["seed"]))] = r
    return got


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
    workers = default_workers() if workers is None else workers
    if workers < 0:
        raise ValueError(f"table1.run: workers: expected >= 0, got {workers}")
    for key in ("families", "methods"):
        if not s[key]:
            raise ValueError(f"table1.run: setting {key!r}: expected at least one, got {s[key]!r}")
    if s["seeds"] < 1:
        raise ValueError(f"table1.run: setting 'seeds': expected >= 1, got {s['seeds']}")
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
    finished = _kept_rows(out) if s.get("reuse_prepared") else {}
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
                    for m in s["methods"]:
                        if (args[0], m, args[1]) in finished:
                            rows.append(finished[(args[0], m, args[1])])
                            bar.update(1)
                        else:
                            todo.append(("run", (args[0], m, args[1], s, result, enc)))
                    todo.sort(key=_priority)
                else:
                    rows.append(result)
                    _keep_row(out, result)
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
    write_atomic(out / "table1_checks.json", lambda f: f.write(json.dumps(checks, indent=1).encode()))
    write_outputs(out, rows, s, enc, time.perf_counter() - t_all, checks, withheld_by(checks))
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    s = setting_from(a)
    if a.workers is not None and a.workers < 0:
        raise SystemExit(f"table1: --workers: expected >= 0, got {a.workers}")
    rows = run(s, Path(a.out), progress=not a.no_progress, workers=a.workers)
    print((Path(a.out) / "table1.md").read_text())
    print(f"table1: {len(rows)} runs; wrote table1.csv, table1.md, table1.png to {a.out}")
    return 0


__all__ = ["default_workers", "main", "run"]
