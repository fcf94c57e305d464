"""Smoke run of bench/bench_loss.py --quick: every CPU provider runs and agrees with the chunked reference (those not
installed here, or CUDA-only, say "unavailable"), and a CSV row with device, date and commit is written for each. Not a
performance test (numbers on a shared CI core mean nothing)."""

import csv
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_loss_quick_writes_agreeing_rows(tmp_path, monkeypatch):
    # The interpreter would time Triton's Python emulation; the bench's CPU rows are the fallback path anyway.
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_loss_smoke", BENCH / "bench_loss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "GRID_CPU_QUICK", [(37, 24, 301)])
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "loss.csv").open()))
    providers = {r["provider"] for r in rows}
    assert {"torch_eager", "rapo_fast_hidden", "rapo_fast_logits", "torch_compile"} <= providers
    assert [r["provider"] for r in rows] == mod.lp.default_providers(gpu=False)  # one row each, in order
    for r in rows:
        assert r["device"] and r["date"] and r["commit"] and r["ref_loss"], r
        if r["provider"] in ("liger", "cce") and r["status"].startswith("unavailable: "):
            continue  # not installed here (cce: CUDA only); never a made-up number
        assert r["status"] == "ok", r
        assert float(r["median_ms"]) > 0
