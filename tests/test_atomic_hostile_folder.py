"""Saves and loads never follow what someone else put in the folder, never block, and a full disk
inside torch.save is an OSError naming the file.

A planted `.PENDING.tmp` / `.CURRENT.tmp` symlink once made a save truncate the file it points to (the temporary was
opened with O_TRUNC and without O_NOFOLLOW); a named pipe at CURRENT or LOCK made a load block forever; a failed write
inside torch.save surfaced as torch's "unexpected pos" RuntimeError. Each test here failed on 3f95cb9. Every save
format goes through rapo_fast/_atomic.py, so the StepBuffer format stands for all of them. Not here: kills during a
save (tests/reliability/test_fault_injection.py).
"""

from __future__ import annotations

import errno
import os
import threading
import types
from pathlib import Path

import pytest
import torch

from rapo_fast import StepBuffer, _atomic
from rapo_fast._atomic import VersionWriter
from rapo_fast.retrieval.io import StepBufferFormatError

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX only (named pipes, O_NOFOLLOW)")
TIMEOUT_S = 20.0


def _buffer() -> StepBuffer:
    torch.manual_seed(0)
    buf = StepBuffer(16, 4, metric="l2")
    buf.add(torch.randn(5, 4), torch.arange(5), torch.arange(5))
    return buf


def _bounded(fn):
    """Run fn in a thread; fail (instead of hanging the suite) when it has not returned within TIMEOUT_S."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(TIMEOUT_S)
    return t.is_alive(), out


def _unblock(fifo: Path) -> None:
    """Open the pipe for writing once, so that a reader blocked on it (a failure of this test) returns."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("name", [".PENDING.tmp", ".CURRENT.tmp"])
@pytest.mark.parametrize("first_save", [True, False])
def test_planted_temporary_symlink_is_not_followed(tmp_path, name, first_save):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    d = tmp_path / "buf"
    buf = _buffer()
    if not first_save:
        buf.save(d)
    d.mkdir(exist_ok=True)
    (d / name).symlink_to(victim)
    buf.save(d)
    assert victim.read_text() == "precious\n"
    assert not (d / name).is_symlink()
    assert len(StepBuffer.load(d)) == len(buf)


@pytest.mark.parametrize("name", ["CURRENT", "LOCK"])
def test_named_pipe_refused_by_load_without_blocking(tmp_path, name):
    d = tmp_path / "buf"
    _buffer().save(d)
    os.unlink(d / name)
    os.mkfifo(d / name)
    try:
        hung, out = _bounded(lambda: StepBuffer.load(d))
    finally:
        _unblock(d / name)
    assert not hung, f"StepBuffer.load blocked on a named pipe at {name}"
    assert isinstance(out.get("error"), StepBufferFormatError), out
    assert str(d / name) in str(out["error"])


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_hostile_lock_refused_by_save(tmp_path, kind):
    d = tmp_path / "buf"
    d.mkdir()
    outside = tmp_path / "outside_lock"
    if kind == "fifo":
        os.mkfifo(d / "LOCK")
    else:
        (d / "LOCK").symlink_to(outside)  # dangling: a save must not create (or lock) a file outside the folder
    try:
        hung, out = _bounded(lambda: _buffer().save(d))
    finally:
        if kind == "fifo":
            _unblock(d / "LOCK")
    assert not hung
    from rapo_fast._files import NotRegularFileError

    assert isinstance(out.get("error"), NotRegularFileError), out
    assert str(d / "LOCK") in str(out["error"])
    assert not outside.exists() and not (d / "CURRENT").exists()


def test_current_as_directory_or_device_refused(tmp_path):
    d = tmp_path / "buf"
    _buffer().save(d)
    os.unlink(d / "CURRENT")
    os.symlink("/dev/zero", d / "CURRENT")  # a device: reads would never end in a naive reader
    with pytest.raises(StepBufferFormatError, match="not a regular file"):
        StepBuffer.load(d)


def _full_disk(monkeypatch, after_bytes: int) -> None:
    """os.write, as _atomic sees it, fails with ENOSPC once `after_bytes` have been written (torch's own file writer
    is not involved: torch.save writes through _atomic's HashingWriter)."""
    written = [0]
    real_write = os.write

    def write(fd, data):
        if written[0] + len(data) > after_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real_write(fd, data)

    shim = types.ModuleType("os_full_disk")
    shim.__dict__.update(os.__dict__)
    shim.write = write
    monkeypatch.setattr(_atomic, "os", shim)


@pytest.mark.parametrize("after_bytes", [0, 100, 3 << 20])
def test_full_disk_inside_torch_save_is_oserror_naming_the_file(tmp_path, monkeypatch, after_bytes):
    state = {"w": torch.zeros(2_000_000), "b": torch.ones(10)}  # 8 MB: torch streams it through several writes
    d = tmp_path / "ckpt"
    _full_disk(monkeypatch, after_bytes)
    with pytest.raises(OSError) as info:
        with VersionWriter(d, "ckpt", "test.ckpt", 1) as w:
            with w.open("model.pt") as f:
                torch.save(state, f)
            w.commit({})
    assert info.value.errno == errno.ENOSPC
    # the file whose write failed: PENDING's temporary when nothing can be written, else model.pt
    want = ".PENDING.tmp" if after_bytes == 0 else "model.pt"
    assert info.value.filename is not None and info.value.filename.endswith(want), str(info.value)
    assert info.value.filename.startswith(str(d)) and want in str(info.value)
    monkeypatch.undo()
    assert not (d / "CURRENT").exists()
    assert [p.name for p in d.iterdir()] == ["LOCK"]  # the failed version was removed


def test_full_disk_single_file_save(tmp_path, monkeypatch):
    target = tmp_path / "warm.pt"
    torch.save({"old": torch.ones(3)}, target)
    _full_disk(monkeypatch, 1000)
    with pytest.raises(OSError) as info:
        _atomic.write_file_atomic(target, lambda f: torch.save({"w": torch.zeros(2_000_000)}, f))
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and "warm.pt" in str(info.value)
    assert torch.equal(torch.load(target, weights_only=True)["old"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm.pt"]


def test_single_file_save_ignores_planted_symlinks(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    target = tmp_path / "warm.pt"
    (tmp_path / "warm.pt.tmp").symlink_to(victim)  # the fixed name the demo's saver once used
    _atomic.write_file_atomic(target, lambda f: torch.save({"w": torch.ones(3)}, f))
    assert victim.read_text() == "precious\n"
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
