"""Plot a loss bench CSV (bench/bench_loss.py, `rapo-fast bench loss`): forward+backward median time (bars, with the
20-80% quantiles as error bars) and peak memory per provider, both lower is better.

One row of panels per run (device, dtype, commit and day: rows of different runs are never mixed in one panel), x =
shape "N x H x V"; the latest row of a provider at a shape within a run wins. Colours are those of every bench plot
(bench/_plot_style.py). Usage: `python bench/plot_loss.py [CSV] [PNG]` (default bench/results/loss.csv, PNG next to
it). What this is not: a benchmark; it only reads the CSV.
"""

from __future__ import annotations

from pathlib import Path

import _plot_style as ps


def plot(src: Path, dst: Path, note: str = "") -> Path:
    """Draw `src` (a loss CSV) into `dst`; `note` is added to the title (a smoke run says so)."""
    return ps.time_and_memory(
        src,
        dst,
        lambda r: (r.get("device", "")[:48], r.get("dtype", ""), ps.run_of(r)),
        "rapo_loss forward+backward, per provider" + (f" — {note}" if note else ""),
        "median ms, forward+backward",
    )


def main(argv: list[str] | None = None) -> int:
    return ps.plot_main(argv, __doc__, "loss.csv", plot)


if __name__ == "__main__":
    raise SystemExit(main())
