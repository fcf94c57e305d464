"""The runner both GPU validation calls (bench/gpu/call*.py) share: steps under `timeout`, one log, a summary with a
compact table printed last, a deadline for the whole call, and the `--dry-run`, `--cpu-smoke` and `--record` modes.

A call is a list of Steps (a bash command with its time budget and the files it writes into the output folder). The
budgets of a call add up to less than CALL_BUDGET_S (9 minutes, so that one device-tool command of at most 10 minutes
holds the call with a margin) and a call writes at most MAX_FILES files, flat, into its output folder (the device tool
brings back 8). Every step runs under coreutils `timeout`: at its budget the step's process group gets SIGINT, so pytest
writes its junit XML and summary and a bench writes its "interrupted" row, then SIGKILL GRACE_S later. The benches
append each row as soon as it is measured, so a step stopped at any moment keeps every finished row. A step that fails
or times out is reported and the next step still runs (only the extension check ends the call: nothing after it could
measure anything).
`--deadline-s` bounds the whole call (seconds from its start); `--asked-at` with `--lease-left` gives it the lease
instead, and the deadline then follows from the time the call actually starts (bench/gpu/_lease.py). A step whose budget
(plus the grace) would end after the deadline is not started but recorded as skipped, and later, shorter steps still run
if they fit, so the call's files are written before the device tool's own limit takes the machine. The summary is
rewritten before and after every step (the step in flight is marked running), so even a call killed from outside keeps
what it did and says which step it was in and which never ran.
What this is not: a benchmark or a test runner itself (the steps call bench/bench_*.py and pytest), the record logic
(bench/gpu/_record.py) nor the plan of the rows (bench/gpu/_plan.py).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CALL_BUDGET_S = 540  # the sum of a call's step budgets must stay under this (9 minutes; the tool allows 10)
MAX_FILES = 8  # the device tool returns at most 8 files
GRACE_S = 15  # after SIGINT at the budget: time to write junit XML / the interrupted row, then SIGKILL
WHEELS = ".carry/wheels"
SITE = "/tmp/rapo_fast_site"  # where the carried wheels are installed on the GPU machine (--target, on PYTHONPATH)


@dataclass(frozen=True)
class Step:
    """One command of a call: `cmd` is bash with {py} (this Python), {out} (the output folder), {tmp} (a scratch
    folder outside it), {root} (the repository) and {here} (bench/gpu); `files` are the names it writes into {out}.
    `plan` says which CSV rows the step takes, in order: a bench's argv (its `--plan` lists them) or fixed lines."""

    name: str
    cmd: str
    budget_s: int
    files: tuple[str, ...] = ()
    required: bool = False  # when it fails, the call stops (the extension check)
    plan: tuple[str, ...] = ()  # ("bench:<bench_x.py> ARGS",) or fixed row descriptions


@dataclass
class Stage:
    """A call: its name (also the stem of its log and summary), its steps for the GPU and for the CPU smoke run, and
    the CSVs its table shows (name -> columns) and that `--record` appends to bench/results/ (name -> results name)."""

    name: str
    title: str
    gpu_steps: list[Step]
    smoke_steps: list[Step]
    table: dict[str, list[str]] = field(default_factory=dict)
    record: dict[str, str] = field(default_factory=dict)
    keep: object = None  # a _lease.Keep: what this call keeps back of the lease for the next one (None: the last)

    def files(self, steps: list[Step]) -> list[str]:
        names = [f"{self.name}.log", f"{self.name}_summary.txt"] + [f for s in steps for f in s.files]
        return list(dict.fromkeys(names))  # several steps may append to one CSV


def check_bounds(stage: Stage) -> None:
    """Fail at import (so in CI) when a call's GPU steps reach the time budget, or either list of steps exceeds the
    file limit. The CPU smoke steps have no device-tool command to fit (their run's time is CI's), only its files."""
    total = sum(s.budget_s for s in stage.gpu_steps)
    n_files = max(len(stage.files(stage.gpu_steps)), len(stage.files(stage.smoke_steps)))
    if total >= CALL_BUDGET_S or n_files > MAX_FILES:
        raise ValueError(
            f"{stage.name}: {total} s of GPU budget (must stay under {CALL_BUDGET_S}) and up to {n_files} files "
            f"(limit {MAX_FILES})"
        )


def _budget_override(text: str) -> tuple[str, int]:
    name, sep, secs = text.partition("=")
    if not sep or not secs.isdigit() or int(secs) < 1:
        raise argparse.ArgumentTypeError(f"--budget expects STEP=SECONDS (SECONDS >= 1), got {text!r}")
    return name, int(secs)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of seconds >= 1, got {text!r}")
    return int(text)


def _parser(stage: Stage) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"bench/gpu/{stage.name}.py", description=stage.title)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", type=Path, metavar="DIR", help="run the call on the GPU, writing its files into DIR")
    g.add_argument("--dry-run", action="store_true", help="list the steps, budgets, files and rows; run nothing")
    g.add_argument(
        "--cpu-smoke",
        type=Path,
        metavar="DIR",
        help="run the call end to end on the CPU at tiny shapes into DIR (tests the script; times mean nothing)",
    )
    g.add_argument(
        "--record",
        type=Path,
        metavar="DIR",
        help="append the CSV rows of a GPU run found in DIR to bench/results/*_gpu.csv (device, date, commit)",
    )
    p.add_argument(
        "--steps",
        default=None,
        metavar="A,B",
        help="run only these steps (and the required extension step), e.g. to retake what a timeout cut short",
    )
    p.add_argument(
        "--budget",
        type=_budget_override,
        action="append",
        default=[],
        metavar="STEP=SECONDS",
        help="replace one step's budget (repeatable; the tests use it to stop a step mid-way)",
    )
    p.add_argument(
        "--deadline-s",
        type=_positive_int,
        default=None,
        metavar="SECONDS",
        help="end the call within SECONDS of its start: steps that cannot finish before it are skipped and recorded "
        "as such (with --asked-at and --lease-left, a cap on the deadline taken from the lease)",
    )
    p.add_argument(
        "--asked-at",
        type=float,
        default=None,
        metavar="UNIX_S",
        help="with --lease-left: when the device tool's run was asked for (`date +%%s` on the driving machine); the "
        "call reads the clock at its start and takes its deadline from the lease left then (bench/gpu/_lease.py)",
    )
    p.add_argument(
        "--lease-left",
        type=_positive_int,
        default=None,
        metavar="SECONDS",
        help="with --asked-at: the device time left when the run was asked for (the tool's status, budget_left_s)",
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
    p = _parser(stage)
    args = p.parse_args(argv)
    if args.dry_run:
        from _plan import print_stage

        return print_stage(stage)
    if args.record:
        from _record import record

        return record(stage, args.record, args.results, args.commit)
    smoke = args.cpu_smoke is not None
    steps = stage.smoke_steps if smoke else stage.gpu_steps
    names = {s.name for s in steps}
    budgets = dict(args.budget)
    wanted = set(args.steps.split(",")) if args.steps else None
    for n in (set(budgets) | (wanted or set())) - names:
        p.error(f"no step {n!r} in {stage.name} ({'cpu-smoke' if smoke else 'GPU'} steps: {', '.join(sorted(names))})")
    steps = [
        Step(s.name, s.cmd, budgets.get(s.name, s.budget_s), s.files, s.required, s.plan)
        for s in steps
        if wanted is None or s.name in wanted or s.required
    ]
    deadline_s, lease = args.deadline_s, None
    if (args.asked_at is None) != (args.lease_left is None):
        p.error("--asked-at and --lease-left go together (the time of the ask and the device time left then)")
    if args.asked_at is not None:
        from _lease import deadline

        start_s = time.time() - args.asked_at  # the machine's start and the tree's transfer, as this clock sees them
        clamped = max(0.0, min(start_s, args.lease_left))  # a clock behind the driver's reads as a free start
        deadline_s = deadline(args.lease_left, clamped, deadline_s or CALL_BUDGET_S, stage.keep)
        lease = f"lease: {args.lease_left} s left when asked at {args.asked_at:.0f}; started {start_s:.0f} s after"
    return run(stage, steps, args.cpu_smoke if smoke else args.out, smoke, deadline_s=deadline_s, lease=lease)


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


def _default_signals() -> None:
    """In the step's process, before exec: SIGINT and SIGTERM back to their defaults. A command started in the
    background by a non-interactive shell (as a remote runner may start ours) inherits SIGINT ignored, and then
    `timeout`'s SIGINT would do nothing: no KeyboardInterrupt, no junit XML, no interrupted row."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_step(step: Step, fmt: dict, env: dict, log) -> tuple[str, float]:
    cmd = step.cmd.format(**fmt)
    log.write(f"\n===== {step.name} (budget {step.budget_s} s): {cmd}\n")
    log.flush()
    t0 = time.perf_counter()
    argv = ["timeout", "-s", "INT", "-k", str(GRACE_S), str(step.budget_s), "bash", "-c", cmd]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_default_signals)
    try:  # coreutils timeout bounds the step and its children; this wait is the backstop
        rc = proc.wait(timeout=step.budget_s + GRACE_S + 15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = 124
    dt = time.perf_counter() - t0
    # timeout's own 124 (stopped at the budget) and 137 (killed after the grace); a step whose commands exited on
    # the SIGINT themselves (pytest: 2, a bench: 130) is still a timeout when it ran to its budget.
    over = rc in (124, 137) or (rc != 0 and dt >= step.budget_s)
    status = "ok" if rc == 0 else ("TIMEOUT" if over else f"FAILED rc={rc}")
    log.write(f"===== {step.name}: {status} in {dt:.1f} s\n")
    log.flush()
    return status, dt


def _summary(
    stage: Stage, out: Path, head: list[str], results: list, steps: list[Step], running: Step | None
) -> list[str]:
    lines = head + [f"step {s.name:<16} {st:<12} {dt:7.1f} s / {s.budget_s} s" for s, st, dt in results]
    rest = steps[len(results) :]
    if running is not None:  # rewritten when it ends: a call killed meanwhile shows where it was
        lines.append(f"step {running.name:<16} {'running':<12} (killed from outside if this line remains)")
        rest = rest[1:]
    lines += [f"step {s.name:<16} {'not run':<12}" for s in rest]
    lines += table(out, stage.table)
    (out / f"{stage.name}_summary.txt").write_text("\n".join(lines) + "\n")
    return lines


def run(
    stage: Stage, steps: list[Step], out: Path, smoke: bool, deadline_s: int | None = None, lease: str | None = None
) -> int:
    """Run `steps` in order into `out`; with `deadline_s`, start only the steps whose budget (and grace) ends before
    it, recording the others as skipped (`lease` says where the deadline came from). Returns 0 when every step ran
    and passed, 1 otherwise."""
    t_start = time.monotonic()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"rapo_fast_{stage.name}_"))
    fmt = dict(py=sys.executable, out=out, tmp=tmp, root=ROOT, here=HERE)
    env = _env(smoke)
    head = [
        f"stage: {stage.name} ({stage.title})",
        f"mode: {'cpu-smoke' if smoke else 'gpu'}",
        f"date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        f"commit: {os.environ.get('RAPO_FAST_COMMIT', 'unknown')}",
        f"device: {'cpu (smoke run)' if smoke else _gpu_name()}",
        f"deadline: {'none' if deadline_s is None else f'{deadline_s} s from the start'}",
    ] + ([lease] if lease else [])
    results: list = []
    with (out / f"{stage.name}.log").open("a") as log:
        for step in steps:
            left = None if deadline_s is None else deadline_s - (time.monotonic() - t_start)
            if left is not None and step.budget_s + GRACE_S > left:
                status, dt = f"SKIPPED (deadline: {max(0, int(left))} s left)", 0.0
                log.write(f"\n===== {step.name}: {status}; needs {step.budget_s} s + {GRACE_S} s grace\n")
                log.flush()
            else:
                _summary(stage, out, head, results, steps, running=step)
                status, dt = _run_step(step, fmt, env, log)
            results.append((step, status, dt))
            print(f"[{stage.name}] {step.name}: {status} in {dt:.1f} s (budget {step.budget_s} s)", flush=True)
            _summary(stage, out, head, results, steps, running=None)
            if step.required and status != "ok":
                break
    took = f"call: {time.monotonic() - t_start:.0f} s" + (
        f" of a {deadline_s} s deadline" if deadline_s is not None else ""
    )
    lines = _summary(stage, out, head + [took], results, steps, running=None)
    print("\n".join(lines))
    bad = [s.name for s, st, _ in results if st != "ok"] + [s.name for s in steps[len(results) :]]
    return 1 if bad else 0


def table(out: Path, spec: dict[str, list[str]], cap: int = 48) -> list[str]:
    """The compact table: for each CSV of the call, its rows in the named columns, each column as wide as its widest
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
