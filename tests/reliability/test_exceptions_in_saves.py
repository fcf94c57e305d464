"""Exceptions inside a save: every save format has an exception raised at each of its file-system calls in turn, and
afterwards the previous state or the new one loads, never neither; then a plain save works and leaves the directory
clean.

The exceptions are those a live process meets: an OSError from the call itself (EIO, EMFILE; raised instead of the
call, once, or from then on for every call), and a KeyboardInterrupt or SystemExit (Ctrl-C, a SIGTERM handler's
sys.exit) arriving just after the call returned: after the os.replace that switches CURRENT, in particular, the new
version is live and must stay. The calls counted: os.open, write, fsync, close, replace, rename, mkdir, unlink,
rmdir, stat, lstat and scandir (pathlib and shutil go through them). Formats: StepBuffer, StepTraces (with and without
a StepKVStore), trainer checkpoint, TrainerConfig file, trajectory JSONL.
Not here: SIGKILL at each write (test_fault_injection.py), corruption at rest (test_save_formats.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

import pytest
import reliability_states as rs

CALLS = ("open", "write", "fsync", "close", "replace", "rename", "mkdir", "unlink", "rmdir", "stat", "lstat", "scandir")
VERSIONED = ("StepBuffer", "StepTraces", "StepTraces+StepKVStore", "checkpoint")
HOW = ("oserror", "persistent", "interrupt")


class _Injected(Exception):
    """Marks the test's own OSError apart from a real one (never raised: OSError instances carry it in strerror)."""


@contextlib.contextmanager
def _faults(at: int, how: str, log: list[str]):
    """Count the calls of CALLS in `log`; at call number `at` (0: never) raise per `how`: "oserror" (instead of the
    call), "persistent" (instead of that call and every later one), "interrupt" (after the call returned: a
    KeyboardInterrupt at odd `at`, a SystemExit at even)."""
    real = {name: getattr(os, name) for name in CALLS}

    def make(name):
        def wrapper(*args, **kwargs):
            log.append(name)
            n = len(log)
            if at and (n == at or (how == "persistent" and n > at)):
                if how in ("oserror", "persistent") and name != "close":
                    raise OSError(errno.EIO, "injected")
                out = real[name](*args, **kwargs)
                if name == "open":  # the interrupted caller never sees the fd: close it here, not leak it
                    real["close"](out)
                raise KeyboardInterrupt if at % 2 else SystemExit(143)
            return real[name](*args, **kwargs)

        return wrapper

    for name in CALLS:
        setattr(os, name, make(name))
    try:
        yield
    finally:
        for name, f in real.items():
            setattr(os, name, f)


@pytest.mark.parametrize(
    "kind", [*VERSIONED[:3], pytest.param("checkpoint", marks=pytest.mark.slow), "TrainerConfig", "trajectory JSONL"]
)
def test_an_exception_at_any_call_of_a_save_keeps_a_loadable_state(kind, work):
    """Each call of the save in turn: an OSError instead of it, and a KeyboardInterrupt or SystemExit after it; for
    the formats whose save is small also an OSError from every call from then on (the cleanup fails too)."""
    tmp_path = work
    case = rs.case(kind, tmp_path)
    template = tmp_path / "template"
    old_fp = case.fp(case.obj)
    case.save(template)
    assert rs.loaded_fp(case, template) == old_fp
    case.advance()
    new_fp = case.fp(case.obj)
    assert new_fp != old_fp
    shutil.copytree(template, tmp_path / "dry")
    calls: list[str] = []
    with _faults(0, "", calls):
        case.save(tmp_path / "dry")
    assert "replace" in calls and len(calls) > 5, calls
    runs = 0
    for at in range(1, len(calls) + 1):
        for how in ("oserror", "interrupt") if kind in ("checkpoint", "StepTraces+StepKVStore") else HOW:
            d = tmp_path / f"{at}{how}"
            shutil.copytree(template, d)
            with contextlib.suppress(OSError, KeyboardInterrupt, SystemExit), _faults(at, how, []):
                case.save(d)
            got = rs.loaded_fp(case, d)
            where = f"{case.name}: {how} at call {at} ({calls[at - 1]})"
            assert got is not None, f"{where}: neither the previous nor the new state loads"
            assert got in (old_fp, new_fp), f"{where}: a state that is neither the previous nor the new one"
            case.save(d)  # the next save works and cleans up after the stopped one
            assert rs.loaded_fp(case, d) == new_fp, where
            if kind in VERSIONED:
                ours = {p.name for p in d.iterdir()}
                assert ours == {"CURRENT", "LOCK", rs.live(d).name}, f"{where}: left behind {ours}"
            shutil.rmtree(d)
            runs += 1
    assert runs >= 15
