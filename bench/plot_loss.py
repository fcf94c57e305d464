"""Plot bench/results/loss.csv (written by bench_loss.py): forward+backward median time and peak memory per provider.

One panel per (device, dtype) and metric; x = shape "N x H x V". Usage: `python bench/plot_loss.py [CSV] [PNG]`.
Not a benchmark: it only reads the CSV (the latest row per provider, shape and device wins).
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = Path(argv[0]) if argv else Path(__file__).parent / "results" / "loss.csv"
    dst = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".png")
    latest: dict[tuple, dict] = {}
    for r in csv.DictReader(src.open()):
        if r.get("status") != "ok":
            continue
        latest[(r["device"], r["dtype"], r["provider"], int(r["N"]), int(r["H"]), int(r["V"]))] = r
    groups = sorted({(k[0], k[1]) for k in latest})
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.6 * len(groups)), squeeze=False)
    for (device, dtype), row_axes in zip(groups, axes):
        keys = [k for k in latest if k[:2] == (device, dtype)]
        shapes = sorted({k[3:] for k in keys})
        providers = sorted({k[2] for k in keys})
        width = 0.8 / max(len(providers), 1)
        for metric, ax in zip(("median_ms", "peak_mem_mb"), row_axes):
            for i, p in enumerate(providers):
                vals = []
                for s in shapes:
                    r = latest.get((device, dtype, p, *s))
                    vals.append(float(r[metric]) if r and r.get(metric) not in (None, "") else math.nan)
                ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=p)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
            ax.set_xticklabels([f"{n}x{h}x{v}" for n, h, v in shapes], fontsize=8)
            ax.set_ylabel(metric)
            ax.set_title(f"{device[:40]} {dtype}: {metric} (fwd+bwd)", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
