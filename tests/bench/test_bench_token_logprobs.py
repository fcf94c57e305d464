"""Smoke run of `rapo-fast bench logprobs --quick`: every provider runs in both modes and agrees with the chunked
reference of its input kind (Cut Cross-Entropy, CUDA only, says "unavailable"), and its rows (with device, date,
commit) and its plot land in the folder asked for, not in bench/results/. Not a performance test (numbers on a shared
CI core mean nothing)."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
RECORDED = BENCH / "results" / "token_logprobs.csv"


def _load(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_token_logprobs_smoke", BENCH / "bench_token_logprobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "GRID_CPU_QUICK", [(37, 24, 301)])
    monkeypatch.setattr(mod, "MIN_SAMPLES", 2)
    return mod


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_bench_logprobs_quick_writes_agreeing_rows_to_out(tmp_path, monkeypatch):
    mod = _load(monkeypatch)
    before = _digest(RECORDED)
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    assert _digest(RECORDED) == before, "a --quick run changed bench/results/token_logprobs.csv"
    assert (tmp_path / "token_logprobs.png").stat().st_size > 10_000  # the plot, beside the CSV
    rows = list(csv.DictReader((tmp_path / "token_logprobs.csv").open()))
    providers = {r["provider"] for r in rows}
    assert {"torch_eager_logits", "rapo_fast_logits", "torch_eager_hidden", "rapo_fast_hidden"} <= providers
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        assert "torch_chunked_hidden" in providers
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    for r in rows:
        assert r["device"] and r["date"] and r["commit"]
        if r["provider"] == "cce":
            assert r["status"].startswith("unavailable: "), r  # CUDA only; never a made-up number
            continue
        assert r["status"] == "ok", r
        assert float(r["median_ms"]) > 0 and float(r["peak_mem_mb"]) >= 0
        assert float(r["max_abs_diff_logp"]) <= 2e-3, r
        if r["mode"] == "fwd+bwd":
            assert float(r["grad_rel_err"]) <= 1e-3, r
        if r["provider"] == "rapo_fast_logits":
            assert r["path"].startswith("chunked reference fallback"), r  # the CPU takes the fallback, and says so
        if r["provider"] == "rapo_fast_hidden":  # torch's chunked linear CE where this torch has it
            expect = (
                "torch chunked linear CE" if hasattr(torch.nn, "LinearCrossEntropyOptions") else "chunked reference"
            )
            assert r["path"].startswith(expect), r


def test_bench_without_out_writes_to_a_temporary_folder(tmp_path, monkeypatch, capsys):
    mod = _load(monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp puts the run's folder
    before = _digest(RECORDED)
    assert mod.main(["--quick", "--providers", "torch_eager_logits,torch_eager_hidden"]) == 0
    assert _digest(RECORDED) == before
    written = list(tmp_path.glob("rapo_fast_bench_logprobs_*/token_logprobs.csv"))
    assert len(written) == 1, list(tmp_path.iterdir())
    assert str(written[0].parent) in capsys.readouterr().out  # the folder is printed


def test_quick_run_cannot_be_recorded(monkeypatch):
    mod = _load(monkeypatch)
    with pytest.raises(SystemExit, match="never recorded"):
        mod.main(["--quick", "--record"])
