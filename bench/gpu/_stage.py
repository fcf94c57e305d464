"""The runner every GPU validation stage (bench/gpu/stage*.py) shares: steps under `timeout`, one log, a summary with
a compact table printed last, and the `--dry-run`, `--cpu-smoke` and `--record` modes.

A stage is a list of Steps (a bash command with its time budget and the files it writes into the output folder). The
budgets of a stage add up to at most STAGE_BUDGET_S (8 minutes, so that one device-tool call of at most 10 minutes
holds the stage and its start) and a stage writes at most MAX_FILES files, flat, into its output folder (the device
tool brings back at most 8). Every step runs under coreutils `timeout` with its budget; a step that fails or times out
is reported and the next step still runs (a later step never needs an earlier step's success except the extension
check, whose failure ends the stage).
What this is not: a benchmark or a test runner itself (the steps call bench/bench_*.py and pytest), nor the record
logic (bench/gpu/_record.py).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STAGE_BUDGET_S = 480
MAX_FILES = 6
WHEELS = ".carry/wheels"
SITE = "/tmp/rapo_fast_site"  # where the carried wheels are installed on the GPU machine (--target, on PYTHONPATH)


@dataclass(frozen=True)
class Step:
    """One command of a stage: `cmd` is bash with {py} (this Python), {out} (the output folder), {tmp} (a scratch
    folder outside it), {root} (the repository) and {here} (bench/gpu); `files` are the names it writes into {out}."""

    name: str
    cmd: str
    budget_s: int
    files: tuple[str, ...] = ()
    required: bool = False  # when it fails, the stage stops (the extension check)


@dataclass
class Stage:
    """A stage: its name (also the stem of its log and summary), its steps for the GPU and for the CPU smoke run, and
    the CSVs its table shows (name -> columns) and that `--record` appends to bench/results/ (name -> results name)."""

    name: str
    title: str
    gpu_steps: list[Step]
    smoke_steps: list[Step]
    table: dict[str, list[str]] = field(default_factory=dict)
    record: dict[str, str] = field(default_factory=dict)

    def files(self, steps: list[Step]) -> list[str]:
        names = [f"{self.name}.log", f"{self.name}_summary.txt"] + [f for s in steps for f in s.files]
        return list(dict.fromkeys(names))  # several steps may append to one CSV


def check_bounds(stage: Stage) -> None:
    """Fail at import (so in CI) when a stage's steps exceed the time budget or the file limit."""
    for steps in (stage.gpu_steps, stage.smoke_steps):
        total = sum(s.budget_s for s in steps)
        if total > STAGE_BUDGET_S or len(stage.files(steps)) > MAX_FILES:
            raise ValueError(
                f"{stage.name}: {total} s of budget (limit {STAGE_BUDGET_S}) and {len(stage.files(steps))} files "
                f"(limit {MAX_FILES})"
            )


def _parser(stage: Stage) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"bench/gpu/{stage.name}.py", description=stage.title)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", type=Path, metavar="DIR", help="run the stage on the GPU, writing its files into DIR")
    g.add_argument("--dry-run", action="store_true", help="list the steps, budgets and files; run nothing")
    g.add_argument(
        "--cpu-smoke",
        type=Path,
        metavar="DIR",
        help="run the stage end to end on the CPU at tiny shapes into DIR (tests the script; times mean nothing)",
    )
    g.add_argument(
        "--record",
        type=Path,
        metavar="DIR",
        help="append the CSV rows of a GPU run found in DIR to bench/results/*_gpu.csv (device, date, commit)",
    )
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help=argparse.SUPPRESS)
    p.add_argument(
        "--commit",
        default=None,
        help="with --record: the commit for rows that say 'unknown' (the GPU machine has no .git; default: this "
        "checkout's HEAD, with -dirty when it has changes)",
    )
    return p


def main(stage: Stage, argv: list[str] | None = None) -> int:
    args = _parser(stage).parse_args(argv)
    if args.dry_run:
        return dry_run(stage)
    if args.record:
        from _record import record

        return record(stage, args.record, args.results, args.commit)
    smoke = args.cpu_smoke is not None
    return run(stage, args.cpu_smoke if smoke else args.out, smoke)


def dry_run(stage: Stage) -> int:
    for label, steps in (("GPU", stage.gpu_steps), ("--cpu-smoke", stage.smoke_steps)):
        print(f"{stage.name} ({label}): {stage.title}")
        for i, s in enumerate(steps, 1):
            print(f"  {i}. {s.name:<14} budget {s.budget_s:>4} s  writes {', '.join(s.files) or '-'}")
            print(f"     $ {s.cmd}")
        files = stage.files(steps)
        total = sum(s.budget_s for s in steps)
        print(f"  budget: {total} s = {total / 60:.1f} min (limit {STAGE_BUDGET_S // 60} min)")
        print(f"  files: {len(files)} (limit {MAX_FILES}): {', '.join(files)}")
    return 0


def _env(smoke: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT)] + ([] if smoke else [SITE]) + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(paths)
    if smoke:  # the CPU backends (pytest's conftest still puts Triton in the interpreter for the tests it runs)
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("TRITON_INTERPRET", None)
    return env


def _gpu_name() -> str:
    """The GPU's name from nvidia-smi (no torch import in the runner), or 'unknown'."""
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _run_step(step: Step, fmt: dict, env: dict, log) -> tuple[str, float]:
    cmd = step.cmd.format(**fmt)
    log.write(f"\n===== {step.name} (budget {step.budget_s} s): {cmd}\n")
    log.flush()
    t0 = time.perf_counter()
    try:  # coreutils timeout bounds the step and its children; the Python timeout is the backstop
        rc = subprocess.run(
            ["timeout", "-k", "10", str(step.budget_s), "bash", "-c", cmd],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=step.budget_s + 30,
        ).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    dt = time.perf_counter() - t0
    status = "ok" if rc == 0 else ("TIMEOUT" if rc in (124, 137) else f"FAILED rc={rc}")
    log.write(f"===== {step.name}: {status} in {dt:.1f} s\n")
    log.flush()
    return status, dt


def run(stage: Stage, out: Path, smoke: bool) -> int:
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = stage.smoke_steps if smoke else stage.gpu_steps
    tmp = Path(tempfile.mkdtemp(prefix=f"rapo_fast_{stage.name}_"))
    fmt = dict(py=sys.executable, out=out, tmp=tmp, root=ROOT, here=HERE)
    env = _env(smoke)
    head = [
        f"stage: {stage.name} ({stage.title})",
        f"mode: {'cpu-smoke' if smoke else 'gpu'}",
        f"date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        f"commit: {os.environ.get('RAPO_FAST_COMMIT', 'unknown')}",
        f"device: {'cpu (smoke run)' if smoke else _gpu_name()}",
    ]
    results = []
    with (out / f"{stage.name}.log").open("a") as log:
        for step in steps:
            status, dt = _run_step(step, fmt, env, log)
            results.append((step, status, dt))
            print(f"[{stage.name}] {step.name}: {status} in {dt:.1f} s (budget {step.budget_s} s)", flush=True)
            if step.required and status != "ok":
                break
    lines = head + [f"step {s.name:<14} {st:<12} {dt:7.1f} s / {s.budget_s} s" for s, st, dt in results]
    lines += table(out, stage.table)
    (out / f"{stage.name}_summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [s.name for s, st, _ in results if st != "ok"] + [s.name for s in steps[len(results) :]]
    return 1 if bad else 0


def table(out: Path, spec: dict[str, list[str]], cap: int = 48) -> list[str]:
    """The compact table: for each CSV of the stage, its rows in the named columns, each column as wide as its widest
    cell up to `cap` (longer cells keep their end: a test's name, a status's reason); a missing CSV is said so."""
    lines = []
    for name, cols in spec.items():
        path = out / name
        if not path.exists():
            lines.append(f"== {name}: missing")
            continue
        with path.open() as f:
            rows = [[_cell(r.get(c)) for c in cols] for r in csv.DictReader(f)]
        lines.append(f"== {name} ({len(rows)} rows)")
        widths = [min(cap, max(len(c), *(len(r[i]) for r in rows))) for i, c in enumerate(cols)]
        for r in [cols, *rows]:
            lines.append(" ".join(f"{v[-w:]:>{w}}" for v, w in zip(r, widths)))
    return lines


def _cell(v: str | None) -> str:
    if v in (None, ""):
        return "-"
    try:
        x = float(v)
    except ValueError:
        return v
    return v if x.is_integer() and "." not in v else f"{x:.4g}"
