"""The bench plots and the columns they read: every plotting script answers --help; one colour per provider name,
distinct within each bench; time and memory axes say "lower is better"; the retrieval plot is split into panels; the
committed CSVs plot (their PNGs are regenerated from them); no committed CSV has a bare `ratio`/`agree` column;
native profiler output is dropped around a CPU memory reading.
Not a benchmark run (tests/bench/test_bench_*.py run the benches' --quick).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"
PLOTS = ["plot_loss.py", "plot_retrieval.py", "plot_logprobs.py", "plot_kv.py"]


@pytest.mark.parametrize("script", PLOTS)
def test_plot_script_help_exits_0_with_a_description(script):
    res = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: python bench/{script}"), res.stdout
    assert "better" in res.stdout, res.stdout  # the description says which way is better


@pytest.mark.parametrize(
    "script, csv_name",
    [
        ("plot_loss.py", "loss.csv"),
        ("plot_retrieval.py", "retrieval_cpu.csv"),
        ("plot_logprobs.py", "token_logprobs.csv"),
        ("plot_kv.py", "kv_splice.csv"),
    ],
)
def test_every_plot_script_takes_csv_then_png_as_the_readme_says(load_bench, tmp_path, capsys, script, csv_name):
    png = tmp_path / "drawn.png"
    assert load_bench(script).main([str(RESULTS / csv_name), str(png)]) == 0
    assert png.stat().st_size > 10_000 and f"wrote {png}" in capsys.readouterr().out


def test_one_colour_per_provider_distinct_within_each_bench(load_bench, monkeypatch):
    style = load_bench("_plot_style.py")
    lp = load_bench("_loss_providers.py")
    lists = {
        "loss": lp.ALL,
        "logprobs": list(load_bench("bench_token_logprobs.py").INPUT),
        "retrieval_cpu": load_bench("bench_retrieval.py").CPU_PROVIDERS,
        "retrieval_gpu": load_bench("bench_retrieval.py").GPU_PROVIDERS,
        "kv": load_bench("bench_kv_splice.py").PROVIDERS,
    }
    for bench, names in lists.items():
        assert all(n in style.COLORS for n in names), (bench, [n for n in names if n not in style.COLORS])
        colours = [style.color(n) for n in names]
        assert len(set(colours)) == len(colours), (bench, dict(zip(names, colours)))
    assert style.color("some_new_provider") == style.color("some_new_provider")  # unknown names: fixed too


def _figures(monkeypatch) -> list:
    """The figures saved while the test runs (Figure.savefig still writes the file)."""
    from matplotlib.figure import Figure

    saved, real = [], Figure.savefig

    def savefig(fig, *args, **kwargs):
        saved.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


@pytest.mark.parametrize(
    "script, csv_name, time_axis",
    [
        ("plot_loss.py", "loss.csv", "y"),
        ("plot_logprobs.py", "token_logprobs.csv", "y"),
        ("plot_kv.py", "kv_splice.csv", "x"),
    ],
)
def test_committed_csv_plots_with_lower_is_better_axes(load_bench, monkeypatch, tmp_path, script, csv_name, time_axis):
    mod = load_bench(script)
    figs = _figures(monkeypatch)
    out = mod.plot(RESULTS / csv_name, tmp_path / "out.png")
    assert out.stat().st_size > 10_000
    axes = [ax for ax in figs[0].axes if ax.get_visible()]
    labels = [ax.get_ylabel() if time_axis == "y" else ax.get_xlabel() for ax in axes]
    assert labels and all("lower is better" in text for text in labels), labels
    assert any("memory" in text for text in labels) or script == "plot_kv.py", labels


def test_retrieval_plot_is_split_into_panels_higher_is_better(load_bench, monkeypatch, tmp_path):
    mod = load_bench("plot_retrieval.py")
    figs = _figures(monkeypatch)
    mod.plot(RESULTS / "retrieval_cpu.csv", tmp_path / "r.png")
    axes = [ax for ax in figs[0].axes if ax.get_visible()]
    assert len(axes) >= 4, len(axes)  # paper scale, few queries, grid by D, per CPU setting
    titles = [ax.get_title() for ax in axes]
    assert any(t.startswith("paper scale") for t in titles) and any(t.startswith("few queries") for t in titles)
    assert all("higher is better" in ax.get_ylabel() for ax in axes)
    colours = {h.get_facecolor()[:3] for h in figs[0].legends[0].legend_handles}
    assert len(colours) == len(figs[0].legends[0].legend_handles)  # one legend, one colour each


def test_no_committed_csv_has_a_column_that_does_not_say_what_it_compares():
    for path in sorted(RESULTS.glob("*.csv")):
        with path.open(newline="") as f:
            header = next(csv.reader(f))
        vague = [c for c in header if c in ("ratio", "agree", "speedup") or c.startswith(("ratio_", "ours_speedup"))]
        assert not vague, (path.name, vague)


def test_native_output_is_dropped_unless_the_block_raises(load_bench, monkeypatch, capfd):
    quiet = load_bench("_quiet.py")
    with quiet.native_output_captured():
        os.write(1, b"USDT: profiler_start\n")
        os.write(2, b"[W CPUAllocator.cpp] Memory block of unknown size\n")
    assert capfd.readouterr() == ("", "")
    with pytest.raises(RuntimeError), quiet.native_output_captured():
        os.write(2, b"native context of the error\n")
        raise RuntimeError("boom")
    assert "native context of the error" in capfd.readouterr().err
