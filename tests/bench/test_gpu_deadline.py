"""The GPU calls' time and count guarantees, on the CPU: a call honours its `--deadline-s` (a step that cannot finish
before it is skipped and recorded, later steps that fit still run); a call killed from outside keeps the rows it
measured and its summary says which step was in flight and which never ran; the test step's table counts a test
stopped mid-way as interrupted and the tests that never started as not run (with and without xdist).

What this is not: the end-to-end smoke runs of both calls (test_gpu_stages.py) nor a GPU test.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
BENCH = (
    "{py} bench/bench_loss.py --out {out} --no-plot --shape 48,16,64 --rep-ms 5 --providers torch_eager,torch_linear_ce"
)


def _stage_module():
    sys.path.insert(0, str(GPU))
    try:
        import _stage

        return _stage
    finally:
        sys.path.remove(str(GPU))


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_deadline_skips_what_cannot_finish_and_runs_what_fits(tmp_path):
    st = _stage_module()
    stage = st.Stage("dl", "deadline", [], [], {"loss.csv": ["provider", "status"]})
    steps = [
        st.Step("bench", BENCH, 60, ("loss.csv",)),
        st.Step("long", "sleep 200", 200, ()),  # cannot finish before the deadline: never started
        st.Step("short", "echo ran > {out}/short.txt", 5, ("short.txt",)),
    ]
    t0 = time.monotonic()
    rc = st.run(stage, steps, tmp_path / "out", smoke=True, deadline_s=100)
    took = time.monotonic() - t0
    assert rc == 1 and took < 100, took
    summary = (tmp_path / "out" / "dl_summary.txt").read_text()
    assert re.search(r"step bench\s+ok", summary) and re.search(r"step short\s+ok", summary), summary
    assert re.search(r"step long\s+SKIPPED \(deadline: \d+ s left\)", summary), summary
    assert "deadline: 100 s from the start" in summary and (tmp_path / "out" / "short.txt").exists()
    rows = _rows(tmp_path / "out" / "loss.csv")
    assert rows and all(r["status"] == "ok" for r in rows), rows


KILLED_CALL = """
import sys
sys.path.insert(0, {gpu!r})
import _stage as st
stage = st.Stage("killed", "killed from outside", [], [], {{"loss.csv": ["provider", "status"]}})
steps = [
    st.Step("bench", {bench!r}, 60, ("loss.csv",)),
    st.Step("stuck", "touch {{out}}/stuck_started; sleep 300", 300, ()),
    st.Step("after", "true", 5, ()),
]
st.run(stage, steps, {out!r}, smoke=True, deadline_s=500)
"""


def test_a_call_killed_at_its_deadline_keeps_rows_and_says_what_did_not_run(tmp_path):
    """The device tool's limit kills the whole call (SIGKILL to its process group): the bench's rows stay, the
    summary names the step in flight as running and the next as not run."""
    out = tmp_path / "out"
    code = KILLED_CALL.format(gpu=str(GPU), bench=BENCH, out=str(out))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "stuck_started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the call ended or hung before its 2nd step"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    summary = (out / "killed_summary.txt").read_text()
    assert re.search(r"step bench\s+ok", summary), summary
    assert re.search(r"step stuck\s+running", summary) and re.search(r"step after\s+not run", summary), summary
    rows = _rows(out / "loss.csv")
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), rows


TESTS = """
import time

def test_a():
    pass

def test_b_slow():
    time.sleep(300)

def test_c():
    pass

def test_d():
    pass
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_junit_table_counts_interrupted_and_not_run(tmp_path, xdist):
    """pytest stopped by SIGINT while test_b_slow runs, as a step at its budget is: the XML calls that test passed
    (or leaves it out); the table says interrupted, and counts the tests that never started as not run."""
    if xdist:
        pytest.importorskip("xdist")
    (tmp_path / "test_sample.py").write_text(TESTS)
    progress, xml = tmp_path / "progress.jsonl", tmp_path / "junit.xml"
    env = dict(
        os.environ, RAPO_FAST_PYTEST_PROGRESS=str(progress), PYTHONPATH=f"{GPU}:{os.environ.get('PYTHONPATH', '')}"
    )
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_progress",
        "-p",
        "no:randomly",
    ]
    args += ["-n", "2"] if xdist else []
    args += [f"--junitxml={xml}", str(tmp_path / "test_sample.py")]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while '"start", "nodeid": "test_sample.py::test_b_slow"' not in (progress.read_text() if progress.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
        time.sleep(0.2)
    time.sleep(1.0)  # let the other tests run where they can
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    sys.path.insert(0, str(GPU))
    try:
        import junit_table
    finally:
        sys.path.remove(str(GPU))
    table = junit_table.rows(xml, progress)
    counts = {r["outcome"]: int(r["count"]) for r in table if r.get("count") not in (None, "")}
    assert sum(counts.values()) == 4, table  # every collected test counted once
    assert counts.get("interrupted") == 1, table
    slow = [r for r in table if r.get("test", "").endswith("test_b_slow")]
    assert len(slow) == 1 and slow[0]["outcome"] == "interrupted", table
    if not xdist:  # in order: a passed, b interrupted, c and d never started
        assert counts == {"passed": 1, "interrupted": 1, "not run": 2}, table
    # Without the progress file the same XML cannot tell: the table says so instead of counting.
    blind = junit_table.rows(xml, None)
    assert any(r["outcome"] == "progress unknown" for r in blind), blind
