"""Trainer I/O: the CSV metrics log (optionally mirrored to TensorBoard) and checkpoint save/resume.

What this is: `MetricsLogger` (one CSV row per step; a new metric rewrites the file with the wider header, so columns
never shift) and `save_checkpoint` / `load_checkpoint`, saved as a new version of a versioned directory
(rapo_fast/_atomic.py), so a crash leaves the previous checkpoint or the new one, never half of one. What a
checkpoint holds: docs/formats.md section 4.
What this is not: the training loop (rapo_fast/train/trainer.py).
"""

from __future__ import annotations

import csv
import io
import math
import os
import random
import warnings
import weakref
from pathlib import Path

import torch

from rapo_fast._atomic import FormatError, VersionWriter, read_version, write_file_atomic
from rapo_fast._checks import brief, check_field, check_int
from rapo_fast.train.config import TrainerConfig

# version 1: "rapo_fast.train.trainer.checkpoint/1", one directory renamed into place (not crash-safe, no checksums);
# version 2: the metrics logger's state held every logged row ({"rows", "columns"}), growing with the run
CHECKPOINT_FORMAT, CHECKPOINT_VERSION = "rapo_fast.train.checkpoint", 3
_PREFIX = "checkpoint"


class MetricsLogger:
    """Append per-step metric dicts to a CSV and optionally to TensorBoard, holding no rows in memory: the CSV is the
    record, and the logger keeps only the number of rows logged and the columns (its `state()`, what a checkpoint
    stores, of a size that does not grow with the run). `restore` (a resume) cuts the CSV back to the checkpoint's
    rows: the steps the killed run logged after its checkpoint, which the resumed run does again, are not repeated.

    csv_path None: no record is kept (only the count and the columns; TensorBoard, when given, still gets every
    step). A caller that wants the metrics in memory has them from RAPOTrainer.step() / train(), which return them.

    A row lands whole or not at all, and counts only once it has landed: an append that fails (a full disk) is cut
    back off the file and raises OSError naming the file; the next append after space is freed is whole. The CSV is
    opened per row, so only TensorBoard's writer (a thread and an event file) is held between steps: `close()` (or
    the `with` block, or the logger being dropped) releases it; a later `log` opens a new writer (a new event file in
    the same folder), so a closed logger still logs."""

    def __init__(self, csv_path: str | Path | None, tensorboard_dir: str | Path | None = None):
        self.path = Path(csv_path) if csv_path else None
        self.n_rows = 0
        self.columns: list[str] = []
        self.tb_dir = tensorboard_dir
        self._tb: list = [None, None]  # [SummaryWriter or None, its purge_step]: shared with the finalizer below
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except Exception as e:  # tensorboard is optional
                raise ImportError(
                    f"tensorboard_dir was given but TensorBoard is unavailable ({e}); "
                    "pip install tensorboard or leave tensorboard_dir unset"
                ) from e
        # a dropped logger closes its writer too (its thread would otherwise run until the process ends)
        weakref.finalize(self, _close_writer, self._tb)

    @property
    def tb(self):
        """TensorBoard's SummaryWriter (opened at the first step logged after construction, `restore` or `close`);
        None without tensorboard_dir."""
        if self.tb_dir and self._tb[0] is None:
            from torch.utils.tensorboard import SummaryWriter

            purge, self._tb[1] = self._tb[1], None
            self._tb[0] = SummaryWriter(str(self.tb_dir), **({} if purge is None else {"purge_step": purge}))
        return self._tb[0]

    def close(self) -> None:
        """Flush and close TensorBoard's writer (ending its thread and closing its file); idempotent."""
        _close_writer(self._tb)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def log(self, metrics: dict) -> None:
        new = [k for k in metrics if k not in self.columns]
        columns = self.columns + new
        if self.path is not None:
            try:
                if new or not self.path.exists():
                    self._rewrite(self.n_rows, metrics, columns)  # atomic: the old file or the new one
                else:
                    self._append(metrics, columns)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"MetricsLogger.log: {self.path}: row {self.n_rows + 1} not written ({exc.strerror or exc}); the "
                    f"file holds the {self.n_rows} rows before it, and the next row logged follows them",
                ) from exc
        self.columns, self.n_rows = columns, self.n_rows + 1
        if self.tb is not None:
            step = int(metrics.get("step", self.n_rows))
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
                    self.tb.add_scalar(k, v, step)

    def _append(self, metrics: dict, columns: list[str]) -> None:
        """One row at the end of the CSV in one write, cut back off on a failure (no partial row stays)."""
        text = io.StringIO()
        csv.DictWriter(text, fieldnames=columns).writerow(metrics)
        data = memoryview(text.getvalue().encode("utf-8"))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                while data:  # os.write may write part of it (returns the count): the rest follows
                    data = data[os.write(fd, data) :]
            except BaseException:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def state(self) -> dict:
        return {"n_rows": self.n_rows, "columns": list(self.columns)}

    def restore(self, state: dict) -> None:
        """A checkpoint's state: the CSV keeps its first n_rows rows under the checkpoint's columns (rewritten
        atomically) and TensorBoard drops the later steps' events (purge_step), so that the resumed run's files equal
        the uninterrupted run's. A CSV with fewer rows than that (a resume that logs to a new file) keeps the rows it
        has, with a warning: the rows it lacks are in no checkpoint."""
        self.n_rows, self.columns = int(state["n_rows"]), list(state["columns"])
        if self.path is not None:
            kept = self._rewrite(self.n_rows)
            if kept < self.n_rows:
                warnings.warn(
                    f"MetricsLogger.restore: {self.path} holds {kept} of the checkpoint's {self.n_rows} rows; the "
                    "resumed run appends to those",
                    stacklevel=2,
                )
        if self.tb_dir:
            self.close()  # the next writer drops the later steps' events; one row per step: the next is n_rows + 1
            self._tb[1] = self.n_rows + 1

    def _rewrite(self, limit: int, extra: dict | None = None, columns: list[str] | None = None) -> int:
        """Replace the CSV atomically with the header `columns` (default: the logger's), its first `limit` rows and then
        `extra` (a new row);
        returns the old rows kept. Streamed from the old file in pieces of about _CSV_PIECE bytes, so the rewrite
        holds no more than that in memory; values are copied as the file holds them (each column's text unchanged)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = 0

        def write(f) -> None:
            nonlocal kept
            text = io.StringIO()
            w = csv.DictWriter(text, fieldnames=self.columns if columns is None else columns, extrasaction="ignore")
            w.writeheader()
            for row in _csv_rows(self.path):
                if kept == limit:
                    break
                w.writerow(row)
                kept += 1
                if text.tell() >= _CSV_PIECE:
                    f.write(text.getvalue().encode("utf-8"))
                    text.seek(0)
                    text.truncate()
            if extra is not None:
                w.writerow(extra)
            f.write(text.getvalue().encode("utf-8"))

        write_file_atomic(self.path, write)
        return kept


def _close_writer(box: list) -> None:
    """Close the SummaryWriter in box[0], if any (MetricsLogger.close and its finalizer)."""
    writer, box[0] = box[0], None
    if writer is not None:
        writer.close()


# bytes of CSV text a rewrite gathers before writing them out
_CSV_PIECE = 1 << 20


def _csv_rows(path: Path):
    """The rows of the CSV at `path` as dicts (none when there is no file yet), read one at a time."""
    try:
        f = path.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        return
    with f:
        yield from csv.DictReader(f)


class CheckpointFormatError(FormatError):
    """A checkpoint directory is missing, corrupt, inconsistent, or of an incompatible format version."""


def save_checkpoint(trainer, directory: str | Path) -> Path:
    """Write everything needed to continue exactly where `trainer` is (docs/formats.md section 4) as a new version of
    the versioned directory `directory`, switched to atomically; the previous checkpoint stays until then."""
    root = Path(directory)
    with VersionWriter(root, _PREFIX, CHECKPOINT_FORMAT, CHECKPOINT_VERSION) as w:
        with w.open("model.pt") as f:
            torch.save(trainer.model.state_dict(), f)
        with w.open("optimizer.pt") as f:
            torch.save(trainer.optimizer.state_dict(), f)
        state = {
            "step_count": trainer.step_count,
            "py_rng": trainer.py_rng.getstate(),
            "gen": trainer.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "logger": trainer.logger.state(),
        }
        with w.open("trainer.pt") as f:
            torch.save(state, f)
        w.write_bytes("config.json", trainer.config.to_json().encode())
        if trainer.buffer is not None:
            trainer.buffer.save(w.path / "buffer")
            w.add_nested("buffer")
        w.commit({"step_count": trainer.step_count})
    return root


def _torch_load(path: Path):
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises pickle, zip and runtime errors alike
        raise CheckpointFormatError(f"{path}: expected a readable torch file, got {exc}") from exc


def _check_trainer_state(state, path: Path, step_count: int) -> None:
    """Every field of trainer.pt, checked by restoring it into scratch objects (the trainer is not touched)."""
    fields = {"step_count", "py_rng", "gen", "torch_rng", "logger"}
    if not isinstance(state, dict) or set(state) != fields:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointFormatError(f"{path}: expected a dict of the fields {sorted(fields)}, got {got}")
    if check_field(state, "step_count", path, CheckpointFormatError, check_int, lo=0) != step_count:
        raise CheckpointFormatError(
            f"{path}: 'step_count': expected meta.json's {step_count}, got {state['step_count']}"
        )
    for field, restore in (
        ("py_rng", lambda s: random.Random().setstate(s)),
        ("gen", lambda s: torch.Generator().set_state(s)),
        ("torch_rng", lambda s: torch.Generator().set_state(s)),
    ):
        try:
            restore(state[field])
        except Exception as exc:  # random and torch raise TypeError, ValueError or RuntimeError
            raise CheckpointFormatError(f"{path}: field {field!r}: expected a generator state, got {exc}") from exc
    log = state["logger"]
    ok = isinstance(log, dict) and set(log) == {"n_rows", "columns"} and isinstance(log["columns"], list)
    if not ok or not all(isinstance(c, str) for c in log["columns"]):
        raise CheckpointFormatError(f"{path}: 'logger': expected {{'n_rows': int, 'columns': [str]}}, got {brief(log)}")
    check_field(log, "n_rows", f"{path}: field 'logger'", CheckpointFormatError, check_int, lo=0)


def _check_like(saved, current, path: Path, what: str) -> None:
    """`saved` (a state dict read from `path`) has the keys, shapes and dtypes of `current`."""
    if not isinstance(saved, dict) or set(saved) != set(current):
        extra = sorted(set(saved) ^ set(current)) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointFormatError(f"{path}: expected a state dict of this {what}, got keys differing in {extra[:6]}")
    for k, t in current.items():
        s = saved[k]
        if isinstance(t, torch.Tensor) and (
            not isinstance(s, torch.Tensor) or s.shape != t.shape or s.dtype != t.dtype
        ):
            got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise CheckpointFormatError(f"{path}: {k!r}: expected this {what}'s {tuple(t.shape)} {t.dtype}, got {got}")


def _check_optimizer(saved, current: dict, path: Path) -> None:
    """Same parameter groups (sizes) as the trainer's optimizer: what load_state_dict would refuse, refused first."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise CheckpointFormatError(
            f"{path}: expected an optimizer state dict (fields 'state', 'param_groups'), got others"
        )
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
    want = [len(g["params"]) for g in current["param_groups"]]
    if sizes != want:
        raise CheckpointFormatError(f"{path}: parameter groups: expected this optimizer's sizes {want}, got {sizes}")


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {dotted field: value}."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def load_checkpoint(trainer, directory: str | Path) -> None:
    """Restore a checkpoint written by save_checkpoint into `trainer` (built with the same model architecture, env
    and encoder). The config must match the checkpoint's (a mismatch raises ValueError naming the fields). Every file
    is checked (checksums, fields, shapes) before the trainer is changed: a bad checkpoint raises
    CheckpointFormatError naming the file and field, and leaves the trainer as it was."""
    from rapo_fast.retrieval.step_traces import StepTraces, StepTracesFormatError

    with read_version(directory, _PREFIX, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointFormatError) as v:
        d, names = v.path, {"model.pt", "optimizer.pt", "trainer.pt", "config.json"}
        if not names <= set(v.files) <= names | {"buffer/CURRENT"}:
            raise CheckpointFormatError(
                f"{d / 'meta.json'}: field 'files': expected {sorted(names)} (+ buffer/CURRENT), got {sorted(v.files)}"
            )
        state = _torch_load(d / "trainer.pt")
        step_count = check_field(v.meta, "step_count", d, CheckpointFormatError, check_int, lo=0)
        _check_trainer_state(state, d / "trainer.pt", step_count)
        try:
            saved = TrainerConfig.from_json((d / "config.json").read_bytes().decode("utf-8"))
        except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise CheckpointFormatError(f"{d / 'config.json'}: {exc}") from exc
        mine, theirs = _flat(trainer.config.to_dict()), _flat(saved.to_dict())
        diff = sorted(
            k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k) and k.split(".")[0] != "logging"
        )
        if diff:
            raise ValueError(f"load_checkpoint: trainer: expected the checkpoint's config, got one differing in {diff}")
        model_sd = _torch_load(d / "model.pt")
        _check_like(model_sd, trainer.model.state_dict(), d / "model.pt", "model")
        opt_sd = _torch_load(d / "optimizer.pt")
        _check_optimizer(opt_sd, trainer.optimizer.state_dict(), d / "optimizer.pt")
        buffer = None
        if "buffer/CURRENT" in v.files:
            old = trainer.buffer
            if old is None:
                raise ValueError(
                    "load_checkpoint: trainer: expected a step buffer (the checkpoint holds one), got none"
                )
            try:  # last of the checks: it replaces the K/V store's contents once everything in it is checked
                buffer = StepTraces.load(
                    d / "buffer", old.encoder, old.tokenizer, kv_store=old.kv_store, model=old.model
                )
            except StepTracesFormatError as exc:
                raise CheckpointFormatError(str(exc)) from exc
    trainer.model.load_state_dict(model_sd)
    trainer.optimizer.load_state_dict(opt_sd)
    trainer.step_count = state["step_count"]
    trainer.py_rng.setstate(state["py_rng"])
    trainer.gen.set_state(state["gen"])
    torch.set_rng_state(state["torch_rng"])
    trainer.logger.restore(state["logger"])
    if buffer is not None:
        trainer.buffer = buffer
