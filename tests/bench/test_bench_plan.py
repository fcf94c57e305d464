"""`--plan` of the four benches: the rows a run would take, one a line as `bench,provider,field=value,...`, in the order
taken (--providers order kept), printed quickly and without a GPU even with --gpu, without creating inputs or an
output folder; an unknown provider name is argparse's error. Also: a real (tiny, CPU) run writes exactly the rows its
plan lists, in that order. Not a run of the GPU validation (tests/bench/test_gpu_stages.py)."""

from __future__ import annotations

import csv
import tempfile
import time
from pathlib import Path

import pytest

V152K = ["--shape", "16384,4096,152064"]


@pytest.fixture
def plan(load_bench, monkeypatch, capsys, tmp_path):
    """plan(script, args): the lines `script args --plan` prints, checked quick and without an output folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a run without --out would create its folder

    def run(script: str, args: list[str]) -> list[str]:
        mod = load_bench(script)
        capsys.readouterr()
        t0 = time.perf_counter()
        assert mod.main([*args, "--plan"]) == 0
        assert time.perf_counter() - t0 < 5, "--plan must be quick (no inputs, no compilation)"
        assert not list(tmp_path.iterdir()), "--plan created an output folder"
        return capsys.readouterr().out.splitlines()

    return run


def test_loss_plan_keeps_the_providers_order_with_gpu(plan):
    provs = "rapo_fast_hidden,rapo_fast_logits,torch_eager,torch_linear_ce"
    lines = plan("bench_loss.py", ["--gpu", *V152K, "--providers", provs])
    assert lines == [f"loss,{p},N=16384,H=4096,V=152064" for p in provs.split(",")]


def test_loss_plan_default_gpu_providers_include_the_anchors(plan):
    lines = plan("bench_loss.py", ["--gpu", "--shape", "64,32,100"])
    provs = [ln.split(",")[1] for ln in lines]
    assert provs[0] == "torch_eager" and {"rapo_fast_hidden_2pass", "liger", "cce", "torch_compile"} <= set(provs)
    assert all(ln.endswith(",N=64,H=32,V=100") and ln.startswith("loss,") for ln in lines)


def test_logprobs_plan_shapes_then_modes_then_providers(plan):
    args = ["--gpu", *V152K, "--shape", "16384,4096,32768", "--providers", "rapo_fast_hidden,cce"]
    lines = plan("bench_token_logprobs.py", args)
    want = [
        f"token_logprobs,{p},N=16384,H=4096,V={v},mode={m}"
        for v in (152064, 32768)
        for m in ("fwd", "fwd+bwd")
        for p in ("rapo_fast_hidden", "cce")
    ]
    assert lines == want


def test_retrieval_plan_gpu_torch_first_then_ours(plan):
    args = ["--gpu", "--rep-ms", "100", "--shape", "170000,384,256,1", "--shape", "170000,384,256,3"]
    lines = plan("bench_retrieval.py", args)
    provs = ["torch", "ours", "ours_excl", "ours_triton", "ours_cuda", "floor"]
    assert lines == [f"retrieval,{p},C=170000,D=384,Q=256,k={k}" for k in (1, 3) for p in provs]
    cpu = plan("bench_retrieval.py", ["--shape", "5000,48,7,3", "--providers", "torch,ours"])
    assert cpu == ["retrieval,torch,C=5000,D=48,Q=7,k=3", "retrieval,ours,C=5000,D=48,Q=7,k=3"]


def test_kv_plan(plan):
    lines = plan("bench_kv_splice.py", ["--gpu"])
    shape = "shape=gpu,layers=32,kv_heads=8,head_dim=128,segs=256,seg_len=128,batch=64"
    assert lines == [f"kv_splice,{p},{shape}" for p in ("rapo_fast", "torch_plain", "reprefill", "copy_floor")]
    quick = plan("bench_kv_splice.py", ["--quick", "--providers", "copy_floor,rapo_fast"])
    assert [ln.split(",")[1] for ln in quick] == ["copy_floor", "rapo_fast"] and "shape=cpu_quick" in quick[0]


@pytest.mark.parametrize(
    "script", ["bench_loss.py", "bench_token_logprobs.py", "bench_retrieval.py", "bench_kv_splice.py"]
)
def test_unknown_provider_is_a_usage_error(load_bench, capsys, script):
    mod = load_bench(script)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--gpu", "--providers", "no_such_provider", "--plan"])
    assert exc.value.code == 2 and "no_such_provider" in capsys.readouterr().err


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_loss_run_takes_the_plan_rows_in_the_given_order(load_bench, monkeypatch, capsys, tmp_path):
    """torch_eager last: the agreement reference (ref_loss) no longer depends on it running first."""
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    mod = load_bench("bench_loss.py")
    args = ["--shape", "48,16,64", "--rep-ms", "5", "--providers", "torch_linear_ce,rapo_fast_hidden,torch_eager"]
    assert mod.main([*args, "--plan"]) == 0
    plan = capsys.readouterr().out.splitlines()
    assert mod.main([*args, "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "loss.csv")
    assert [f"loss,{r['provider']},N={r['N']},H={r['H']},V={r['V']}" for r in rows] == plan
    assert all(r["status"] == "ok" for r in rows), rows
    assert len({r["ref_loss"] for r in rows}) == 1 and float(rows[0]["ref_loss"]) > 0


def test_retrieval_run_takes_the_plan_rows_in_the_given_order(load_bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    mod = load_bench("bench_retrieval.py")
    args = ["--shape", "3000,16,5,3", "--repeats", "1", "--providers", "torch,ours_excl,ours"]
    assert mod.main([*args, "--plan"]) == 0
    plan = capsys.readouterr().out.splitlines()
    assert mod.main([*args, "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "retrieval_cpu.csv")
    assert [f"retrieval,{r['provider']},C={r['C']},D={r['D']},Q={r['Q']},k={r['k']}" for r in rows] == plan
    assert all(r["status"] == "ok" and r["device"] and r["commit"] and r["date"] for r in rows), rows
