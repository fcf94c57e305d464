"""One compute-sanitizer tool (memcheck or racecheck) over the small cases of every kernel (sanitizer_cases.py), as
a step of the GPU run: one row appended to sanitizer.csv with the tool, the cases, the sanitizer's error count and
whether each case ran, plus device, date and commit.

memcheck runs with PYTORCH_NO_CUDA_MEMORY_CACHING=1: with torch's caching allocator an overrun inside a pooled block
is invisible to it. No kernel-name filter: the cases are small, so instrumenting torch's own kernels costs little,
and a wrong filter syntax would silently check nothing. `--cpu` (the smoke run) runs the cases on the CPU without a
sanitizer and says so in the row. What this is not: the CUDA tests (pytest -m gpu grade the numbers).
Usage: `python bench/gpu/sanitize.py --tool memcheck --out DIR [--cpu]`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import append_rows, commit, now  # noqa: E402

ROOT = HERE.parents[1]


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (str(p) for p in Path("/usr/local").glob("cuda*/bin/compute-sanitizer") if p.is_file()), None
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tool", required=True, choices=["memcheck", "racecheck"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cpu", action="store_true", help="smoke mode: the cases on the CPU, no sanitizer")
    args = p.parse_args(argv)
    cases = [sys.executable, str(HERE / "sanitizer_cases.py"), "--device", "cpu" if args.cpu else "cuda"]
    tool = None if args.cpu else _sanitizer()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tool is not None:
        cmd = [tool, "--tool", args.tool, "--error-exitcode", "86", "--print-limit", "30", *cases]
        if args.tool == "memcheck":
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    else:
        cmd = cases
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    row = {"tool": args.tool, "status": "interrupted: step budget", "device": "", "date": now(), "commit": commit()}
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    except KeyboardInterrupt:  # the step's budget ran out: say so in the CSV, as the benches do
        append_rows("sanitizer", [row], args.out)
        return 130
    text = res.stdout + res.stderr
    print(text[-20000:], flush=True)
    ok = re.findall(r"^case (\S+) ok", text, re.M)
    failed = re.findall(r"^case (\S+) FAILED", text, re.M)
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    row.update(
        cases_ok=len(ok),
        cases_failed=";".join(failed),
        errors=errors[-1] if errors else "",
        rc=res.returncode,
        seconds=round(time.perf_counter() - t0, 1),
    )
    if tool is None:
        why = "smoke run on the cpu" if args.cpu else "compute-sanitizer not found"
        row["status"] = f"skipped: {why} (cases {'ok' if res.returncode == 0 else 'FAILED'})"
        row["device"] = "cpu (no sanitizer)"
    else:
        clean = res.returncode == 0 and errors and int(errors[-1]) == 0 and not failed
        row["status"] = "ok" if clean else f"FAILED rc={res.returncode}"
        row["device"] = _gpu_name()
    print(f"rows appended to {append_rows('sanitizer', [row], args.out)}: {row}")
    return 0 if row["status"] == "ok" or row["status"].startswith("skipped: smoke") else 1


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # the row still says which tool ran; the call's summary names the device too
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
