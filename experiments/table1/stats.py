"""The statistics of the Table-1 runs: means with 95% confidence intervals over seeds, paired differences against a
baseline method on the same seeds, the power of a paired comparison (seeds needed for an effect, the smallest
effect a number of seeds detects), and training efficiency (steps and generated tokens to reach a level).

What this is: small pure functions on plain Python numbers, so that the report's arithmetic can be checked by hand
(experiments/table1/tests/test_run.py and test_power.py do). The interval is Student's t: mean +- t_{0.975, n-1} * sd /
sqrt(n), with the sample (n - 1) standard deviation; one seed has no interval (NaN). The power figures use the normal
approximation of a two-sided paired test at level alpha: n = ((z_{1-alpha/2} + z_{power}) * sd / effect)^2, rounded
up, with sd the per-seed SD of the paired difference (a t test needs a few seeds more at small n). What this is not:
the runs (experiments/table1/run.py) or the files they write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (standard tables); beyond, t975's expansion
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """Student's t 0.975 quantile: the table up to 30 degrees of freedom, beyond it the Cornish-Fisher expansion
    about the normal quantile (within 1e-4 of the exact value for df > 30: 2.000 at 60, 1.984 at 100)."""
    if df < 1:
        raise ValueError(f"t975: df: expected >= 1 degrees of freedom, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _sample_sd(vals: Sequence[float], mean: float) -> float:
    """The sample (n - 1) standard deviation of vals (at least two) about their mean."""
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def mean_ci(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% interval) of xs; half-width NaN for fewer than 2 values, (NaN, NaN) for none."""
    vals = [float(x) for x in xs if not math.isnan(float(x))]
    n = len(vals)
    if n == 0:
        return math.nan, math.nan
    m = sum(vals) / n
    if n == 1:
        return m, math.nan
    return m, t975(n - 1) * _sample_sd(vals, m) / math.sqrt(n)


def paired_diff(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """Mean and 95% half-width of a[seed] - b[seed] over the seeds both have, and how many seeds that is."""
    seeds = sorted(set(a) & set(b))
    m, h = mean_ci([a[s] - b[s] for s in seeds])
    return m, h, len(seeds)


def paired_sd(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    """The sample (n - 1) SD of a[seed] - b[seed] over the seeds both have (NaN below 2), and how many seeds."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b)) if not math.isnan(a[s] - b[s])]
    if len(d) < 2:
        return math.nan, len(d)
    return _sample_sd(d, sum(d) / len(d)), len(d)


def _z_sum(alpha: float, power: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"power: alpha must be in (0, 1), got {alpha!r}")
    if not 0.0 < power < 1.0:
        raise ValueError(f"power: power must be in (0, 1), got {power!r}")
    z = NormalDist().inv_cdf
    return z(1.0 - alpha / 2.0) + z(power)


def n_for_power(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """Seeds a paired two-sided test at level `alpha` needs to detect a true mean difference `effect` with probability
    `power`, given the per-seed SD `sd` of the difference (normal approximation, module docstring); NaN when sd is."""
    if not effect > 0.0:
        raise ValueError(f"n_for_power: effect must be > 0, got {effect!r}")
    if math.isnan(sd):
        return math.nan
    if sd < 0.0:
        raise ValueError(f"n_for_power: sd must be >= 0, got {sd!r}")
    return float(max(2, math.ceil((_z_sum(alpha, power) * sd / effect) ** 2)))


def detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference that `n` paired seeds detect with probability `power` at level `alpha`
    (normal approximation): (z_{1-alpha/2} + z_{power}) * sd / sqrt(n); NaN when sd is."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"detectable_effect: n must be a positive int, got {n!r}")
    return math.nan if math.isnan(sd) else _z_sum(alpha, power) * sd / math.sqrt(n)


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


__all__ = ["t975", "mean_ci", "paired_diff", "paired_sd", "n_for_power", "detectable_effect", "first_reach", "fmt"]
