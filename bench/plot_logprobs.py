"""Plot a token log-probs bench CSV (bench/bench_token_logprobs.py, `rapo-fast bench logprobs`): median time (bars,
with the 20-80% quantiles as error bars) and peak memory per provider, both lower is better.

One row of panels per run and mode (device, dtype, commit and day, `fwd` or `fwd+bwd`: rows of different runs are never
mixed in one panel), x = shape "N x H x V"; the latest row of a provider at a shape within a run wins. Colours are
those of every bench plot (bench/_plot_style.py). Usage: `python bench/plot_logprobs.py [CSV] [PNG]` (default
bench/results/token_logprobs.csv, PNG next to it). What this is not: a benchmark; it only reads the CSV.
"""

from __future__ import annotations

from pathlib import Path

import _plot_style as ps


def plot(src: Path, dst: Path, note: str = "") -> Path:
    """Draw `src` (a token_logprobs CSV) into `dst`; `note` is added to the title (a smoke run says so)."""
    return ps.time_and_memory(
        src,
        dst,
        lambda r: (r.get("device", "")[:48], r.get("dtype", ""), ps.run_of(r), f"mode {r.get('mode', '?')}"),
        "token_logprobs alone, per provider" + (f" — {note}" if note else ""),
        "median ms",
    )


def main(argv: list[str] | None = None) -> int:
    return ps.plot_main(argv, __doc__, "token_logprobs.csv", plot)


if __name__ == "__main__":
    raise SystemExit(main())
