"""Plot retrieval bench CSVs (bench/bench_retrieval.py, `rapo-fast bench retrieval`): queries/s per provider (log
scale, higher is better, the 20-80% quantiles as error bars), written next to each CSV as retrieval_{cpu,gpu}.png.

Split into panels that can be read: one per machine setting (CPU instruction set and thread count, or the GPU) and
metric, times one per shape family: the paper's scale (C=170k, D=384, Q=256), the few-query shapes of per-step
retrieval (Q <= 32 at the paper's C and D; x = Q), and the grid, one panel per key dimension D. Within a panel the
latest row of a provider at a shape wins. Colours are those of every bench plot (bench/_plot_style.py).
Usage: `python bench/plot_retrieval.py [CSV [PNG]]`, like every plot script (CSV by default
bench/results/retrieval_cpu.csv; the GPU rows: bench/results/retrieval_gpu.csv). What this is not: the benchmark
(bench/bench_retrieval.py).
"""

from __future__ import annotations

from pathlib import Path

import _plot_style as ps

PAPER_C, PAPER_D = 170_000, 384


def family(c: int, d: int, q: int) -> tuple[int, str]:
    """(order, title) of the shape family a shape belongs to (the panels of one setting, in this order)."""
    if (c, d) == (PAPER_C, PAPER_D):
        return (1, "few queries (C=170k, D=384)") if q <= 32 else (0, "paper scale (C=170k, D=384)")
    return 2 + d, f"grid, D={d}"


def _tick(c: int, d: int, q: int, k: int) -> str:
    if (c, d) == (PAPER_C, PAPER_D):
        return f"Q={q}\nk={k}"
    return f"C={c // 1000}k\nQ={q} k={k}"


def _panels(csv_path: Path) -> tuple[dict, list[str]]:
    """{(setting, family): {(shape, provider): row}} of the latest rows, and the providers in bench order."""
    panels: dict[tuple, dict] = {}
    providers: list[str] = []
    for r in ps.measured_rows(csv_path):
        c, d, q, k = (int(r[x]) for x in ("C", "D", "Q", "k"))
        cpu = f"{r['isa']}, {r['threads']} thread(s)" if r.get("isa") else r.get("threads", "")
        setting = ", ".join(x for x in (r.get("device", "")[:40], cpu, f"metric {r.get('metric', 'ip')}") if x)
        panels.setdefault((setting, family(c, d, q)), {})[((q, c, d, k), r["provider"])] = r
        providers += [] if r["provider"] in providers else [r["provider"]]
    return dict(sorted(panels.items(), key=lambda kv: (kv[0][0], kv[0][1][0]))), providers


def _draw(ax, rows: dict, providers: list[str]) -> None:
    shapes = sorted({s for s, _ in rows}, key=lambda s: (s[1], s[2], s[0], s[3]))
    provs = [p for p in providers if any(pp == p for _, pp in rows)]
    width = 0.8 / max(len(provs), 1)
    for i, p in enumerate(provs):
        got = [rows.get((s, p)) for s in shapes]
        qps = [ps.num(r, "qps") for r in got]
        # qps = Q / time: the 20% time quantile is the 80% rate quantile and the other way round
        lo = [v - s[0] / (ps.num(r, "p80_ms") * 1e-3) for v, s, r in zip(qps, shapes, got)]
        hi = [s[0] / (ps.num(r, "p20_ms") * 1e-3) - v for v, s, r in zip(qps, shapes, got)]
        err = [[x if x == x and x > 0 else 0.0 for x in side] for side in (lo, hi)]
        xs = [j + (i - (len(provs) - 1) / 2) * width for j in range(len(shapes))]
        ax.bar(xs, qps, width, yerr=err, capsize=1.5, color=ps.color(p), label=p)
    ax.set_xticks(range(len(shapes)), [_tick(c, d, q, k) for q, c, d, k in shapes], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel(ps.label("queries / s, median", ps.HIGHER), fontsize=8)


def plot(csv_path: Path, png_path: Path | None = None, note: str = "") -> Path:
    """Draw `csv_path` into `png_path` (default: next to it, .png); `note` is added to the title."""
    plt = ps.pyplot()
    panels, providers = _panels(csv_path)
    if not panels:
        raise SystemExit(f"{csv_path}: no measured rows to plot")
    cols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 3.6 * nrows + 1.0), squeeze=False)
    for ax, ((setting, (_, fam)), rows) in zip(axes.flat, panels.items()):
        _draw(ax, rows, providers)
        ax.set_title(f"{fam}\n{setting}", fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    ps.figure_legend(fig, providers, f"exact top-k retrieval, {csv_path.stem}" + (f" — {note}" if note else ""))
    out = Path(png_path) if png_path else csv_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    return ps.plot_main(argv, __doc__, "retrieval_cpu.csv", plot)


if __name__ == "__main__":
    raise SystemExit(main())
