"""The whole GPU validation in two device-tool commands: `--dry-run` prints both commands (as the device tool's `run`
takes them), each call's total budget (under 9 minutes), its files, and every CSV row in the order it will be taken;
`--cpu-smoke DIR` runs both calls end to end on the CPU at tiny shapes (into DIR/call1, DIR/call2).

Usage: `python bench/gpu/validate.py --dry-run | --cpu-smoke DIR`. The GPU commands themselves are the calls
(docs/gpu_validation.md). What this is not: a runner of its own (each call is bench/gpu/call*.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import call1_build_test_loss as call1  # noqa: E402
import call2_retrieval_kv_train as call2  # noqa: E402
from _plan import step_rows  # noqa: E402
from _stage import CALL_BUDGET_S, HERE  # noqa: E402

CALLS = (call1.STAGE, call2.STAGE)
CARRY = {call1.STAGE.name: '[".carry"]', call2.STAGE.name: '[".carry"]'}


def dry_run() -> int:
    print("GPU validation: two device-tool commands (bash tools/fetch_gpu_wheels.sh here first; between the two, copy")
    print("call 1's _C.cpython-312-x86_64-linux-gnu.so into .carry/ext/ here). Each step stops at its budget (SIGINT,")
    print("then SIGKILL 15 s later) and keeps every row it finished.\n")
    n = 0
    for i, stage in enumerate(CALLS, 1):
        total = sum(s.budget_s for s in stage.gpu_steps)
        cmd = f"python3 bench/gpu/{stage.name}.py --out $OUT"
        print(f"command {i}: run(command={cmd!r}, carry={CARRY[stage.name]}, timeout_s=600)")
        print(
            f"  total budget {total} s = {total / 60:.1f} min (under {CALL_BUDGET_S // 60} min), files: "
            + ", ".join(stage.files(stage.gpu_steps))
        )
        for s in stage.gpu_steps:
            print(f"  step {s.name:<16} {s.budget_s:>4} s")
            for row in step_rows(s):
                n += 1
                print(f"      row {n:>3}  {row}")
    return 0


def cpu_smoke(out: Path) -> int:
    rc = 0
    for stage in CALLS:
        res = subprocess.run([sys.executable, str(HERE / f"{stage.name}.py"), "--cpu-smoke", str(out / stage.name)])
        rc = rc or res.returncode
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu/validate.py", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--dry-run", action="store_true", help="print the two commands, budgets and rows in order")
    g.add_argument("--cpu-smoke", type=Path, metavar="DIR", help="run both calls on the CPU at tiny shapes")
    args = p.parse_args(argv)
    return dry_run() if args.dry_run else cpu_smoke(args.cpu_smoke)


if __name__ == "__main__":
    raise SystemExit(main())
