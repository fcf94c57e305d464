"""The statistics of `rapo-fast table1`: means with 95% confidence intervals over seeds, paired differences against a
baseline method on the same seeds, and training efficiency (steps and generated tokens to reach a level).

What this is: small pure functions on plain Python numbers, so that the report's arithmetic can be checked by hand
(tests/demo/test_table1.py does). The interval is Student's t: mean +- t_{0.975, n-1} * sd / sqrt(n), with the
sample (n - 1) standard deviation; one seed has no interval (NaN). What this is not: the runs (rapo_fast/demo/
table1.py) or the files they write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (standard tables); beyond, the normal 1.96
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"t975: degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% interval) of xs; half-width NaN for fewer than 2 values, (NaN, NaN) for none."""
    vals = [float(x) for x in xs if not math.isnan(float(x))]
    n = len(vals)
    if n == 0:
        return math.nan, math.nan
    m = sum(vals) / n
    if n == 1:
        return m, math.nan
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1))
    return m, t975(n - 1) * sd / math.sqrt(n)


def paired_diff(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """Mean and 95% half-width of a[seed] - b[seed] over the seeds both have, and how many seeds that is."""
    seeds = sorted(set(a) & set(b))
    m, h = mean_ci([a[s] - b[s] for s in seeds])
    return m, h, len(seeds)


def first_reach(curve: Sequence[tuple[int, float]], level: float) -> int | None:
    """The first step of a (step, score) curve whose score is >= level, or None."""
    for step, score in curve:
        if score >= level:
            return int(step)
    return None


def fmt(m: float, h: float, digits: int = 3) -> str:
    """'m +- h' (or 'm' without an interval, 'n/a' without a mean)."""
    if math.isnan(m):
        return "n/a"
    return f"{m:.{digits}f}" if math.isnan(h) else f"{m:.{digits}f} ± {h:.{digits}f}"


__all__ = ["t975", "mean_ci", "paired_diff", "first_reach", "fmt"]
