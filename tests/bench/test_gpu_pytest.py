"""Tests of the GPU call's test step on the CPU: the table it brings back when pytest never wrote its junit XML (a
partial progress file keeps the failed and the passed tests), the table the progress plugin streams into the output
folder (a pytest killed with SIGKILL mid-run leaves it), and the GPU call's xdist scheduler (bench/gpu/
pytest_gpu_scope.py): a file's tests on one worker, the gpu_spread cases over all of them.

What this is not: a GPU test (the dummy tests here need no device) nor a test of the runner (test_gpu_stages.py).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


def _gpu_module(name: str):
    """The module `name` of bench/gpu/ (not a package: imported from its folder)."""
    sys.path.insert(0, str(GPU))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(GPU))


def _junit_table():
    return _gpu_module("junit_table")


def _counts(table: list[dict]) -> dict[str, int]:
    return {r["outcome"]: int(r["count"]) for r in table if r.get("count") not in (None, "")}


def test_a_partial_progress_file_without_xml_keeps_failed_and_passed_tests(tmp_path):
    """The progress file of a pytest killed before its XML: every test that reported keeps its outcome (a failed
    call stays failed, a failed setup is an error, a skip a skip), the one in flight is interrupted, the rest not run,
    and the last line cut mid-write is ignored."""
    ids = [f"tests/x/test_m.py::test_{c}" for c in "abcdef"]
    events = [dict(event="collected", nodeid=n) for n in ids]
    events += [
        dict(event="start", nodeid=ids[0]),
        dict(event="report", nodeid=ids[0], when="setup", outcome="passed"),
        dict(event="report", nodeid=ids[0], when="call", outcome="passed", seconds="0.010"),
        dict(event="report", nodeid=ids[0], when="teardown", outcome="passed"),
        dict(event="start", nodeid=ids[1]),
        dict(event="report", nodeid=ids[1], when="setup", outcome="passed"),
        dict(event="report", nodeid=ids[1], when="call", outcome="failed", message="E   assert 1 == 2"),
        dict(event="report", nodeid=ids[1], when="teardown", outcome="passed"),
        dict(event="start", nodeid=ids[2]),
        dict(event="report", nodeid=ids[2], when="setup", outcome="failed", message="E   RuntimeError: no memory"),
        dict(event="start", nodeid=ids[3]),
        dict(event="report", nodeid=ids[3], when="setup", outcome="skipped", message="Skipped: needs trl"),
        dict(event="start", nodeid=ids[4]),
        dict(event="report", nodeid=ids[4], when="setup", outcome="passed"),
    ]
    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "rep')
    jt = _junit_table()
    table = jt.rows(tmp_path / "never_written.xml", progress)
    counts = _counts(table)
    assert counts == {"passed": 1, "failed": 1, "error": 1, "skipped": 1, "interrupted": 1, "not run": 1}, table
    by_test = {r["test"]: r for r in table if r.get("test")}
    assert by_test["test_m::test_b"]["outcome"] == "failed" and "assert 1 == 2" in by_test["test_m::test_b"]["message"]
    assert by_test["test_m::test_c"]["outcome"] == "error" and by_test["test_m::test_e"]["outcome"] == "interrupted"
    assert by_test["test_m::test_f"]["outcome"] == "not run" and "test_m::test_a" not in by_test  # passed: counted
    jt.write(tmp_path / "pytest_gpu.csv", table)  # the CSV the call brings back holds the same rows
    with (tmp_path / "pytest_gpu.csv").open() as f:
        assert list(csv.DictReader(f))[: len(counts)] == [
            dict(outcome=k, count=str(v), test="", seconds="", message="") for k, v in sorted(counts.items())
        ]


STREAMED = """
import time

def test_pass():
    pass

def test_fail():
    assert 1 == 2, "wrong on purpose"

def test_slow():
    time.sleep(300)

def test_never():
    pass
"""


def test_the_streamed_table_survives_a_sigkill(tmp_path):
    """pytest with the progress plugin and RAPO_FAST_PYTEST_TABLE, killed with SIGKILL (as the device tool's limit
    kills a call) while test_slow runs, and no XML asked for: the table in the output folder counts the passed and the
    failed test, with the failure's message, the one in flight as interrupted and the last as not run."""
    (tmp_path / "test_streamed.py").write_text(STREAMED)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(
        os.environ,
        RAPO_FAST_PYTEST_PROGRESS=str(tmp_path / "progress.jsonl"),
        RAPO_FAST_PYTEST_TABLE=str(out / "pytest_gpu.csv"),
        PYTHONPATH=f"{GPU}:{os.environ.get('PYTHONPATH', '')}",
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_progress", "test_streamed.py"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        progress = tmp_path / "progress.jsonl"
        while '"start", "nodeid": "test_streamed.py::test_slow"' not in (
            progress.read_text() if progress.exists() else ""
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "pytest ended or hung before test_slow"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with (out / "pytest_gpu.csv").open() as f:
        table = list(csv.DictReader(f))
    assert _counts(table) == {"passed": 1, "failed": 1, "not run": 2}, table  # written when test_fail ended
    failed = [r for r in table if r["outcome"] == "failed" and r["test"]]
    assert len(failed) == 1 and failed[0]["test"].endswith("test_fail") and "wrong on purpose" in failed[0]["message"]
    # The file the call brings back, read with the progress that followed: test_slow was in flight.
    assert _counts(_junit_table().rows(None, tmp_path / "progress.jsonl"))["interrupted"] == 1


SCOPED = """
import os
import time
import pytest

def _record(name):
    time.sleep(0.3)  # long enough for the other process to take work
    with open(os.path.join(os.environ["WORKERS_OUT"], name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main"))

@pytest.mark.parametrize("i", range(4))
def test_t(i):
    _record("{name}-%d" % i)
"""
SPREAD = """
import pytest
from test_one import _record

@pytest.mark.gpu_spread
@pytest.mark.parametrize("i", range(6))
def test_compiles(i):
    _record("spread-%d" % i)

class TestHeavy:
    def test_h(self):
        _record("heavy-0")
"""


def test_spread_scope_follows_the_marker_in_the_source(tmp_path):
    scope = _gpu_module("pytest_gpu_scope")
    (tmp_path / "test_a.py").write_text(SPREAD)
    (tmp_path / "test_b.py").write_text("import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.gpu_spread]\n")
    assert scope.scope("test_a.py::test_compiles[3]", tmp_path) == "test_a.py::test_compiles[3]"
    assert scope.scope("test_a.py::TestHeavy::test_h", tmp_path) == "test_a.py"
    assert scope.scope("test_b.py::test_x", tmp_path) == "test_b.py::test_x"  # the whole module marked
    assert scope.scope("test_missing.py::test_x", tmp_path) == "test_missing.py"


def test_xdist_keeps_a_file_on_one_worker_and_spreads_gpu_spread(tmp_path):
    """The GPU call's xdist options (`-n 2 --dist loadscope -p pytest_gpu_scope`) on dummy CPU tests: each file's tests
    run on one worker, the gpu_spread cases on both. The scheduler reads node ids only, so this holds on pytest 9.2 too
    (where xdist_group markers do nothing)."""
    pytest.importorskip("xdist")
    for name in ("test_one", "test_two"):
        (tmp_path / f"{name}.py").write_text(SCOPED.replace("{name}", name))
    (tmp_path / "test_spread.py").write_text(SPREAD)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu_spread: spread\n")
    (tmp_path / "workers").mkdir()
    env = dict(
        os.environ, WORKERS_OUT=str(tmp_path / "workers"), PYTHONPATH=f"{GPU}:{os.environ.get('PYTHONPATH', '')}"
    )
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadscope", "-p", "pytest_gpu_scope", "."]
    res = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    workers: dict[str, list[str]] = {}
    for f in sorted((tmp_path / "workers").iterdir()):
        workers.setdefault(f.name.split("-")[0], []).append(f.read_text())
    assert {k: len(v) for k, v in workers.items()} == {"test_one": 4, "test_two": 4, "spread": 6, "heavy": 1}, workers
    assert all(len(set(workers[k])) == 1 for k in ("test_one", "test_two")), workers  # a file on one worker
    assert set(workers["spread"]) == {"gw0", "gw1"}, workers  # the marked cases on both
