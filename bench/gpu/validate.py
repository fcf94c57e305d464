"""The whole GPU validation in two device-tool commands, sized for one lease: `--dry-run` prints both commands (as the
device tool's `run` takes them), what each call runs for a machine start of 1, 2, 3 and 4 minutes (each call taking
its deadline from the time it actually starts: bench/gpu/_lease.py), every CSV row in the order it will be taken, and
the graded row of each path (loss, log-probs, retrieval, splice) that call 1 alone brings back. `--command N` prints
call N's command for a run asked now; `--cpu-smoke DIR` runs both calls end to end on the CPU at tiny shapes (into
DIR/call1_headline, DIR/call2_anchors).

Usage: `python bench/gpu/validate.py --dry-run [--budget-left S] | --command {1,2} --budget-left S | --cpu-smoke DIR`.
The GPU commands themselves are the calls (docs/gpu_validation.md). What this is not: a runner of its own (each call is
bench/gpu/call*.py) nor the device tool's accounting (its `status` is the truth; the model here is the worst case).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import call1_headline as call1  # noqa: E402
import call2_anchors as call2  # noqa: E402
from _lease import BACK_S, IDLE_S, LEASE_S, OUT_S, STARTS_S, as_carried, model  # noqa: E402
from _plan import step_rows  # noqa: E402
from _stage import CALL_BUDGET_S, GRACE_S, HERE  # noqa: E402
from _steps import EXT_CARRIED_S  # noqa: E402

CALLS = (call1.STAGE, call2.STAGE)
CALL2_STEPS = as_carried(call2.STAGE.gpu_steps)  # call 2 as the procedure runs it: call 1's .so carried
TOOL_MARGIN_S = 60  # a call's timeout_s exceeds its longest deadline by this, so its files come back before the limit
# The graded path -> the row that grades it (docs/perf.md's summary, "graded by"); call 1 must bring each back alone.
GRADED = {
    "loss": "loss,rapo_fast_hidden,N=16384,H=4096,V=152064",
    "log-probs": "token_logprobs,rapo_fast_logits,N=16384,H=4096,V=152064,mode=fwd+bwd",
    "retrieval": "retrieval,ours,C=170000,D=384,Q=256,k=1",
    "splice": "kv_splice,rapo_fast,shape=gpu",
}


def command(n: int, budget_left_s: int, asked_at: float | None = None) -> str:
    """Call n's device-tool command for a run asked at `asked_at` (now by default) with `budget_left_s` left."""
    stage = CALLS[n - 1]
    t = int(time.time() if asked_at is None else asked_at)
    cmd = f"python3 bench/gpu/{stage.name}.py --out $OUT --asked-at {t} --lease-left {budget_left_s}"
    return f'run(command={cmd!r}, carry=[".carry"], timeout_s={CALL_BUDGET_S + TOOL_MARGIN_S})'


def _steps_table(steps, runs: list[list[bool]], n0: int) -> int:
    """Each step with its budget, whether it runs at each modelled start (x) or is skipped (-), and its rows."""
    n = n0
    for i, s in enumerate(steps):
        marks = "  ".join(f"{'x' if r[i] else '-':>2}" for r in runs)
        print(f"  step {s.name:<16} {s.budget_s:>4} s  {marks}")
        for row in step_rows(s):
            n += 1
            print(f"      row {n:>3}  {row}")
    return n


def dry_run(budget_left_s: int = LEASE_S) -> int:
    c1_steps = call1.STAGE.gpu_steps
    runs = {s: model(c1_steps, CALL2_STEPS, call1.STAGE.keep, s, budget_left_s) for s in STARTS_S}
    rows = {id(s): len(step_rows(s)) for s in c1_steps + CALL2_STEPS}
    print(f"GPU validation in {budget_left_s} s of device time: two device-tool commands. Here first: bash")
    print(
        "tools/fetch_gpu_wheels.sh; between the two, copy call 1's _C.cpython-312-x86_64-linux-gnu.so into .carry/ext/"
    )
    print(f"(call 2's extension step then takes {EXT_CARRIED_S} s of budget, not a build's). Each call is given the")
    print("time it was asked for and the lease left then, and takes its deadline from the time it actually starts.")
    print(f"Each step stops at its budget (SIGINT, then SIGKILL {GRACE_S} s later) and keeps every row it finished; a")
    print("step that cannot finish before its call's deadline is skipped and recorded as such.\n")
    print(f"command 1 (asked now): {command(1, budget_left_s)}")
    print(f"command 2: {command(2, 0).replace('--lease-left 0', '--lease-left B2')}")
    print("  with T2 from `date +%s` and B2 from status's budget_left_s, both just before the run: `python")
    print("  bench/gpu/validate.py --command 2 --budget-left B2` prints it.\n")
    print(f"Yield by machine start (worst case: every step takes its whole budget; {OUT_S} s out and {BACK_S} s back a")
    print(f"call; call 2 asked after the {IDLE_S}-s idle wait, on a cold machine again):")
    print("  start | call 1: deadline, steps, rows | call 2: asked at, deadline, steps, rows, past build | ends at")
    for start, (c1, c2) in runs.items():
        r1 = sum(rows[id(s)] for s, ok in c1.ran if ok)
        r2 = sum(rows[id(s)] for s, ok in c2.ran if ok)
        n1, n2 = sum(ok for _, ok in c1.ran), sum(ok for _, ok in c2.ran)
        past = any(ok for s, ok in c2.ran[[s.name for s, _ in c2.ran].index("extension") + 1 :])
        print(
            f"  {start:>3} s | {c1.deadline:>3} s, {n1:>2} of {len(c1.ran)}, {r1:>2} rows"
            f" | {c2.asked:>3} s, {c2.deadline:>3} s, {n2} of {len(c2.ran)}, {r2:>2} rows, {'yes' if past else 'no':>3}"
            f" | {c2.end} s of {budget_left_s} s"
        )
    print(f"\nSteps by start ({', '.join(f'{s // 60} min' for s in STARTS_S)}: x runs, - skipped), rows in order:")
    print(f"call 1, {call1.STAGE.name}: {sum(s.budget_s for s in c1_steps)} s of budgets, files: ", end="")
    print(", ".join(call1.STAGE.files(c1_steps)))
    n = _steps_table(c1_steps, [[ok for _, ok in runs[s][0].ran] for s in STARTS_S], 0)
    print(f"call 2, {call2.STAGE.name}: {sum(s.budget_s for s in CALL2_STEPS)} s of budgets, files: ", end="")
    print(", ".join(call2.STAGE.files(CALL2_STEPS)))
    _steps_table(CALL2_STEPS, [[ok for _, ok in runs[s][1].ran] for s in STARTS_S], n)
    print("\nGraded rows call 1 brings back alone:")
    rows1 = [r for s in c1_steps for r in step_rows(s)]
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
    g.add_argument("--dry-run", action="store_true", help="print the two commands, the yield by start and the rows")
    g.add_argument("--command", type=int, choices=(1, 2), help="print call N's command for a run asked now")
    g.add_argument("--cpu-smoke", type=Path, metavar="DIR", help="run both calls on the CPU at tiny shapes")
    p.add_argument(
        "--budget-left",
        type=int,
        default=LEASE_S,
        metavar="S",
        help=f"device time left, from the device tool's status (default {LEASE_S}: a whole lease)",
    )
    args = p.parse_args(argv)
    if args.command:
        print(command(args.command, args.budget_left))
        return 0
    return dry_run(args.budget_left) if args.dry_run else cpu_smoke(args.cpu_smoke)


if __name__ == "__main__":
    raise SystemExit(main())
