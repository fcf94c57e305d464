"""Plot bench/results/retrieval_{cpu,gpu}.csv: queries/s per provider at every shape of the latest run (one bar group
per (C, D, Q, k, threads)), log scale, written next to the CSV as retrieval_{cpu,gpu}.png.

Usage: `python bench/plot_retrieval.py [CSV ...]`. What this is not: the benchmark (bench/bench_retrieval.py).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def plot(csv_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(csv_path.open()))
    if not rows:
        raise SystemExit(f"{csv_path}: no rows")
    # Latest row of each (shape, threads, provider): reruns replace older measurements in the plot.
    latest: dict[tuple, dict] = {}
    for r in rows:
        shape = (int(r["C"]), int(r["D"]), int(r["Q"]), int(r["k"]), r.get("threads", ""))
        latest[(shape, r["provider"])] = r
    shapes = sorted({s for s, _ in latest})
    providers = sorted({p for _, p in latest})
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(shapes)), 5))
    width = 0.8 / len(providers)
    for i, prov in enumerate(providers):
        xs, ys = [], []
        for j, s in enumerate(shapes):
            r = latest.get((s, prov))
            if r is not None and r.get("qps"):
                xs.append(j + i * width)
                ys.append(float(r["qps"]))
        ax.bar(xs, ys, width=width, label=prov)
    labels = [f"C={c // 1000}k D={d}\nQ={q} k={k}" + (f"\n{t} thr" if t else "") for c, d, q, k, t in shapes]
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("queries / s (median)")
    device = rows[-1].get("device", "")
    ax.set_title(f"exact top-k retrieval, {csv_path.stem} — {device[:60]}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = csv_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or [
        p for p in (RESULTS / "retrieval_cpu.csv", RESULTS / "retrieval_gpu.csv") if p.exists()
    ]
    for p in paths:
        print(f"wrote {plot(p)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
