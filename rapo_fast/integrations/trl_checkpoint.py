"""The step buffer in TRL's checkpoints: `StepTracesCheckpoint`, a transformers TrainerCallback.

What it is: saves the StepTraces beside each TRL checkpoint (`rapo_step_traces/`, crash-safe through StepTraces.save)
and, on resume, loads it into the traces in place, on every process. RAPOGRPOTrainer adds it by itself when its
rollout_func holds a StepTraces; with TRL's own GRPOTrainer pass callbacks=[StepTracesCheckpoint(traces)].
What it is not: a checkpoint of the encoder (not saved; pass the same one) or of a K/V store's model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rapo_fast.retrieval.step_traces import StepTraces

__all__ = ["StepTracesCheckpoint", "TRACES_DIR"]

TRACES_DIR = "rapo_step_traces"


class StepTracesCheckpoint(TrainerCallback):
    """Save `traces` into each TRL checkpoint and restore it when training resumes from one (module docstring)."""

    def __init__(self, traces: StepTraces) -> None:
        if not isinstance(traces, StepTraces):
            raise TypeError(f"StepTracesCheckpoint: traces: expected a StepTraces, got {type(traces).__name__}")
        self.traces = traces

    @staticmethod
    def checkpoint_dir(args: Any, state: Any) -> Path:
        """The folder transformers' Trainer writes the checkpoint of `state.global_step` into."""
        return Path(args.output_dir) / f"checkpoint-{state.global_step}"

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # every process holds the same buffer (the rollout gathers new steps from all of them: docs/trl.md, "Several
        # processes"), so the process that writes the checkpoint (process 0, or each node's first with
        # save_on_each_node) writes every process's steps; a resume loads them on every process (on_train_begin)
        if getattr(args, "should_save", state.is_world_process_zero):
            self.traces.save(self.checkpoint_dir(args, state) / TRACES_DIR)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # transformers has loaded the checkpoint's TrainerState by now but gives callbacks no path: a resumed run is
        # one that starts past step 0, and its checkpoint is the one of that step under output_dir.
        if state.global_step == 0:
            return
        folder = self.checkpoint_dir(args, state) / TRACES_DIR
        if not folder.is_dir():
            raise ValueError(
                f"StepTracesCheckpoint: checkpoint: expected {folder} (training resumes at step {state.global_step}), "
                "got no such folder; resume from a checkpoint under output_dir saved with this callback, or call "
                "restore(<checkpoint>) before trainer.train()"
            )
        self.restore(folder.parent)

    def restore(self, checkpoint: str | os.PathLike) -> None:
        """Replace the traces' contents by the buffer saved in `checkpoint` (a TRL checkpoint folder)."""
        t = self.traces
        loaded = StepTraces.load(
            Path(checkpoint) / TRACES_DIR, t.encoder, t.tokenizer, kv_store=t.kv_store, model=t.model
        )
        t.buffer, t.payloads = loaded.buffer, loaded.payloads
        t.num_offpolicy, t.num_onpolicy = loaded.num_offpolicy, loaded.num_onpolicy
        t.pin_offpolicy = loaded.pin_offpolicy
