"""Tests of the GPU validation (bench/gpu/) on the CPU, so that it is known to work before a GPU ever runs it.

- Both calls run end to end (`--cpu-smoke`) from a fresh copy of the repository with nothing installed for it: only
  PYTHONPATH, the extension built by the call's own CMake step, as on the GPU machine; every file they write is
  declared and flat, and the package, its kernels and its extension were imported from the copy.
- `rapo_fast.kernels` imports from a copy under `python -S` (no site hooks: no editable install's finder at all).
- A step stopped at its budget keeps its rows: a bench's finished rows plus its "interrupted" row; pytest's junit XML
  with the tests that ran.
- `validate.py --dry-run` prints two commands (asked-at and lease left, the deadline taken at the call's start), the
  yield for 1-4 minute starts (both calls within the lease; call 2 past its build check with a 3-minute start), every
  row in the order taken, and call 1 alone brings back a graded row of every path.
- `--record` refuses a smoke run and stamps a GPU run's rows; `pytest --collect-only -m gpu` survives a missing trl.
- A call honours its `--deadline-s` (a step that cannot finish before it is skipped and recorded, later steps that fit
  still run); a call killed from outside keeps the rows it measured and its summary says which step was in flight and
  which never ran; the test step's table counts a test stopped mid-way as interrupted and the tests that never started
  as not run (with and without xdist).

What this is not: a GPU test (nothing here needs a device) nor a test of the benches' numbers (tests/bench/ others).
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
CALLS = sorted(p.stem for p in (ROOT / "bench" / "gpu").glob("call*.py"))
BUDGET_S, MAX_FILES, LEASE_S = 540, 8, 900


def _run(args: list[str], timeout: int = 120, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or os.environ
    )


def _gpu(name: str):
    """The module `name` of bench/gpu/ (not a package: imported from its folder)."""
    sys.path.insert(0, str(GPU))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(GPU))


def _stage(name: str):
    return _gpu(name).STAGE


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _copy_repo(dest: Path) -> Path:
    """The repository's tracked and untracked-not-ignored files, as the device tool sends them: no build, no .git."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    ).stdout.split(b"\0")
    for f in filter(None, files):
        src = ROOT / f.decode()
        if src.is_file():
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f.decode())
    assert not list(dest.glob("rapo_fast/_C*.so")) and (dest / "rapo_fast" / "kernels" / "__init__.py").is_file()
    return dest


def test_the_two_calls_exist():
    assert CALLS == ["call1_headline", "call2_anchors"]


def test_validate_dry_run_two_commands_yield_by_start_and_rows_in_order():
    t0 = time.time()
    res = _run(["bench/gpu/validate.py", "--dry-run"], timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    commands = re.findall(
        r"^command (\d)[^:]*: run\(command='python3 bench/gpu/(\S+)\.py --out \$OUT "
        r"--asked-at (\d+) --lease-left (\S+)', carry=\[\"\.carry\"\], timeout_s=(\d+)\)",
        out,
        re.M,
    )
    assert [c[:2] for c in commands] == [("1", CALLS[0]), ("2", CALLS[1])], out
    # Call 1 asked now with the whole lease; call 2's time and lease are read just before its run (placeholders).
    assert abs(int(commands[0][2]) - t0) < 60 and commands[0][3] == str(LEASE_S) and commands[1][3] == "B2", out
    assert all(BUDGET_S < int(c[4]) <= 600 for c in commands), out  # the tool's limit: 10 minutes a command
    totals = [int(t) for t in re.findall(r"^call \d, \S+: (\d+) s of budgets", out, re.M)]
    assert len(totals) == 2 and all(t < BUDGET_S for t in totals), out
    # The yield for 1-4 minute starts: every call ends inside the lease; with a 3-minute start call 2 runs past its
    # build check.
    table = re.findall(r"^\s+(\d+) s \| .* \| .*,\s+(yes|no) \| (\d+) s of (\d+) s$", out, re.M)
    assert [int(s) for s, *_ in table] == [60, 120, 180, 240], out
    assert all(int(end) <= int(lease) == LEASE_S for _, _, end, lease in table), out
    assert dict((int(s), past) for s, past, *_ in table)[180] == "yes", out
    rows = re.findall(r"^\s+row\s+(\d+)\s+(.*)$", out, re.M)
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1)), out
    text = [r for _, r in rows]
    assert not any("no plan" in r for r in text), out
    # The headline rows come first: ours at V=152k, then log-probs, the paper-scale retrieval, the splice, C=4M.
    assert text[0].startswith("loss,rapo_fast_hidden,") and "V=152064" in text[0], text[:3]
    firsts = [next(i for i, r in enumerate(text) if r.startswith(p)) for p in ("token_logprobs", "retrieval", "kv_")]
    assert firsts == sorted(firsts) and "C=170000" in text[firsts[1]], [text[i] for i in firsts]
    for must in ("loss,torch_compile,", "loss,cce,", "loss,liger,", "sanitizer,memcheck", "sanitizer,racecheck"):
        assert any(r.startswith(must) for r in text), must
    assert any(r.startswith("trainer,RAPO") for r in text)
    graded = re.findall(r"^  (loss|log-probs|retrieval|splice)\s+(\S+)$", out.split("Graded rows call 1")[1], re.M)
    assert [g for g, _ in graded] == ["loss", "log-probs", "retrieval", "splice"], out
    assert not any(row == "MISSING" for _, row in graded), out


def test_call1_alone_grades_every_path_and_call2_holds_the_long_compiles():
    """Call 1: wheels, env, the build, then the headline rows of every path before the tests; what compiles for long
    (torch.compile, Liger, CCE), the sanitizers and the trainer are call 2's, which starts with them."""
    c1, c2 = _stage(CALLS[0]).gpu_steps, _stage(CALLS[1]).gpu_steps
    names = [s.name for s in c1]
    assert names[:4] == ["wheels", "env", "extension", "loss_v152k"], names
    assert names.index("c4m") < names.index("pytest_gpu")
    cmds1 = " ".join(s.cmd for s in c1)
    for bench in ("bench_loss.py", "bench_token_logprobs.py", "bench_retrieval.py", "bench_kv_splice.py"):
        assert bench in cmds1, bench
    providers1 = ",".join(re.findall(r"--providers (\S+)", cmds1)).split(",")
    for heavy in ("torch_compile", "liger", "cce"):
        assert heavy not in providers1 and any(heavy in s.cmd for s in c2), heavy
    for heavy in ("sanitize.py", "rapo_fast.cli demo"):
        assert heavy not in cmds1 and any(heavy in s.cmd for s in c2), heavy
    assert [s.name for s in c2][:4] == ["wheels", "extension", "anchors_v152k", "compile_v152k"]
    assert next(s for s in c1 if s.name == "env").budget_s >= 30  # a cold `import torch` has taken over 20 s


def test_extension_budget_follows_a_carried_build(tmp_path, monkeypatch):
    """A carried .so is copied and imported (a short budget); without one the step builds for sm_90a (35-60 s on a
    fresh 16-core machine), and gets a build's budget."""
    _steps = _gpu("_steps")
    monkeypatch.setattr(_steps, "ROOT", tmp_path)
    built = _steps.extension(copy_back=False).budget_s
    (tmp_path / ".carry" / "ext").mkdir(parents=True)
    (tmp_path / ".carry" / "ext" / "_C.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    carried = _steps.extension(copy_back=False).budget_s
    assert built == _steps.EXT_BUILD_S >= 60 and carried == _steps.EXT_CARRIED_S < built


@pytest.mark.parametrize("name", CALLS)
def test_dry_run_within_budget_and_files(name):
    res = _run([f"bench/gpu/{name}.py", "--dry-run"], timeout=120)
    assert res.returncode == 0, res.stderr
    budgets = [int(s) for s in re.findall(r"budget: (\d+) s", res.stdout)]
    files = [(int(n), names.split(", ")) for n, names in re.findall(r"files: (\d+) \(limit \d+\): (.*)", res.stdout)]
    assert len(budgets) == 2 and len(files) == 2, res.stdout  # the GPU steps and the smoke steps
    assert budgets[0] < BUDGET_S, res.stdout  # the smoke run has no device-tool command to fit
    for n, names in files:
        assert n == len(names) <= MAX_FILES and all("/" not in f for f in names), res.stdout


def test_kernels_import_from_a_copy_without_any_install(tmp_path):
    """`python -S`: no site hooks, so no editable install's finder; the site-packages folders are plain PYTHONPATH
    entries (torch, triton) and the copy comes first. The Triton kernels must import from the copy."""
    copy = _copy_repo(tmp_path / "repo")
    paths = [str(copy)] + [p for p in site.getsitepackages() if Path(p).is_dir()]
    code = (
        "import rapo_fast, rapo_fast.kernels.loss.policy_loss as k, rapo_fast.kernels.retrieval.search as s; "
        "print(rapo_fast.__file__); print(k.__file__); print(s.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=":".join(paths))
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    files = res.stdout.split()
    assert len(files) == 3 and all(f.startswith(str(copy)) for f in files), res.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """Both calls' --cpu-smoke, one after the other, from a fresh copy with only PYTHONPATH set: call 1's extension
    step builds the CPU backend into the copy with CMake (as call 1 builds the CUDA one on the GPU machine), and call 2
    uses that build (as it uses the carried one there). name -> dict(rc, stdout, out, copy)."""
    root = tmp_path_factory.mktemp("gpu_calls")
    copy = _copy_repo(root / "repo")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(copy)
    results, t0 = {}, time.perf_counter()
    for name in CALLS:
        cmd = [sys.executable, f"bench/gpu/{name}.py", "--cpu-smoke", str(root / name)]
        with (root / f"{name}.stdout").open("w") as log:  # a file, not a pipe: a full pipe would block the run
            # every step's budget plus its grace: the backstop of a runner that would not stop
            limit = sum(s.budget_s + 15 for s in _stage(name).smoke_steps) + 60
            rc = subprocess.run(cmd, cwd=copy, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
        results[name] = dict(rc=rc, stdout=(root / f"{name}.stdout").read_text(), out=root / name, copy=copy)
    print(f"two --cpu-smoke runs from a copy in {time.perf_counter() - t0:.0f} s")
    return results


@pytest.mark.parametrize("name", CALLS)
def test_cpu_smoke_from_a_copy_runs_end_to_end(name, smoke):
    r, stage = smoke[name], _stage(name)
    assert r["rc"] == 0, r["stdout"][-3000:] + (r["out"] / f"{name}.log").read_text()[-5000:]
    written = sorted(p.name for p in r["out"].iterdir())
    assert all(p.is_file() for p in r["out"].iterdir()), written  # flat: the device tool returns 2 levels at most
    assert set(written) <= set(stage.files(stage.smoke_steps)) and len(written) <= MAX_FILES, written
    summary = (r["out"] / f"{name}_summary.txt").read_text()
    assert "mode: cpu-smoke" in summary and "missing" not in summary, summary
    assert r["stdout"].rstrip().endswith(summary.rstrip().splitlines()[-1])  # the table is printed last
    for csv_name in stage.table:
        with (r["out"] / csv_name).open() as f:
            rows = list(csv.DictReader(f))
        bad = ("error", "DISAGREES", "interrupted")
        ok = [x for x in rows if not str(x.get("status", "")).startswith(bad + ("unavailable",))]
        assert ok and not any(str(x.get("status", "")).startswith(bad) for x in rows), (csv_name, rows)
    # Imported from the copy: the package, its Triton kernels (no install maps them) and the extension it built.
    log = (r["out"] / f"{name}.log").read_text()
    assert log.count("check interpreter:") == 1, log  # the extension step imports torch once (built, or found)
    copy = str(r["copy"])
    for what in ("rapo_fast from", "rapo_fast.kernels from", "rapo_fast._C from"):
        found = re.findall(rf"^{re.escape(what)}: (\S+)$", log, re.M)  # the last: after the extension step
        assert found and found[-1].startswith(copy), (what, found, copy)


def test_a_step_stopped_at_its_budget_keeps_its_rows(tmp_path):
    """The runner's own stop: a bench step and a pytest step each get SIGINT at their budget. The bench keeps the
    rows it finished and writes an interrupted row; pytest writes its junit XML with the test that passed."""
    st = _gpu("_stage")
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_fast():\n    assert 1 + 1 == 2\n\ndef test_slow():\n    time.sleep(120)\n"
    )
    providers = "torch_eager,rapo_fast_hidden,rapo_fast_logits,torch_linear_ce,rapo_fast_hidden_2pass"
    bench = f"{{py}} bench/bench_loss.py --out {{out}} --shape 48,16,64 --rep-ms 6000 --providers {providers}"
    pytest_cmd = f"{{py}} -m pytest -q -p no:cacheprovider --junitxml={{out}}/junit.xml {tmp_path}/test_slow.py"
    stage = st.Stage(
        "killed", "a bench and pytest stopped at their budgets", [], [], {"loss.csv": ["provider", "status"]}
    )
    steps = [st.Step("bench", bench, 25, ("loss.csv",)), st.Step("pytest", pytest_cmd, 20, ("junit.xml",))]
    t0 = time.perf_counter()
    rc = st.run(stage, steps, tmp_path / "out", smoke=True)
    assert rc == 1 and time.perf_counter() - t0 < 25 + 20 + 2 * 15 + 20
    summary = (tmp_path / "out" / "killed_summary.txt").read_text()
    assert re.search(r"step bench\s+TIMEOUT", summary) and re.search(r"step pytest\s+TIMEOUT", summary), summary
    rows = _rows(tmp_path / "out" / "loss.csv")
    statuses = [r["status"] for r in rows]
    assert statuses[-1].startswith("interrupted"), statuses
    assert statuses[:-1] and all(s == "ok" for s in statuses[:-1]), statuses  # finished rows kept, well formed
    assert all(r["device"] and r["date"] and r["median_ms"] for r in rows[:-1]), rows
    junit = (tmp_path / "out" / "junit.xml").read_text()
    assert 'name="test_fast"' in junit, junit


def test_record_refuses_smoke_and_stamps_gpu_rows(smoke, tmp_path):
    name = CALLS[0]
    src = smoke[name]["out"]
    res = _run([f"bench/gpu/{name}.py", "--record", str(src), "--results", str(tmp_path / "r")])
    assert res.returncode != 0 and "not a GPU run" in res.stderr + res.stdout
    assert not (tmp_path / "r").exists()
    # The same files as if a GPU had made them, with no commit (the GPU machine has no .git): recorded, stamped.
    gpu = tmp_path / "gpu"
    shutil.copytree(src, gpu)
    summary = gpu / f"{name}_summary.txt"
    summary.write_text(summary.read_text().replace("mode: cpu-smoke", "mode: gpu"))
    for f in ("loss.csv", "token_logprobs.csv", "retrieval_gpu.csv", "kv_splice.csv"):
        text = (gpu / f).read_text()
        dev = next(csv.DictReader(text.splitlines()))["device"]
        (gpu / f).write_text(re.sub(r",[0-9a-f]{12}(-dirty)?(,|$)", r",unknown\2", text.replace(dev, "NVIDIA H100")))
    (gpu / "pytest_gpu.csv").unlink()  # its rows have no device column; recorded by the same code, not needed here
    res = _run([f"bench/gpu/{name}.py", "--record", str(gpu), "--results", str(tmp_path / "r"), "--commit", "c0"])
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
    """`pytest --collect-only -m gpu` as the GPU call runs it, with trl absent, or trl present and datasets absent
    (then `import trl` works and `from trl import GRPOTrainer` raises): no collection error, the module skipped."""
    (tmp_path / "_hide_modules.py").write_text(HIDE_PLUGIN)
    env = dict(os.environ, RAPO_TEST_HIDE=hidden, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    args = ["-m", "pytest", "-p", "_hide_modules", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu", "-q"]
    res = _run([*args, "-rs", "tests"], timeout=300, env=env)
    tail = res.stdout[-2000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert "error" not in res.stdout.splitlines()[-1].lower(), tail
    assert re.search(r"SKIPPED \[1\] tests/integrations/test_integration_trl.py:\d+: .*trl", res.stdout), tail


DEADLINE_BENCH = (
    "{py} bench/bench_loss.py --out {out} --no-plot --shape 48,16,64 --rep-ms 5 --providers torch_eager,torch_linear_ce"
)


def test_deadline_skips_what_cannot_finish_and_runs_what_fits(tmp_path):
    st = _gpu("_stage")
    stage = st.Stage("dl", "deadline", [], [], {"loss.csv": ["provider", "status"]})
    steps = [
        st.Step("bench", DEADLINE_BENCH, 60, ("loss.csv",)),
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
    code = KILLED_CALL.format(gpu=str(GPU), bench=DEADLINE_BENCH, out=str(out))
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
    junit_table = _gpu("junit_table")
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
