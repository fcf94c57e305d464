"""Plot a KV splice bench CSV (bench/bench_kv_splice.py, `rapo-fast bench kv`): median time per provider (horizontal
bars on a log scale, with the 20-80% quantiles as error bars), lower is better, each bar labelled with its time over
rapo_fast's (the CSV's `time_over_rapo_fast`).

One panel per run (device, shape, commit and day: rows of different runs are never mixed), the latest row of a
provider within a run winning. Colours are those of every bench plot (bench/_plot_style.py). Usage:
`python bench/plot_kv.py [CSV] [PNG]` (default bench/results/kv_splice.csv, PNG next to it). What this is not: a
benchmark; it only reads the CSV.
"""

from __future__ import annotations

from pathlib import Path

import _plot_style as ps

RATIO = "time_over_rapo_fast"  # this row's median_ms / rapo_fast's median_ms in the same run


def plot(src: Path, dst: Path, note: str = "") -> Path:
    """Draw `src` (a kv_splice CSV) into `dst`; `note` is added to the title (a smoke run says so)."""
    plt = ps.pyplot()
    runs: dict[tuple, dict[str, dict]] = {}
    for r in ps.measured_rows(src):
        key = (r.get("device", "")[:48], r.get("shape_desc", ""), ps.run_of(r))
        runs.setdefault(key, {})[r["provider"]] = r
    if not runs:
        raise SystemExit(f"{src}: no measured rows to plot")
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.3 * len(runs) + 0.8), squeeze=False)
    for (run, rows), ax in zip(runs.items(), axes[:, 0]):
        names = list(rows)[::-1]  # the bench's order, top to bottom
        vals = [ps.num(rows[n], "median_ms") for n in names]
        lo = [max(0.0, v - ps.num(rows[n], "p20_ms")) for v, n in zip(vals, names)]
        hi = [max(0.0, ps.num(rows[n], "p80_ms") - v) for v, n in zip(vals, names)]
        ax.barh(names, vals, xerr=[lo, hi], capsize=2, color=[ps.color(n) for n in names])
        for y, n in enumerate(names):
            ratio = rows[n].get(RATIO) or rows[n].get("ours_speedup")  # older CSVs: the same value, older name
            if ratio:
                ax.annotate(f"{ratio}x rapo_fast's time", ((vals[y] + hi[y]) * 1.15, y), va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(ps.label("median ms per splice, log scale", ps.LOWER), fontsize=8)
        ax.set_title(", ".join(run), fontsize=8)
        ax.set_xlim(right=max(vals) * 30)
    fig.suptitle("KV splice vs other ways" + (f" — {note}" if note else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)
    return Path(dst)


def main(argv: list[str] | None = None) -> int:
    return ps.plot_main(argv, __doc__, "kv_splice.csv", plot)


if __name__ == "__main__":
    raise SystemExit(main())
