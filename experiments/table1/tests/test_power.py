"""table1's power figures (experiments/table1/stats.py) and the report's endpoint and power tables
(experiments/table1/report.py) against hand computations; the plot's bands stay inside [0, 1]."""

from __future__ import annotations

import math

import pytest

from experiments.table1.report import CSV_COLUMNS, ENDPOINTS, main_table, paired_table, power_table
from experiments.table1.stats import detectable_effect, fmt, n_for_power, paired_sd

Z975, Z80 = 1.959964, 0.841621  # standard normal quantiles (tables)


def test_power_arithmetic_by_hand():
    # the recorded kb_alias run: per-seed SD 0.199 of RAPO - GRPO, effect +0.05 -> (2.8016 * 0.199 / 0.05)^2 = 124.3
    assert n_for_power(0.199, 0.05) == 125 == math.ceil(((Z975 + Z80) * 0.199 / 0.05) ** 2)
    assert n_for_power(0.3, 0.1, alpha=0.05, power=0.9) == math.ceil(((Z975 + 1.281552) * 0.3 / 0.1) ** 2)
    assert n_for_power(0.0, 0.1) == 2 and math.isnan(n_for_power(math.nan, 0.1))
    assert detectable_effect(0.199, 5) == pytest.approx((Z975 + Z80) * 0.199 / math.sqrt(5), rel=1e-5)
    sd, n = paired_sd({0: 0.6, 1: 0.8, 2: 0.5}, {0: 0.5, 1: 0.6, 3: 0.9})  # seeds 0, 1: diffs 0.1, 0.2
    assert n == 2 and sd == pytest.approx(math.sqrt(0.005))
    assert math.isnan(paired_sd({0: 1.0}, {0: 0.0})[0])
    with pytest.raises(ValueError, match="effect must be > 0, got 0"):
        n_for_power(0.2, 0)
    with pytest.raises(ValueError, match="power must be in"):
        n_for_power(0.2, 0.1, power=1.0)
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        detectable_effect(0.2, 0)


def _rows():
    # GRPO and RAPO on three seeds: success and the endpoint, RAPO - GRPO known per seed
    rows = []
    for seed, (g, r, lg, lr) in enumerate([(0.2, 0.3, -10.0, -9.5), (0.4, 0.4, -12.0, -11.0), (0.1, 0.3, -8.0, -8.0)]):
        rows.append(dict(task="t", method="GRPO", seed=seed, eval_final=g, heldout_logp_final=lg))
        rows.append(dict(task="t", method="RAPO", seed=seed, eval_final=r, heldout_logp_final=lr))
    return rows


def test_endpoint_and_power_tables_by_hand():
    rows = _rows()
    assert {"heldout_logp_start", "heldout_logp_final"} <= set(CSV_COLUMNS)
    assert "| GRPO | -10.000 ± 4.969 | -10.000 ± 4.969 |" in main_table(rows, ["t"], ["GRPO"], key="heldout_logp_final")
    # RAPO - GRPO log-probability per seed: 0.5, 1.0, 0.0 (mean 0.5, sd 0.5)
    paired = paired_table(rows, ["t"], ["GRPO", "RAPO"], key="heldout_logp_final")
    assert paired[-1] == f"| RAPO | {fmt(0.5, 4.303 * 0.5 / math.sqrt(3))} (n=3) |"
    lines = power_table(rows, ["t"], ["GRPO", "RAPO"])
    effect = dict((k, e) for k, _, e in ENDPOINTS)
    sd_s = math.sqrt(((0.1 - 0.1) ** 2 + (0.0 - 0.1) ** 2 + (0.2 - 0.1) ** 2) / 2)  # success diffs 0.1, 0, 0.2
    n_s = math.ceil(((Z975 + Z80) * sd_s / effect["eval_final"]) ** 2)
    n_l = math.ceil(((Z975 + Z80) * 0.5 / effect["heldout_logp_final"]) ** 2)
    assert lines[2].startswith("| t | success AUC (primary) | RAPO | n/a")  # rows without an AUC: no figure
    success, logp = lines[3], lines[4]
    want = f"| t | final success | RAPO | {fmt(0.1, 4.303 * sd_s / math.sqrt(3))} (n=3) | {sd_s:.3f} |"
    assert success.startswith(want)
    assert f"| {n_s} | {(Z975 + Z80) * sd_s / math.sqrt(3):.3f} |" in success
    want = f"| t | log-probability (calibration, nats) | RAPO | {fmt(0.5, 4.303 * 0.5 / math.sqrt(3))} (n=3) |"
    assert logp.startswith(want)
    assert f"| {n_l} | {(Z975 + Z80) * 0.5 / math.sqrt(3):.3f} |" in logp


def test_table1_plot_has_a_y_label_and_bands_inside_0_1(monkeypatch, tmp_path):
    from matplotlib.figure import Figure

    from experiments.table1 import report

    figs, real = [], Figure.savefig

    def savefig(fig, *args, **kwargs):  # the figures saved while the test runs (the file is still written)
        figs.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    # two seeds far apart: a t interval over 2 seeds reaches far past 0 and 1
    rows = [{"task": "kb_alias", "method": "GRPO", "_curve": [(0, v), (10, v)]} for v in (0.02, 0.98)]
    report.plot(tmp_path / "t.png", rows, ["kb_alias"], ["GRPO"])
    ax = figs[0].axes[0]
    assert ax.get_ylabel()
    (band,) = ax.collections
    ys = [y for path in band.get_paths() for _, y in path.vertices]
    assert min(ys) >= 0.0 and max(ys) <= 1.0, (min(ys), max(ys))
