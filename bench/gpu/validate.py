"""The whole GPU validation in two device-tool commands, sized for one lease: `--dry-run` prints both commands (as the
device tool's `run` takes them) with their deadlines, the lease arithmetic (two machine starts, transfers, each call's
budgets), which of call 2's steps fit the time left, every CSV row in the order it will be taken, and the graded row of
each path (loss, log-probs, retrieval, splice) that call 1 alone brings back. `--cpu-smoke DIR` runs both calls end
to end on the CPU at tiny shapes (into DIR/call1_headline, DIR/call2_anchors).

Usage: `python bench/gpu/validate.py --dry-run [--budget-left S] | --cpu-smoke DIR`. The GPU commands themselves are
the calls (docs/gpu_validation.md). What this is not: a runner of its own (each call is bench/gpu/call*.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import call1_headline as call1  # noqa: E402
import call2_anchors as call2  # noqa: E402
from _plan import step_rows  # noqa: E402
from _stage import CALL_BUDGET_S, GRACE_S, HERE, Step  # noqa: E402
from _steps import EXT_CARRIED_S  # noqa: E402

CALLS = (call1.STAGE, call2.STAGE)
# Call 2 as the procedure runs it: with call 1's .so carried (its extension budget then follows, _steps.extension).
CALL2_STEPS = [
    Step(s.name, s.cmd, EXT_CARRIED_S, s.files, s.required, s.plan) if s.name == "extension" else s
    for s in call2.STAGE.gpu_steps
]
LEASE_S = 900  # a drawn task's device time, starts, idle waits and transfers included
START_S = 90  # a cold machine's start, assumed for each call ("a minute or more"; a failed start costs 1-2 minutes)
TRANSFER_S = 30  # the working tree (with .carry, < 64 MiB) out and the files back, per call
TOOL_MARGIN_S = 60  # a call's timeout_s exceeds its deadline by this, so its files come back before the tool's limit
# The graded path -> the row that grades it (docs/perf.md's summary, "graded by"); call 1 must bring each back alone.
GRADED = {
    "loss": "loss,rapo_fast_hidden,N=16384,H=4096,V=152064",
    "log-probs": "token_logprobs,rapo_fast_logits,N=16384,H=4096,V=152064,mode=fwd+bwd",
    "retrieval": "retrieval,ours,C=170000,D=384,Q=256,k=1",
    "splice": "kv_splice,rapo_fast,shape=gpu",
}


def fits(steps: list[Step], deadline_s: float) -> list[tuple[Step, bool]]:
    """The runner's deadline rule applied to budgets (each step taking all of its budget: the worst case): a step
    starts only when its budget and the grace end before the deadline; a skipped step takes no time."""
    used, out = 0.0, []
    for s in steps:
        ok = used + s.budget_s + GRACE_S <= deadline_s
        used += s.budget_s if ok else 0
        out.append((s, ok))
    return out


def deadlines(budget_left_s: int) -> tuple[int, int, int]:
    """(call 1's deadline, call 1's worst-case device time, call 2's nominal deadline) from the lease left now. Call 1
    keeps what call 2 needs for its most valuable steps (wheels, extension, the Liger/CCE anchors)."""
    call2_min = sum(s.budget_s for s in CALL2_STEPS[:3]) + GRACE_S
    d1 = min(CALL_BUDGET_S, budget_left_s - 2 * (START_S + TRANSFER_S) - call2_min)
    used1 = START_S + TRANSFER_S + min(d1, sum(s.budget_s for s in call1.STAGE.gpu_steps))
    return d1, used1, budget_left_s - used1 - START_S - TRANSFER_S


def dry_run(budget_left_s: int = LEASE_S) -> int:
    d1, used1, d2 = deadlines(budget_left_s)
    print(f"GPU validation in {budget_left_s} s of device time: two device-tool commands. Here first: bash")
    print(
        "tools/fetch_gpu_wheels.sh; between the two, copy call 1's _C.cpython-312-x86_64-linux-gnu.so into .carry/ext/"
    )
    print(f"(call 2's extension step then takes {EXT_CARRIED_S} s of budget, not a build's).")
    print(f"Each step stops at its budget (SIGINT, then SIGKILL {GRACE_S} s later) and keeps every row it finished; a")
    print("step that cannot finish before its call's --deadline-s is skipped and recorded as such.\n")
    print("Lease arithmetic (worst case: every step takes its whole budget; each call starts a cold machine,")
    print(f"{START_S} s; {TRANSFER_S} s of transfers per call):")
    b1 = sum(s.budget_s for s in call1.STAGE.gpu_steps)
    print(f"  call 1: start {START_S} + transfers {TRANSFER_S} + steps {b1} (deadline {d1}) = {used1} s")
    print(f"  call 2: start {START_S} + transfers {TRANSFER_S} + deadline {d2} = {START_S + TRANSFER_S + d2} s")
    print(f"  total: {used1 + START_S + TRANSFER_S + d2} s of {budget_left_s} s")
    print(
        f"  call 2's deadline, from status after call 1: budget_left_s - {TRANSFER_S} - {START_S} (the {START_S} only"
    )
    print(f"  when status says warm: false), here {d2} s cold and {d2 + START_S} s warm.\n")
    n = 0
    for i, (stage, steps, deadline) in enumerate(zip(CALLS, (call1.STAGE.gpu_steps, CALL2_STEPS), (d1, d2)), 1):
        cmd = f"python3 bench/gpu/{stage.name}.py --out $OUT --deadline-s {deadline if i == 1 else 'D2'}"
        timeout = deadline + TOOL_MARGIN_S if i == 1 else f"D2 + {TOOL_MARGIN_S}"
        print(f'command {i}: run(command={cmd!r}, carry=[".carry"], timeout_s={timeout})')
        total = sum(s.budget_s for s in steps)
        print(f"  budgets {total} s = {total / 60:.1f} min (under {CALL_BUDGET_S // 60} min), files: ", end="")
        print(", ".join(stage.files(stage.gpu_steps)))
        cold, warm = fits(steps, deadline), fits(steps, deadline + (START_S if i == 2 else 0))
        for (s, ok), (_, ok_warm) in zip(cold, warm):
            fit = "runs" if ok else ("runs if warm" if ok_warm else "skipped unless steps end early")
            print(f"  step {s.name:<16} {s.budget_s:>4} s  {fit if i == 2 else ('runs' if ok else 'skipped')}")
            for row in step_rows(s):
                n += 1
                print(f"      row {n:>3}  {row}")
    print("\nGraded rows call 1 brings back alone:")
    rows1 = [r for s in call1.STAGE.gpu_steps for r in step_rows(s)]
    missing = []
    for path, row in GRADED.items():
        hit = next((r for r in rows1 if r.startswith(row)), None)
        print(f"  {path:<10} {hit or 'MISSING'}")
        missing += [path] if hit is None else []
    return 1 if missing else 0


def cpu_smoke(out: Path) -> int:
    rc = 0
    for stage in CALLS:
        res = subprocess.run([sys.executable, str(HERE / f"{stage.name}.py"), "--cpu-smoke", str(out / stage.name)])
        rc = rc or res.returncode
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu/validate.py", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--dry-run", action="store_true", help="print the two commands, the lease arithmetic and the rows")
    g.add_argument("--cpu-smoke", type=Path, metavar="DIR", help="run both calls on the CPU at tiny shapes")
    p.add_argument(
        "--budget-left",
        type=int,
        default=LEASE_S,
        metavar="S",
        help=f"device time left, from the device tool's status (default {LEASE_S}: a whole lease)",
    )
    args = p.parse_args(argv)
    return dry_run(args.budget_left) if args.dry_run else cpu_smoke(args.cpu_smoke)


if __name__ == "__main__":
    raise SystemExit(main())
