"""`--record DIR` of a GPU stage: append the rows of the stage's CSVs found in DIR (a GPU run's output, as the device
tool brought it back) to bench/results/<name>.csv (loss_gpu.csv, retrieval_gpu.csv, ...), each row carrying device,
date and commit. Refuses a smoke run's folder (its summary says mode: cpu-smoke) and rows measured on no GPU.

Rows whose commit is "unknown" (the GPU machine gets the working tree without .git) take `--commit`, by default this
checkout's HEAD (with -dirty when it has changes): the tree the device tool sent. What this is not: a plotter
(bench/plot_*.py) nor a merger of runs (rows are appended; a rerun appends again).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import append_rows, commit  # noqa: E402

CPU_HINTS = ("cores, torch threads", "cpu")


def _summary(folder: Path, stage) -> dict:
    path = folder / f"{stage.name}_summary.txt"
    if not path.exists():
        raise SystemExit(f"record: {path} not found: is {folder} the output folder of {stage.name}?")
    head = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition(": ")
        if sep and key in ("mode", "date", "commit", "device"):
            head[key] = value.strip()
    return head


def record(stage, folder: Path, results: Path, sha: str | None) -> int:
    head = _summary(Path(folder), stage)
    if head.get("mode") != "gpu":
        raise SystemExit(f"record: {folder} holds a {head.get('mode', 'unknown')} run, not a GPU run; nothing recorded")
    sha = sha or commit()
    n_total = 0
    for name, target in stage.record.items():
        path = Path(folder) / name
        if not path.exists():
            print(f"record: {name} missing in {folder}, skipped")
            continue
        with path.open() as f:
            rows = list(csv.DictReader(f))
        for r in rows:
            if r.get("commit") in (None, "", "unknown"):
                r["commit"] = sha
            r.setdefault("device", head.get("device", ""))
            r["device"] = r["device"] or head.get("device", "")
            r["date"] = r.get("date") or head.get("date", "")
            if any(h in r["device"].lower() for h in CPU_HINTS) or not r["device"]:
                raise SystemExit(f"record: a row of {name} was measured on {r['device']!r}, not a GPU")
        out = append_rows(target, rows, Path(results))
        print(f"record: {len(rows)} rows of {name} appended to {out}")
        n_total += len(rows)
    return 0 if n_total else 1
