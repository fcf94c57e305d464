"""Smoke runs of the benchmarks' --quick mode (bench/bench_*.py): every CPU provider runs at tiny shapes and agrees
with the reference of its bench, a row with device, date and commit lands in the CSV of the folder --out names (or a
temporary folder without --out; never bench/results/), and the bench's plot beside it. Not a performance test
(numbers on a shared CI core mean nothing); the plans and row handling: test_bench_plan.py, test_bench_rows.py.
"""

from __future__ import annotations

import csv
import hashlib
import tempfile
from pathlib import Path

import pytest
import torch

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "results" / "token_logprobs.csv"


def _rows(path: Path) -> list[dict]:
    assert path.with_suffix(".png").stat().st_size > 10_000  # the plot, beside the CSV
    return list(csv.DictReader(path.open()))


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_kv(load_bench, tmp_path):
    mod = load_bench("bench_kv_splice.py")
    assert mod.main(["--quick", "--rep-ms", "5", "--out", str(tmp_path)]) == 0
    rows = {r["provider"]: r for r in _rows(tmp_path / "kv_splice.csv")}
    assert list(rows) == mod.PROVIDERS
    assert all(r["status"] == "ok" for r in rows.values()), rows  # the two splices agree with the reference rotation
    assert float(rows["rapo_fast"]["time_over_rapo_fast"]) == 1.0
    assert float(rows["torch_plain"]["time_over_rapo_fast"]) > 0


def test_retrieval(load_bench, tmp_path, monkeypatch):
    mod = load_bench("bench_retrieval.py", QUICK=[(3000, 40, 33, 5)])
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # main() would otherwise set it for the rest of the session
    assert mod.main(["--quick", "--out", str(tmp_path), "--repeats", "1"]) == 0
    rows = _rows(tmp_path / "retrieval_cpu.csv")
    assert {"frac_ids_equal_to_ours", "time_over_faiss", "time_over_torch"} <= set(rows[0])
    providers = {r["provider"] for r in rows}
    assert {"ours", "ours_excl", "torch", "ours_fp16"} <= providers
    if "faiss_flat" in providers:
        assert "ours_faiss_mem" in providers
    for r in rows:
        assert r["device"] and r["date"] and r["commit"] and float(r["median_ms"]) > 0
        if r["provider"] in ("torch", "faiss_flat", "ours_faiss_mem"):
            assert float(r["frac_ids_equal_to_ours"]) > 0.99, r


def test_loss(load_bench, tmp_path, monkeypatch, capfd):
    # The interpreter would time Triton's Python emulation; the bench's CPU rows are the fallback path anyway.
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    mod = load_bench("bench_loss.py", GRID_CPU_QUICK=[(37, 24, 301)])
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capfd.readouterr()
    assert "profiler_start" not in out.out + out.err and "unknown size" not in out.out + out.err, out
    rows = _rows(tmp_path / "loss.csv")
    assert {"torch_eager", "rapo_fast_hidden", "rapo_fast_logits", "torch_compile"} <= {r["provider"] for r in rows}
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


@pytest.fixture
def logprobs(load_bench):
    return load_bench("bench_token_logprobs.py", GRID_CPU_QUICK=[(37, 24, 301)], MIN_SAMPLES=2)


def test_logprobs(logprobs, tmp_path):
    before = _digest(RECORDED)
    assert logprobs.main(["--quick", "--out", str(tmp_path)]) == 0
    assert _digest(RECORDED) == before, "a --quick run changed bench/results/token_logprobs.csv"
    rows = _rows(tmp_path / "token_logprobs.csv")
    chunked = hasattr(torch.nn, "LinearCrossEntropyOptions")
    providers = {r["provider"] for r in rows}
    assert {"torch_eager_logits", "rapo_fast_logits", "torch_eager_hidden", "rapo_fast_hidden"} <= providers
    assert "torch_chunked_hidden" in providers or not chunked
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
            assert r["path"].startswith("torch chunked linear CE" if chunked else "chunked reference"), r


def test_logprobs_without_out_writes_to_a_temporary_folder(logprobs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp puts the run's folder
    before = _digest(RECORDED)
    assert logprobs.main(["--quick", "--providers", "torch_eager_logits,torch_eager_hidden"]) == 0
    assert _digest(RECORDED) == before
    written = list(tmp_path.glob("rapo_fast_bench_logprobs_*/token_logprobs.csv"))
    assert len(written) == 1, list(tmp_path.iterdir())
    assert str(written[0].parent) in capsys.readouterr().out  # the folder is printed


def test_quick_run_cannot_be_recorded(logprobs):
    with pytest.raises(SystemExit, match="never recorded"):
        logprobs.main(["--quick", "--record"])


def test_logprobs_parity_prints_a_row_per_shape_and_mode(logprobs, capsys):
    # one shape under SMALL_BYTES (torch's unchunked op as called) and one above it (chunked), both timed, and the
    # extra peak RSS of each side read in a fresh process
    assert logprobs.main(["--parity", "--quick", "--shape", "8,4,16", "--shape", "300,8,1000"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["8"], ["300"])]
    assert [(r[0], r[3]) for r in rows] == [("8", "fwd"), ("8", "fwd+bwd"), ("300", "fwd"), ("300", "fwd+bwd")]
    assert all(float(x) > 0 for r in rows for x in r[4:9])  # times and their ratios
    assert all(float(x) >= 0 for r in rows for x in r[9:11])  # MiB: a tiny call may fit in resident pages
    # 300 x 1000 fwd+bwd: the [N, H] and [V, H] gradients alone are 41 KiB; one chunk of fp32 logits is 1.2 MB
    assert float(rows[3][9]) > 0.5 and float(rows[3][10]) > 0.5
