"""Trainer I/O: the CSV metrics log (optionally mirrored to TensorBoard) and checkpoint save/resume.

What this is: `MetricsLogger` (one CSV row per step; when a new metric appears the file is rewritten with the wider
header, so columns never shift) and `save_checkpoint` / `load_checkpoint` (model and optimiser state, step count,
the trainer's Python and torch RNG states, torch's global RNG, the config, and the step buffer with its K/V store
through StepTraces.save), written to a temporary directory and renamed into place so a crash never leaves half a
checkpoint.
What this is not: the training loop (rapo_fast/train/trainer.py).
"""

from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import torch

from rapo_fast.train.config import TrainerConfig

CHECKPOINT_FORMAT = "rapo_fast.train.trainer.checkpoint/1"


class MetricsLogger:
    """Append per-step metric dicts to a CSV (None: keep in memory only) and optionally to TensorBoard."""

    def __init__(self, csv_path: str | Path | None, tensorboard_dir: str | Path | None = None):
        self.path = Path(csv_path) if csv_path else None
        self.rows: list[dict] = []
        self.columns: list[str] = []
        self.tb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as e:  # tensorboard is optional
                raise ImportError(
                    f"tensorboard_dir was given but TensorBoard is unavailable ({e}); "
                    "pip install tensorboard or leave tensorboard_dir unset"
                ) from e
            self.tb = SummaryWriter(str(tensorboard_dir))

    def log(self, metrics: dict) -> None:
        self.rows.append(dict(metrics))
        new = [k for k in metrics if k not in self.columns]
        self.columns += new
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if new or not self.path.exists():
                with self.path.open("w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=self.columns)
                    w.writeheader()
                    w.writerows(self.rows)
            else:
                with self.path.open("a", newline="") as f:
                    csv.DictWriter(f, fieldnames=self.columns).writerow(metrics)
        if self.tb is not None:
            step = int(metrics.get("step", len(self.rows)))
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
                    self.tb.add_scalar(k, v, step)

    def state(self) -> dict:
        return {"rows": self.rows, "columns": self.columns}

    def restore(self, state: dict) -> None:
        self.rows, self.columns = list(state["rows"]), list(state["columns"])


def save_checkpoint(trainer, directory: str | Path) -> Path:
    """Write everything needed to continue exactly where `trainer` is (see the module docstring)."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    torch.save(trainer.model.state_dict(), tmp / "model.pt")
    torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "step_count": trainer.step_count,
            "py_rng": trainer.py_rng.getstate(),
            "gen": trainer.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "logger": trainer.logger.state(),
        },
        tmp / "trainer.pt",
    )
    (tmp / "config.json").write_text(trainer.config.to_json())
    if trainer.buffer is not None:
        trainer.buffer.save(tmp / "buffer")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def load_checkpoint(trainer, directory: str | Path) -> None:
    """Restore a checkpoint written by save_checkpoint into `trainer` (built with the same model architecture, env
    and encoder). The config must match the checkpoint's (a mismatch raises ValueError naming the fields)."""
    from rapo_fast.retrieval.step_traces import StepTraces

    d = Path(directory)
    state = torch.load(d / "trainer.pt", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"load_checkpoint: {d} is not a rapo_fast trainer checkpoint (format {state.get('format')!r})")
    saved = TrainerConfig.from_json((d / "config.json").read_text())
    diff = sorted(
        k
        for k, v in saved.to_dict().items()
        if trainer.config.to_dict().get(k) != v and k not in ("log_csv", "tensorboard_dir")
    )
    if diff:
        raise ValueError(f"load_checkpoint: the trainer's config differs from the checkpoint's in {diff}")
    trainer.model.load_state_dict(torch.load(d / "model.pt", weights_only=True))
    trainer.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=False))
    trainer.step_count = state["step_count"]
    trainer.py_rng.setstate(state["py_rng"])
    trainer.gen.set_state(state["gen"])
    torch.set_rng_state(state["torch_rng"])
    trainer.logger.restore(state["logger"])
    if (d / "buffer").exists():
        old = trainer.buffer
        if old is None:
            raise ValueError("load_checkpoint: the checkpoint holds a step buffer but the trainer has none")
        trainer.buffer = StepTraces.load(
            d / "buffer", old.encoder, old.tokenizer, kv_store=old.kv_store, model=old.model
        )
