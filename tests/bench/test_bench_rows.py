"""Rows survive what stops a bench, and one provider's failure is its own row.

- A bench run stopped mid-way keeps every row it finished: SIGINT (the GPU runner's stop at a step's budget) adds one
  "interrupted: step budget" row for what was being measured and exits 130 within seconds; SIGKILL leaves the rows
  finished so far, whole. Every row is well formed (the header's columns, device, date and commit).
- A provider that raises (at setup, at its first call, during timing) gets an "error: ..." row and its neighbours
  still get theirs; one not installed here gets "unavailable: ...". Retrieval's GPU loop (run here on CPU tensors)
  survives a failing `ours_triton`, which once ended the whole run without a CSV.
Not a performance test: tiny CPU shapes, times mean nothing.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
PROVIDERS = ["torch_eager", "rapo_fast_hidden", "rapo_fast_logits", "torch_linear_ce"]


def _rows(path: Path) -> list[dict]:
    """The CSV's rows, each checked well formed: exactly the header's fields, stamped with device, date, commit."""
    text = path.read_text()
    assert text.endswith("\n"), "a half-written last line"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        assert None not in r and None not in r.values(), r  # no extra or missing fields
        assert r["device"] and r["date"] and r["commit"] and r["provider"] and r["status"], r
    return rows


def _start_loss(out: Path) -> subprocess.Popen:
    """bench_loss.py at a tiny CPU shape, each provider timed for ~2 s, in its own session (signals reach it alone)."""
    env = dict(os.environ, RAPO_FAST_DISABLE_TRITON="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, str(BENCH / "bench_loss.py"), "--out", str(out), "--shape", "48,16,64"]
    cmd += ["--rep-ms", "2000", "--providers", ",".join(PROVIDERS)]
    log = (out.parent / "bench.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for_a_row(proc: subprocess.Popen, csv_path: Path, timeout: float = 90) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if csv_path.exists() and len(csv_path.read_text().splitlines()) >= 2:
            return
        assert proc.poll() is None, (csv_path.parent.parent / "bench.log").read_text()
        time.sleep(0.2)
    proc.kill()
    pytest.fail("no row within the timeout")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_run_stopped_mid_way_keeps_its_finished_rows(tmp_path, sig):
    out = tmp_path / "out"
    proc = _start_loss(out)
    _wait_for_a_row(proc, out / "loss.csv")
    t0 = time.perf_counter()
    proc.send_signal(sig)
    rc = proc.wait(timeout=30)
    log = (tmp_path / "bench.log").read_text()
    assert time.perf_counter() - t0 < 8, log  # the runner's SIGKILL follows 15 s after its SIGINT
    rows = _rows(out / "loss.csv")
    assert [r["provider"] for r in rows] == PROVIDERS[: len(rows)], rows  # in the order asked
    if sig == signal.SIGINT:
        assert rc == 130, log
        *done, last = rows
        assert last["status"] == "interrupted: step budget" and last["N"] == "48" and last["V"] == "64", last
    else:
        assert rc == -signal.SIGKILL
        done = rows
    assert done and all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in done), rows


def test_an_erroring_provider_gets_its_row_and_its_neighbours_theirs(load_bench, tmp_path, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    mod = load_bench("bench_loss.py")
    real = mod.lp.make_provider

    def make(name, device):
        if name == "torch_linear_ce":
            raise RuntimeError("cannot build")
        if name == "rapo_fast_hidden":

            def boom(*args):
                raise RuntimeError("kernel failed")

            return boom
        return real(name, device)

    monkeypatch.setattr(mod.lp, "make_provider", make)
    provs = "rapo_fast_hidden,torch_eager,torch_linear_ce,cce,rapo_fast_logits"
    args = ["--shape", "48,16,64", "--rep-ms", "5", "--providers", provs, "--out", str(tmp_path)]
    assert mod.main(args) == 1  # an error row fails the run; the rows are all there
    rows = {r["provider"]: r for r in _rows(tmp_path / "loss.csv")}
    assert list(rows) == provs.split(",")
    assert rows["rapo_fast_hidden"]["status"] == "error: first call: RuntimeError('kernel failed')"
    assert rows["torch_linear_ce"]["status"] == "error: setup: RuntimeError('cannot build')"
    assert rows["cce"]["status"].startswith("unavailable: ")  # not installed here, or CUDA only
    for name in ("torch_eager", "rapo_fast_logits"):
        assert rows[name]["status"] == "ok" and float(rows[name]["median_ms"]) > 0, rows[name]


def test_logprobs_error_while_timing_keeps_the_check_columns(load_bench, tmp_path, monkeypatch):
    mod = load_bench("bench_token_logprobs.py")
    monkeypatch.setattr(mod, "MIN_SAMPLES", 2)
    real = mod._provider

    def provider(name, device):
        path, fn = real(name, device)
        if name != "torch_eager_hidden":
            return path, fn
        calls = []

        def flaky(t):  # right at the first call (the check), then fails while being timed
            calls.append(1)
            if len(calls) > 1:
                raise ValueError("flaky")
            return fn(t)

        return path, flaky

    monkeypatch.setattr(mod, "_provider", provider)
    args = ["--shape", "40,16,97", "--rep-ms", "5", "--providers", "torch_eager_hidden,rapo_fast_hidden"]
    assert mod.main([*args, "--out", str(tmp_path)]) == 1
    rows = _rows(tmp_path / "token_logprobs.csv")
    assert [(r["provider"], r["mode"]) for r in rows] == [
        ("torch_eager_hidden", "fwd"),
        ("rapo_fast_hidden", "fwd"),
        ("torch_eager_hidden", "fwd+bwd"),
        ("rapo_fast_hidden", "fwd+bwd"),
    ]
    flaky = rows[0]
    assert flaky["status"] == "error: timing: ValueError('flaky')" and float(flaky["max_abs_diff_logp"]) < 1e-3
    assert all(r["status"] == "ok" for r in rows if r["provider"] == "rapo_fast_hidden"), rows


def test_retrieval_gpu_loop_survives_a_failing_triton_backend(load_bench, tmp_path, monkeypatch):
    """The GPU loop on CPU tensors (its state made here): `ours_triton` raising becomes its own row."""
    mod = load_bench("bench_retrieval.py")
    from _common import RowWriter
    from rapo_fast import StepBuffer

    buf = StepBuffer(2000, 16, dtype=torch.float16, metric="ip")
    g = torch.Generator().manual_seed(0)
    buf.add(torch.randn(2000, 16, generator=g), torch.arange(2000), torch.randint(0, 10, (2000,), generator=g))
    st = dict(buf=buf, q=torch.randn(5, 16, generator=g), excl=torch.randint(0, 10, (5,), generator=g), chunk=512)
    monkeypatch.setattr(mod, "_gpu_state", lambda *a: st)
    real = mod._forced

    def forced(backend, fn, *args):
        if backend == "triton":
            raise RuntimeError("triton compile failed")
        return real(backend, fn, *args)

    monkeypatch.setattr(mod, "_forced", forced)
    names = mod.GPU_PROVIDERS
    keys = [dict(provider=n, C=2000, D=16, Q=5, k=3) for n in names]
    writer = RowWriter("retrieval_gpu", tmp_path, torch.device("cpu"), keys, mod.GPU_COLUMNS)
    mod._gpu_case(writer, names, 2000, 16, 5, 3, "ip", torch.device("cpu"), 10.0, rep_ms=5)
    rows = {r["provider"]: r for r in _rows(tmp_path / "retrieval_gpu.csv")}
    assert list(rows) == names
    assert rows["ours_triton"]["status"] == "error: first call: RuntimeError('triton compile failed')"
    for name in ("torch", "ours", "ours_excl", "ours_cuda", "floor"):
        assert rows[name]["status"] == "ok" and float(rows[name]["median_ms"]) > 0, rows[name]
        assert rows[name]["time_over_torch"], rows[name]  # torch is measured first
    assert float(rows["ours_cuda"]["frac_ids_equal_to_ours"]) == 1.0


def test_retrieval_cpu_provider_failing_in_the_round_robin(load_bench, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    mod = load_bench("bench_retrieval.py")
    real = mod._cpu_fn

    def cpu_fn(name, *args):
        fn = real(name, *args)
        if name != "torch":
            return fn
        calls = []

        def flaky():  # the agreement call passes, the warm-up of the round robin fails
            calls.append(1)
            if len(calls) > 1:
                raise MemoryError("out of memory")
            return fn()

        return flaky

    monkeypatch.setattr(mod, "_cpu_fn", cpu_fn)
    args = ["--shape", "3000,16,5,3", "--repeats", "1", "--providers", "ours,torch,ours_fp16", "--out", str(tmp_path)]
    assert mod.main(args) == 1
    rows = {r["provider"]: r for r in _rows(tmp_path / "retrieval_cpu.csv")}
    assert list(rows) == ["ours", "torch", "ours_fp16"]
    assert rows["torch"]["status"] == "error: warm-up: MemoryError('out of memory')"
    assert rows["ours"]["status"] == rows["ours_fp16"]["status"] == "ok"
