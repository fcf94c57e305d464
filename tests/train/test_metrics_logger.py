"""MetricsLogger (rapo_fast/train/io.py) on its own: bounded in memory and in its checkpoint state however many steps
it logs (the CSV is the record), `restore` cutting the CSV back to the checkpoint's rows so that a resume leaves the
file of the uninterrupted run byte for byte (also across a column that first appeared after the checkpoint), a CSV
with fewer rows than the checkpoint's (a warning), and TensorBoard: a resume's event files read back with
TensorBoard's EventAccumulator give the uninterrupted run's scalars step for step (`purge_step`; skipped where
tensorboard is not installed). A full disk (ENOSPC after part of a row, simulated) leaves the file as it was and the
row uncounted, and the next append is whole; 30 TensorBoard loggers closed or dropped leave no thread or file open.
Not here: resumes of a whole trainer in a killed process (tests/reliability/test_resume_records.py) or the checkpoint
format's checks (tests/reliability/).
"""

from __future__ import annotations

import errno
import gc
import io
import os
import pickle
import threading
import tracemalloc

import pytest
import torch

import rapo_fast._atomic
import rapo_fast.train.io
from rapo_fast.train.io import MetricsLogger


def _metrics(step: int, run: str = "") -> dict:
    """The metrics of one step; `run` changes the values (another run's step), a column appears at step 5."""
    m = {"step": step, "loss": 1.0 / step + len(run), "reward": (step * 7 % 5) / 4, "note": f"s{step},{run}"}
    if step >= 5:
        m["late"] = step * 0.5
    return m


def _state_bytes(logger: MetricsLogger) -> int:
    buf = io.BytesIO()
    torch.save(logger.state(), buf)  # what save_checkpoint stores of the logger
    return buf.tell()


def _checkpointed(logger: MetricsLogger) -> dict:
    """The logger's state as a checkpoint holds it: saved and loaded back (a copy, whatever state() shares)."""
    buf = io.BytesIO()
    torch.save(logger.state(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("to_csv", [True, False])
def test_memory_and_checkpoint_state_do_not_grow_with_steps(tmp_path, to_csv):
    """Logging 3000 more steps adds nothing to the logger's memory (under 16 KB of Python allocations, where a list of
    rows held ~1 MB) and nothing to its checkpoint state but the digits of the row count."""
    logger = MetricsLogger(tmp_path / "m.csv" if to_csv else None)
    for s in range(1, 201):
        logger.log(_metrics(s))
    size, obj = _state_bytes(logger), len(pickle.dumps(vars(logger)))
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for s in range(201, 3201):
            logger.log(_metrics(s))
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 16 << 10, f"the logger's memory grew by {grown} bytes over 3000 steps"
    assert _state_bytes(logger) <= size + 8 and len(pickle.dumps(vars(logger))) <= obj + 8
    assert logger.state() == {"n_rows": 3200, "columns": ["step", "loss", "reward", "note", "late"]}
    if to_csv:
        assert len((tmp_path / "m.csv").read_text().splitlines()) == 3201


@pytest.mark.parametrize("ckpt_at", [3, 6])
def test_restore_leaves_the_uninterrupted_runs_csv(tmp_path, ckpt_at):
    """Checkpoint after step ckpt_at, the killed run logs steps past it (other values, and the column `late` from step
    5), a new logger restores and logs the remaining steps: the CSV equals the uninterrupted run's byte for byte, also
    right after the restore (cut back to ckpt_at rows, under the checkpoint's columns)."""
    want = MetricsLogger(tmp_path / "u.csv")
    for s in range(1, 9):
        want.log(_metrics(s))
        if s == ckpt_at:
            at_ckpt = (tmp_path / "u.csv").read_bytes()
    killed = MetricsLogger(tmp_path / "r.csv")
    for s in range(1, ckpt_at + 1):
        killed.log(_metrics(s))
    state = _checkpointed(killed)
    for s in range(ckpt_at + 1, 8):
        killed.log(_metrics(s, run="killed"))
    resumed = MetricsLogger(tmp_path / "r.csv")
    resumed.restore(state)
    assert (tmp_path / "r.csv").read_bytes() == at_ckpt
    for s in range(ckpt_at + 1, 9):
        resumed.log(_metrics(s))
    assert (tmp_path / "r.csv").read_bytes() == (tmp_path / "u.csv").read_bytes()
    assert resumed.state() == want.state()


def test_restore_onto_a_shorter_csv_keeps_its_rows_and_warns(tmp_path):
    """A resume logging to a path that holds fewer rows than the checkpoint's (here none): those rows are kept, the
    run appends to them, and a warning says how many are missing."""
    a = MetricsLogger(tmp_path / "a.csv")
    for s in range(1, 5):
        a.log(_metrics(s))
    b = MetricsLogger(tmp_path / "new" / "b.csv")
    with pytest.warns(UserWarning, match="holds 0 of the checkpoint's 4 rows"):
        b.restore(_checkpointed(a))
    b.log(_metrics(5))
    lines = (tmp_path / "new" / "b.csv").read_text().splitlines()
    assert lines[0] == "step,loss,reward,note,late" and lines[1].startswith("5,") and len(lines) == 2
    assert b.state()["n_rows"] == 5


def _scalars(directory) -> dict:
    """{tag: [(step, value)]} of a TensorBoard log directory, as TensorBoard reads it (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_after_a_resume_equals_the_uninterrupted_run(tmp_path):
    """The killed run's events past its checkpoint (steps 4-6, other values, flushed to disk) are dropped by the
    resumed writer's purge_step: every tag reads back the uninterrupted run's (step, value) pairs, steps 1-7 once."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    want = MetricsLogger(None, tmp_path / "tb_u")
    for s in range(1, 8):
        want.log(_metrics(s))
    want.tb.close()
    killed = MetricsLogger(tmp_path / "r.csv", tmp_path / "tb_r")
    for s in range(1, 4):
        killed.log(_metrics(s))
    state = _checkpointed(killed)
    for s in range(4, 7):
        killed.log(_metrics(s, run="killed"))
    killed.tb.flush()  # on disk before the "kill": the case purge_step is for
    resumed = MetricsLogger(tmp_path / "r.csv", tmp_path / "tb_r")
    resumed.restore(state)
    for s in range(4, 8):
        resumed.log(_metrics(s))
    resumed.tb.close()
    got, expected = _scalars(tmp_path / "tb_r"), _scalars(tmp_path / "tb_u")
    assert sorted(expected) == ["late", "loss", "reward", "step"]
    assert got == expected
    assert [s for s, _ in expected["loss"]] == list(range(1, 8))


class _FullDisk:
    """The os module, except that os.write writes part of what it is given and then raises ENOSPC (a disk that fills
    up mid-row)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        os.write(fd, bytes(data[: max(1, len(data) // 2)]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("new_column", [False, True], ids=["append", "rewrite"])
def test_a_full_disk_cuts_no_row_and_the_next_append_is_whole(tmp_path, monkeypatch, new_column):
    """ENOSPC after part of a row's bytes were written: OSError naming the file, errno ENOSPC; the file is byte for byte
    what it was, the row is not counted and its new column not added; once space is back, the next rows are whole: the
    file equals the file of a run whose disk never filled."""
    want = MetricsLogger(tmp_path / "want.csv")
    for s in range(1, 7):
        want.log(_metrics(s))
    logger = MetricsLogger(tmp_path / "m.csv")
    last = 4 if new_column else 3  # step 5 brings the column `late`: the atomic rewrite's path
    for s in range(1, last + 1):
        logger.log(_metrics(s))
    before, state = (tmp_path / "m.csv").read_bytes(), logger.state()
    with monkeypatch.context() as m:
        m.setattr(rapo_fast.train.io, "os", _FullDisk())
        m.setattr(rapo_fast._atomic, "os", _FullDisk())
        with pytest.raises(OSError, match=rf"m\.csv: row {last + 1} not written") as info:
            logger.log(_metrics(last + 1))
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "m.csv").read_bytes() == before
    assert logger.state() == state
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv", "want.csv"]  # no temporary left behind
    for s in range(last + 1, 7):
        logger.log(_metrics(s))
    assert (tmp_path / "m.csv").read_bytes() == (tmp_path / "want.csv").read_bytes()
    assert logger.state() == want.state()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_thirty_tensorboard_loggers_closed_or_dropped_leave_no_thread_or_file(tmp_path):
    """Each logger logs two steps (its writer thread and event file open), then half are closed (`with`), half
    dropped: threads and open files are back to the baseline + 2. A closed logger that logs again opens a new writer,
    released by the next close."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    with MetricsLogger(None, tmp_path / "warm") as warm:  # TensorBoard's imports and one-time state first
        warm.log(_metrics(1))
    gc.collect()
    threads, fds = threading.active_count(), _open_fds()
    for i in range(30):
        if i % 2:
            with MetricsLogger(tmp_path / f"{i}.csv", tmp_path / f"tb{i}") as logger:
                logger.log(_metrics(1))
                logger.log(_metrics(2))
        else:
            logger = MetricsLogger(tmp_path / f"{i}.csv", tmp_path / f"tb{i}")
            logger.log(_metrics(1))
            logger.log(_metrics(2))
            assert threading.active_count() > threads  # the writer's thread runs: the test would see a leak
            del logger
            gc.collect()
    assert threading.active_count() <= threads + 2
    assert _open_fds() <= fds + 2
    logger = MetricsLogger(None, tmp_path / "again")
    logger.log(_metrics(1))
    logger.close()
    logger.log(_metrics(2))  # a closed logger still logs, through a new writer
    assert threading.active_count() > threads
    logger.close()
    assert threading.active_count() <= threads + 2 and _open_fds() <= fds + 2
    assert sorted(s for s, _ in _scalars(tmp_path / "again")["loss"]) == [1, 2]
