"""Smoke run of bench/bench_loss.py --quick: every CPU provider runs and agrees with the chunked reference (those not
installed here, or CUDA-only, say "unavailable"; torch.compile's is "skipped" in a smoke run), a CSV row with device,
date and commit is written for each, the plot loss.png lands beside the CSV, and the profiler's native lines do not
reach the output. Not a performance test (numbers on a shared CI core mean nothing)."""

import csv
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_loss_quick_writes_agreeing_rows_and_the_plot(tmp_path, monkeypatch, capfd):
    # The interpreter would time Triton's Python emulation; the bench's CPU rows are the fallback path anyway.
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_loss_smoke", BENCH / "bench_loss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "GRID_CPU_QUICK", [(37, 24, 301)])
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capfd.readouterr()
    assert "profiler_start" not in out.out + out.err and "unknown size" not in out.out + out.err, out
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    rows = list(csv.DictReader((tmp_path / "loss.csv").open()))
    providers = {r["provider"] for r in rows}
    assert {"torch_eager", "rapo_fast_hidden", "rapo_fast_logits", "torch_compile"} <= providers
    assert [r["provider"] for r in rows] == mod.lp.default_providers(gpu=False)  # one row each, in order
    for r in rows:
        assert r["device"] and r["date"] and r["commit"] and r["ref_loss"], r
        if r["provider"] in ("liger", "cce") and r["status"].startswith("unavailable: "):
            continue  # not installed here (cce: CUDA only); never a made-up number
        if r["provider"] == "torch_compile":
            assert r["status"].startswith("skipped: torch.compile is not run in a --quick"), r
            continue
        assert r["status"] == "ok", r
        assert float(r["median_ms"]) > 0
