"""The look shared by every bench plot (bench/plot_*.py): one colour per provider name across all plots, axis labels
that say which direction is better, the reading of a bench CSV into the rows a plot draws, the time-and-memory
figure of the loss and log-prob benches, and the call that draws a bench's PNG next to its CSV at the end of a run.

Colours: rapo_fast's own providers are reds and oranges (the headline of each bench, `rapo_fast_hidden`, `ours` and
`rapo_fast`, the same red), plain PyTorch blues and purples, other libraries greens and browns, floors grey. A name
not listed gets a fixed colour of its own (from its CRC32), so it is still the same in every plot.
What this is not: a plotting script (those are bench/plot_*.py) nor a bench.
"""

from __future__ import annotations

import argparse
import csv
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

COLORS = {
    # rapo_fast: the headline provider of each bench is the same red
    "rapo_fast_hidden": "#d62728",
    "ours": "#d62728",
    "rapo_fast": "#d62728",
    "rapo_fast_hidden_2pass": "#ff9896",
    "ours_excl": "#ff9896",
    "rapo_fast_logits": "#ff7f0e",
    "ours_fp16": "#ff7f0e",
    "rapo_fast_logits_lmhead": "#ffbb78",
    "ours_faiss_mem": "#ffbb78",
    "rapo_fast_logits_lmhead_inplace": "#e377c2",
    "ours_triton": "#e377c2",
    "ours_cuda": "#f7b6d2",
    # plain PyTorch
    "torch_eager": "#1f77b4",
    "torch_eager_logits": "#1f77b4",
    "torch": "#1f77b4",
    "torch_plain": "#1f77b4",
    "torch_eager_hidden": "#aec7e8",
    "torch_compile": "#17becf",
    "torch_linear_ce": "#9467bd",
    "torch_chunked_hidden": "#9467bd",  # the same op as torch_linear_ce: torch's chunked F.linear_cross_entropy
    # other libraries and other ways
    "liger": "#2ca02c",
    "cce": "#8c564b",
    "faiss_flat": "#bcbd22",
    "reprefill": "#98df8a",
    # floors
    "floor": "#7f7f7f",
    "copy_floor": "#7f7f7f",
}
_FALLBACK = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a"]

LOWER = "lower is better"
HIGHER = "higher is better"
SMOKE = "smoke run (--quick): the times mean nothing"


def color(provider: str) -> str:
    """The colour of `provider` in every plot."""
    return COLORS.get(provider) or _FALLBACK[zlib.crc32(provider.encode()) % len(_FALLBACK)]


def label(what: str, better: str) -> str:
    """An axis label that says which way is better, e.g. "median ms, fwd+bwd (lower is better)"."""
    return f"{what} ({better})"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def measured_rows(csv_path: Path) -> list[dict]:
    """The rows of a bench CSV that carry a measurement: status "ok..." (or "DISAGREES...", drawn so that a wrong
    provider is seen), or no status at all (rows written before the benches had a status column)."""
    with Path(csv_path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if str(r.get("status") or "ok").startswith(("ok", "DISAGREES"))]


def num(row: dict | None, key: str) -> float:
    """row[key] as a float, NaN where the row or the value is missing."""
    try:
        return float(row[key]) if row is not None else float("nan")
    except (KeyError, TypeError, ValueError):
        return float("nan")


def run_of(row: dict) -> str:
    """The run a row belongs to, for one panel per run: its commit and the day it was measured."""
    return f"commit {row.get('commit', '?')}, {str(row.get('date', ''))[:10]}"


def draw_after_run(plot: Callable[..., Path], csv_path: Path, png_path: Path, quick: bool) -> Path | None:
    """The bench's PNG drawn from its CSV at the end of a run (a smoke run's title says so); a plot that fails (no
    matplotlib) is a note on stderr, not a failed run: the CSV is the result."""
    if not Path(csv_path).exists():
        return None
    try:
        out = plot(Path(csv_path), Path(png_path), note=SMOKE if quick else "")
    except (Exception, KeyboardInterrupt) as exc:  # the rows are written; a missing plotting library loses none
        print(f"plot not drawn ({exc!r}); the rows are in {csv_path}", file=sys.stderr)
        return None
    print(f"plot written to {out}")
    return out


def figure_legend(fig, providers: list[str], title: str) -> None:
    """The title, then one legend for the whole figure (every provider once, in bench order) above the panels, so that
    no legend hides a bar; then the panels' layout below them."""
    plt = pyplot()
    handles = [plt.Rectangle((0, 0), 1, 1, color=color(p)) for p in providers]
    inch = 1.0 / fig.get_figheight()
    fig.suptitle(title, fontsize=10, y=1.0 - 0.05 * inch)
    fig.legend(
        handles,
        providers,
        loc="upper center",
        ncol=min(len(providers), 6),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 1.0 - 0.3 * inch),
    )
    rows = -(-len(providers) // 6)
    fig.tight_layout(rect=(0, 0, 1, 1.0 - (0.45 + 0.22 * rows) * inch))


def _bars(ax, latest: dict, group: tuple, shapes: list, providers: list, metric: str) -> None:
    """Grouped bars: one group per shape, one bar per provider; time bars carry their 20-80% quantiles."""
    width = 0.8 / max(len(providers), 1)
    for i, p in enumerate(providers):
        rows = [latest.get((group, p, s)) for s in shapes]
        vals = [num(r, metric) for r in rows]
        err = None
        if metric == "median_ms":
            lo = [v - num(r, "p20_ms") for v, r in zip(vals, rows)]
            hi = [num(r, "p80_ms") - v for v, r in zip(vals, rows)]
            err = [[x if x == x and x > 0 else 0.0 for x in side] for side in (lo, hi)]
        xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(shapes))]
        ax.bar(xs, vals, width, yerr=err, capsize=2, color=color(p), label=p)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{n} x {h} x {v}" for n, h, v in shapes], fontsize=8)
    ax.set_xlabel("shape N x H x V (tokens x hidden x vocabulary)", fontsize=8)


def time_and_memory(src: Path, dst: Path, group_of: Callable[[dict], tuple], title: str, time_label: str) -> Path:
    """One row of panels per group (group_of(row): a tuple of strings naming a run, e.g. device, dtype, commit):
    median time with its 20-80% quantiles, and peak memory, per provider (bench order) and shape N x H x V; the
    latest row of a provider at a shape within a group wins. Both axes say lower is better."""
    plt = pyplot()
    latest: dict[tuple, dict] = {}
    providers: list[str] = []
    for r in measured_rows(src):
        latest[(group_of(r), r["provider"], (int(r["N"]), int(r["H"]), int(r["V"])))] = r
        providers += [] if r["provider"] in providers else [r["provider"]]
    groups = list(dict.fromkeys(k[0] for k in latest))
    if not groups:
        raise SystemExit(f"{src}: no measured rows to plot")
    metrics = (("median_ms", label(time_label, LOWER)), ("peak_mem_mb", label("peak memory, MiB", LOWER)))
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 3.8 * len(groups) + 0.7), squeeze=False)
    for group, row_axes in zip(groups, axes):
        keys = [k for k in latest if k[0] == group]
        shapes = sorted({k[2] for k in keys})
        provs = [p for p in providers if any(k[1] == p for k in keys)]
        for (metric, ylabel), ax in zip(metrics, row_axes):
            _bars(ax, latest, group, shapes, provs, metric)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(", ".join(str(g) for g in group), fontsize=8)
    figure_legend(fig, providers, title)
    fig.savefig(dst, dpi=110)
    plt.close(fig)
    return Path(dst)


def plot_main(argv: list[str] | None, doc: str, csv_name: str, plot) -> int:
    """The command line of a one-CSV plotting script: `python bench/plot_X.py [CSV [PNG]]` (PNG: the CSV's, .png;
    CSV by default bench/results/<csv_name>), described by the first paragraph of the script's docstring `doc`."""
    prog = f"python bench/{Path(plot.__code__.co_filename).name}"
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    default_csv = Path(__file__).resolve().parent / "results" / csv_name
    ap.add_argument("csv", nargs="?", type=Path, default=default_csv, help="the CSV (default: %(default)s)")
    ap.add_argument("png", nargs="?", type=Path, default=None, help="the PNG to write (default: the CSV's, as .png)")
    args = ap.parse_args(argv)
    print(f"wrote {plot(args.csv, args.png or args.csv.with_suffix('.png'))}")
    return 0
