"""Summarise a short trainer run (the demo's metrics_<method>.csv, one row per RL step) as one row per method:
tokens/s, seconds per step and the split of step time by phase (the trainer's t_* metrics, rapo_fast/train/trainer.py),
plus device, date and commit. The first step is left out when there are more (it pays Triton/CUDA warm-up).

Usage: `python bench/gpu/trainer_split.py DEMO_DIR OUT.csv`. What this is not: a profiler (the phases are the
trainer's own wall-clock timers around each stage, synchronised by the .item() calls between them).
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import append_rows, commit, device_name, now  # noqa: E402

PHASES = ("rollout", "retrieval", "splice", "logprob", "loss", "optimizer", "buffer")


def summarise(rows: list[dict]) -> dict:
    timed = rows[1:] if len(rows) > 1 else rows
    total = sum(float(r["t_step"]) for r in timed)
    out = {
        "steps": len(rows),
        "steps_timed": len(timed),
        "tokens_per_s": round(statistics.mean(float(r["tokens_per_s"]) for r in timed), 1),
        "t_step_s": round(total / len(timed), 4),
    }
    for ph in PHASES:
        secs = sum(float(r.get(f"t_{ph}") or 0.0) for r in timed)
        out[f"pct_{ph}"] = round(100 * secs / total, 1) if total > 0 else ""
    other = 100 - sum(v for k, v in out.items() if k.startswith("pct_") and v != "")
    out["pct_other"] = round(other, 1)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: trainer_split.py DEMO_DIR OUT.csv", file=sys.stderr)
        return 2
    import torch

    demo, out = Path(argv[0]), Path(argv[1])
    dev = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for path in sorted(demo.glob("metrics_*.csv")):
        with path.open() as f:
            steps = list(csv.DictReader(f))
        if steps:
            rows.append({"method": path.stem.removeprefix("metrics_"), **summarise(steps)})
    if not rows:
        print(f"trainer_split: no metrics_*.csv with rows in {demo}", file=sys.stderr)
        return 1
    meta = {"device": dev, "date": now(), "commit": commit()}
    out.unlink(missing_ok=True)
    append_rows(out.stem, [{**r, **meta} for r in rows], out.parent)
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
