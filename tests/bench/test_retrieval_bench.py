"""Smoke run of the retrieval benchmark (`rapo-fast bench retrieval --quick`): every CPU provider runs at the tiny
shapes, agrees with ours, rows with device, date and commit land in the CSV, and its plot in a PNG beside it, in the
folder --out names. Not a performance test.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_retrieval_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_retrieval_smoke", BENCH / "bench_retrieval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "QUICK", [(3000, 40, 33, 5)])
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # main() would otherwise set it for the rest of the session
    assert mod.main(["--quick", "--out", str(tmp_path), "--repeats", "1"]) == 0
    assert (tmp_path / "retrieval_cpu.png").stat().st_size > 10_000
    rows = list(csv.DictReader((tmp_path / "retrieval_cpu.csv").open()))
    assert {"frac_ids_equal_to_ours", "time_over_faiss", "time_over_torch"} <= set(rows[0])
    providers = {r["provider"] for r in rows}
    assert {"ours", "ours_excl", "torch", "ours_fp16"} <= providers
    if "faiss_flat" in providers:
        assert "ours_faiss_mem" in providers
    for r in rows:
        assert r["device"] and r["date"] and r["commit"] and float(r["median_ms"]) > 0
        if r["provider"] in ("torch", "faiss_flat", "ours_faiss_mem"):
            assert float(r["frac_ids_equal_to_ours"]) > 0.99, r
