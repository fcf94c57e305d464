"""Fault injection: every save format killed with SIGKILL before each of its filesystem writes in
turn, halfway through each of its os.write calls, and at random moments of a larger save.

A forked child moves nothing but its own save: it wraps os.open (for writing), os.write, os.fsync, os.replace,
os.rename, os.mkdir, os.unlink, os.remove and os.rmdir to count the calls and SIGKILLs itself at call n (the dry run
first checks that these are the save's only writes: no write through open()). After each kill, `load` must return
the old state or the new one, bit for bit (a fingerprint of every field), or, only when no complete version existed
before (a first save), the format's own error. Then the next save must succeed, load back the new state, and leave
in the directory nothing but CURRENT, LOCK and the live version, plus the entries no save wrote (which it must not
touch). Formats: StepBuffer, StepTraces, StepTraces with a StepKVStore (the K/V store's format), trainer checkpoint.
Not here: corruption of files at rest and the schema checks (test_save_formats.py).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import random
import shutil
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest
import reliability_states as rs
import torch

WRITES = ("open", "write", "fsync", "replace", "rename", "mkdir", "unlink", "remove", "rmdir")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
FOREIGN = ("snapshot-foreign", "traces-notes", ".user.tmp")  # entries a user put there: no save may touch them


def _install_killer(kill_at: int, torn: bool, log: list[str]) -> None:
    """In the child: count the filesystem writes in `log`; SIGKILL this process before write number `kill_at`
    (torn: an os.write is cut in half, its first half written)."""
    for name in WRITES:
        real = getattr(os, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            if _name == "open" and not ((args[1] if len(args) > 1 else kwargs.get("flags", 0)) & _WRITE_FLAGS):
                return _real(*args, **kwargs)
            log.append(_name)
            if len(log) == kill_at:
                if torn and _name == "write" and len(args[1]) > 1:
                    _real(args[0], memoryview(args[1])[: len(args[1]) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args, **kwargs)

        setattr(os, name, wrapper)

    def no_write_open(file, mode="r", *a, _real=builtins.open, **k):
        if any(c in mode for c in "wax+"):
            log.append(f"UNCOUNTED open({file!r}, {mode!r})")
        return _real(file, mode, *a, **k)

    builtins.open = io.open = no_write_open


def _in_child(save, directory: Path, kill_at: int = 0, torn: bool = False, delay: float | None = None) -> dict:
    """Fork; the child saves into `directory` under the killer (kill_at 0: never) or a timer (`delay` seconds).
    Returns {"killed": bool, "log": the writes counted (when the child finished)}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            torch.set_num_threads(1)
            log: list[str] = []
            _install_killer(kill_at, torn, log)
            if delay is not None:
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            save(directory)
            os.write(w, json.dumps(log).encode())
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the saving child hung (kill_at={kill_at})")
        time.sleep(0.002)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return {"killed": True, "log": None}
    assert os.WEXITSTATUS(status) == 0, f"the saving child failed (kill_at={kill_at}; its traceback is above)"
    return {"killed": False, "log": json.loads(out)}


def _ours(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} - set(FOREIGN)


def _check_next_save(case: rs.Case, d: Path, new_fp: bytes) -> None:
    """The save after a kill works, and leaves CURRENT, LOCK and the live version (and the foreign entries)."""
    case.save(d)
    assert rs.loaded_fp(case, d) == new_fp
    assert _ours(d) == {"CURRENT", "LOCK", rs.live(d).name}, f"left behind: {_ours(d)}"
    assert all((d / n).exists() for n in FOREIGN if (d.parent / "template" / n).exists())


def _prepare(case: rs.Case, tmp_path: Path) -> tuple[Path, bytes, bytes]:
    """Save the old state into tmp_path/template (with foreign entries beside it), then advance to the new one."""
    template = tmp_path / "template"
    old_fp = case.fp(case.obj)
    case.save(template)
    assert rs.loaded_fp(case, template) == old_fp  # the round trip is exact
    (template / FOREIGN[0]).mkdir()
    (template / FOREIGN[1]).write_text("not ours")
    (template / FOREIGN[2]).write_text("not ours either")
    case.advance()
    new_fp = case.fp(case.obj)
    assert new_fp != old_fp
    return template, old_fp, new_fp


def _kill_everywhere(case: rs.Case, tmp_path: Path, over_old: bool) -> int:
    """Kill a save of the new state before each of its writes (and halfway through each os.write); check each."""
    template, old_fp, new_fp = _prepare(case, tmp_path)
    if over_old:  # the same starting point as the kills: a save over the old one also removes it
        shutil.copytree(template, tmp_path / "dry")
    dry = _in_child(case.save, tmp_path / "dry")
    writes = dry["log"]
    assert not dry["killed"] and writes, "the dry run counted no write"
    assert not [w for w in writes if w.startswith("UNCOUNTED")], f"writes the injection cannot see: {writes}"
    runs = [(n, False) for n in range(1, len(writes) + 1)] + [
        (n, True) for n, w in enumerate(writes, 1) if w == "write"
    ]
    for n, torn in runs:
        d = tmp_path / f"kill{n}{'t' if torn else ''}"
        if over_old:
            shutil.copytree(template, d)
        res = _in_child(case.save, d, kill_at=n, torn=torn)
        assert res["killed"], f"write {n} ({writes[n - 1]}) was not reached"
        got = rs.loaded_fp(case, d)
        allowed = {old_fp, new_fp} if over_old else {None, new_fp}
        assert got in allowed, f"{case.name}: killed before write {n} ({writes[n - 1]}, torn={torn}): " + (
            "no loadable version" if got is None else "a state that is neither the old nor the new one"
        )
        if over_old:
            _check_next_save(case, d, new_fp)
        shutil.rmtree(d, ignore_errors=True)
    return len(runs)


@pytest.mark.parametrize("kind", ["StepBuffer", "StepTraces", "StepTraces+StepKVStore", "checkpoint"])
def test_kill_before_each_write(kind, work):
    assert _kill_everywhere(rs.case(kind, work), work / "over", over_old=True) > 10


def test_kill_during_a_first_save(work):
    """Into an empty directory: before the switch no complete version exists, so the format's error is allowed."""
    case = rs.traces_case(with_kv=True)
    assert _kill_everywhere(case, work, over_old=False) > 10


@pytest.mark.parametrize("kind", ["StepBuffer", "StepTraces+StepKVStore"])
def test_kill_at_random_moments_of_a_larger_save(kind, work):
    """A few MB saved; the child kills itself after a random delay within the save's duration (writes are torn
    wherever the kill lands)."""
    if kind == "StepBuffer":
        case = rs.buffer_case(capacity=40_000, dim=32, n_old=30_000, n_new=20_000)
    else:
        case = rs.traces_case(with_kv=True, capacity=256, n_old=200, n_new=150)
    template, old_fp, new_fp = _prepare(case, work)
    t0 = time.perf_counter()
    case.save(work / "timed")
    took = time.perf_counter() - t0
    rng, killed = random.Random(11), 0
    for i in range(8):
        d = work / f"r{i}"
        shutil.copytree(template, d)
        killed += _in_child(case.save, d, delay=rng.uniform(0.0, 1.2 * took))["killed"]
        assert rs.loaded_fp(case, d) in {old_fp, new_fp}, f"{case.name}: random kill {i}"
        _check_next_save(case, d, new_fp)
        shutil.rmtree(d)
    assert killed >= 2, f"only {killed} of 8 saves were killed before they finished (the save took {took:.3f} s)"
