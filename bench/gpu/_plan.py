"""What `--dry-run` prints: a call's steps with their budgets and files, and the CSV rows it will take, in the order
it takes them (each bench step asks its bench's `--plan`, in this process, so nothing is measured or compiled).

What this is not: the runner (_stage.py) nor the list of steps (call1_headline.py, call2_anchors.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import shlex
import sys
from pathlib import Path

from _stage import CALL_BUDGET_S, MAX_FILES, ROOT, Stage, Step

BENCH = ROOT / "bench"


def _bench_main(script: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_plan_{Path(script).stem}", BENCH / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def step_rows(step: Step) -> list[str]:
    """The rows `step` takes, in order: its bench's `--plan` output, or the fixed descriptions it names."""
    rows: list[str] = []
    for item in step.plan:
        if not item.startswith("bench:"):
            rows.append(item)
            continue
        script, _, args = item[len("bench:") :].partition(" ")
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                rc = _bench_main(script)([*shlex.split(args), "--plan"])
        except SystemExit as exc:  # argparse's exit: the plan is wrong, say so instead of hiding the step
            rc = exc.code
        lines = [ln for ln in buf.getvalue().splitlines() if ln.count(",") >= 1 and not ln.startswith("bench ")]
        rows += lines if rc in (0, None) else [f"(no plan: {script} --plan exited {rc})"]
    return rows


def print_stage(stage: Stage, smoke_too: bool = True) -> int:
    """The dry run of one call: steps, budgets, files, and the GPU run's rows in order."""
    for label, steps in (("GPU", stage.gpu_steps), ("--cpu-smoke", stage.smoke_steps))[: 2 if smoke_too else 1]:
        print(f"{stage.name} ({label}): {stage.title}")
        for i, s in enumerate(steps, 1):
            print(f"  {i}. {s.name:<16} budget {s.budget_s:>4} s  writes {', '.join(s.files) or '-'}")
            print(f"     $ {s.cmd}")
        files = stage.files(steps)
        total = sum(s.budget_s for s in steps)
        bound = f" (under {CALL_BUDGET_S // 60} min)" if label == "GPU" else " (no lease to fit: CI's time)"
        print(f"  budget: {total} s = {total / 60:.1f} min{bound}")
        print(f"  files: {len(files)} (limit {MAX_FILES}): {', '.join(files)}")
    print(f"{stage.name}: rows in the order the GPU run takes them")
    n = 0
    for s in stage.gpu_steps:
        for row in step_rows(s):
            n += 1
            print(f"  row {n:>3}  [{s.name}] {row}")
    return 0
