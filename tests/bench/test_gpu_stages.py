"""Tests of the staged GPU validation scripts (bench/gpu/) on the CPU, so that they are known to work before a GPU
ever runs them: every stage's --dry-run stays within 8 minutes of budget and 6 output files; every stage's
--cpu-smoke runs end to end (the four at once, into a tmp folder) and writes only the files it declares, flat, with
its table last; --record refuses a smoke run and stamps a GPU run's rows; and `pytest --collect-only -m gpu` collects
without error when trl, or only trl's `datasets`, cannot be imported (the GPU image lacks them unless carried).

What this is not: a GPU test (nothing here needs a device) nor a test of the benches' numbers (tests/bench/ others).
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = sorted(p.stem for p in (ROOT / "bench" / "gpu").glob("stage*.py"))
BUDGET_S, MAX_FILES = 480, 6


def _run(args: list[str], timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or os.environ
    )


def _stage(name: str):
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    try:
        return __import__(name).STAGE
    finally:
        sys.path.remove(str(ROOT / "bench" / "gpu"))


def test_the_four_stages_exist():
    assert STAGES == ["stage1_build_test", "stage2_loss", "stage3_retrieval", "stage4_kv_train"]


@pytest.mark.parametrize("name", STAGES)
def test_dry_run_within_budget_and_files(name):
    res = _run([f"bench/gpu/{name}.py", "--dry-run"], timeout=60)
    assert res.returncode == 0, res.stderr
    budgets = [int(s) for s in re.findall(r"budget: (\d+) s", res.stdout)]
    files = [(int(n), names.split(", ")) for n, names in re.findall(r"files: (\d+) \(limit \d+\): (.*)", res.stdout)]
    assert len(budgets) == 2 and len(files) == 2, res.stdout  # the GPU steps and the smoke steps
    assert max(budgets) <= BUDGET_S, res.stdout
    for n, names in files:
        assert n == len(names) <= MAX_FILES and all("/" not in f for f in names), res.stdout
    assert res.stdout.count(" budget ") >= 4  # every step listed with its own budget


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """Every stage's --cpu-smoke, two at a time (most of each run is process start-up and imports, on few cores);
    name -> dict(rc, stdout, out)."""
    root = tmp_path_factory.mktemp("gpu_stages")
    queue = sorted(STAGES, key=lambda n: ("stage4" not in n, "stage2" not in n, n))  # the longest first
    running, results, t0 = {}, {}, time.perf_counter()
    while queue or running:
        while queue and len(running) < 2:
            name = queue.pop(0)
            cmd = [sys.executable, f"bench/gpu/{name}.py", "--cpu-smoke", str(root / name)]
            with (root / f"{name}.stdout").open("w") as log:  # a file, not a pipe: a full pipe would block the run
                running[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        done = next((n for n, p in running.items() if p.poll() is not None), None)
        if done is None:
            time.sleep(0.2)
            assert time.perf_counter() - t0 < 900, f"smoke runs still running after 15 min: {list(running)}"
            continue
        p = running.pop(done)
        results[done] = dict(rc=p.returncode, stdout=(root / f"{done}.stdout").read_text(), out=root / done)
    print(f"four --cpu-smoke runs in {time.perf_counter() - t0:.0f} s")
    return results


@pytest.mark.parametrize("name", STAGES)
def test_cpu_smoke_runs_end_to_end(name, smoke):
    r, stage = smoke[name], _stage(name)
    assert r["rc"] == 0, r["stdout"][-3000:]
    written = sorted(p.name for p in r["out"].iterdir())
    assert all(p.is_file() for p in r["out"].iterdir()), written  # flat: the device tool returns 2 levels at most
    assert set(written) <= set(stage.files(stage.smoke_steps)) and len(written) <= MAX_FILES, written
    summary = (r["out"] / f"{name}_summary.txt").read_text()
    assert "mode: cpu-smoke" in summary and "missing" not in summary, summary
    assert r["stdout"].rstrip().endswith(summary.rstrip().splitlines()[-1])  # the table is printed last
    for csv_name in stage.table:
        with (r["out"] / csv_name).open() as f:
            rows = list(csv.DictReader(f))
        assert rows and not any(str(x.get("status", "")).startswith(("error", "DISAGREES")) for x in rows), rows


def test_record_refuses_smoke_and_stamps_gpu_rows(smoke, tmp_path):
    src = smoke["stage2_loss"]["out"]
    res = _run(["bench/gpu/stage2_loss.py", "--record", str(src), "--results", str(tmp_path / "r")])
    assert res.returncode != 0 and "not a GPU run" in res.stderr + res.stdout
    assert not (tmp_path / "r").exists()
    # The same files as if a GPU had made them, with no commit (the GPU machine has no .git): recorded, stamped.
    gpu = tmp_path / "gpu"
    shutil.copytree(src, gpu)
    summary = gpu / "stage2_loss_summary.txt"
    summary.write_text(summary.read_text().replace("mode: cpu-smoke", "mode: gpu"))
    for f in ("loss.csv", "token_logprobs.csv"):
        text = (gpu / f).read_text()
        dev = next(csv.DictReader(text.splitlines()))["device"]
        (gpu / f).write_text(re.sub(r",[0-9a-f]{12}(-dirty)?(,|$)", r",unknown\2", text.replace(dev, "NVIDIA H100")))
    res = _run(["bench/gpu/stage2_loss.py", "--record", str(gpu), "--results", str(tmp_path / "r"), "--commit", "c0"])
    assert res.returncode == 0, res.stderr
    with (tmp_path / "r" / "loss_gpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["device"] == "NVIDIA H100" and r["commit"] == "c0" and r["date"] for r in rows), rows
    assert (tmp_path / "r" / "token_logprobs_gpu.csv").exists()


HIDE_PLUGIN = """
import importlib.abc, os, sys

HIDDEN = set(os.environ["RAPO_TEST_HIDE"].split(","))


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, _Hide())
"""


@pytest.mark.parametrize("hidden", ["trl", "datasets"])
def test_collect_only_gpu_survives_missing_optional_imports(hidden, tmp_path):
    """`pytest --collect-only -m gpu` as the GPU stage runs it, with trl absent, or trl present and datasets absent
    (then `import trl` works and `from trl import GRPOTrainer` raises): no collection error, the module skipped."""
    (tmp_path / "_hide_modules.py").write_text(HIDE_PLUGIN)
    env = dict(os.environ, RAPO_TEST_HIDE=hidden, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    args = ["-m", "pytest", "-p", "_hide_modules", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu", "-q"]
    res = _run([*args, "-rs", "tests"], timeout=300, env=env)
    tail = res.stdout[-2000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert "error" not in res.stdout.splitlines()[-1].lower(), tail
    assert re.search(r"SKIPPED \[1\] tests/integrations/test_integration_trl.py:\d+: .*trl", res.stdout), tail
