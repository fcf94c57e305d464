"""Smoke run of `rapo-fast bench kv --quick`: the four providers' rows (the two splices agreeing with the reference
rotation) land in the CSV of the folder --out names, with `time_over_rapo_fast` (this row's time over rapo_fast's),
and the plot kv_splice.png beside it. Not a performance test (numbers on a shared CI core mean nothing).
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_kv_quick_writes_the_csv_and_the_plot(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_kv_smoke", BENCH / "bench_kv_splice.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--rep-ms", "5", "--out", str(tmp_path)]) == 0
    rows = {r["provider"]: r for r in csv.DictReader((tmp_path / "kv_splice.csv").open())}
    assert list(rows) == mod.PROVIDERS
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert float(rows["rapo_fast"]["time_over_rapo_fast"]) == 1.0
    assert float(rows["torch_plain"]["time_over_rapo_fast"]) > 0
    assert (tmp_path / "kv_splice.png").stat().st_size > 10_000
