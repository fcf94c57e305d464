"""One process of test_trl_two_processes.py: RAPOGRPOTrainer on examples/trl/rapo_grpo_arith.py's task, run by the
test as one of two processes (RANK / WORLD_SIZE / MASTER_PORT in the environment: accelerate joins them in a gloo
group, as under torchrun).

    python trl_two_process_worker.py OUT WARM_STATE RECORD

Trains 2 steps from the warm state (a checkpoint after each), then a new trainer (a fresh seed buffer) resumes from the
checkpoint of step 1 and trains step 2 again; writes RECORD, for each run: per step, a digest of this process's step
buffer, the number of new steps each process sent (the gather the rollout makes) and the payload ids this process's
rollouts retrieved; and the digest at the start of training (after the resume restored the buffer).
What it is not: a test (no assertions: the test compares the processes' records).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
T0 = time.perf_counter()


def say(what: str) -> None:
    """A progress line in the process's log (what the test shows when a process fails or runs out of time)."""
    print(f"[{time.perf_counter() - T0:6.1f} s] {what}", flush=True)


def digest(traces) -> str:
    """SHA-256 of what a StepTraces holds: payloads, counters, the buffer's rows and ids."""
    h = hashlib.sha256()
    h.update(repr(sorted(traces.payloads.items())).encode())
    h.update(repr((traces.num_offpolicy, traces.num_onpolicy, len(traces.buffer))).encode())
    for name in ("embeddings", "payload_ids", "group_ids", "scores"):
        h.update(getattr(traces.buffer, name).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _cpu_map_location() -> None:
    """transformers (5.10) resumes a multi-process run's optimizer with map_location=args.device, torch.device("cpu",
    0) on a CPU rank, which torch 2.13's torch.load refuses ("don't know how to restore data location ... cpu:0"):
    an indexed CPU device is read as the CPU, in this process only. GPU runs (map_location cuda:N) never meet it."""
    load = torch.load

    def cpu_load(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = cpu_load


def _run(ex, out: str, warm: dict, checkpoint: str | None) -> dict:
    """One training run in this process (2 steps, or a resume from `checkpoint`); returns its record."""
    from transformers import TrainerCallback

    import rapo_fast.integrations.trl_rollout as trl_rollout

    argv = ["--steps", "2", "--save-steps", "1", "--retrieve-prob", "1.0", "--prompts-per-step", "1"]
    trainer, rollout_func, _ = ex.build_trainer(ex.parse_args(argv), Path(out), warm)
    say(f"trainer built (resume from {checkpoint})")
    rollout_func.success_fn = lambda prompt, completion: "</tool>" in completion  # the buffer grows on every process
    traces = rollout_func.traces
    rec: dict = {"rank": trainer.accelerator.process_index, "world": trainer.accelerator.num_processes, "steps": {}}
    sent: list = []
    gather = trl_rollout.gather_objects

    def recording_gather(obj):
        parts = gather(obj)
        sent.append([len(p[1]) for p in parts])
        return parts

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            rec["begin"] = (state.global_step, digest(traces))  # after StepTracesCheckpoint's restore (added first)

        def on_step_end(self, args, state, control, **kwargs):
            retrieved = rollout_func.last_batch.retrievals[:, 3].tolist()
            rec["steps"][state.global_step] = {"digest": digest(traces), "sent": sent[-1], "retrieved": retrieved}
            say(f"step {state.global_step}: sent {sent[-1]}, retrieved {retrieved}")

    trainer.add_callback(Record())
    trl_rollout.gather_objects = recording_gather
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        trl_rollout.gather_objects = gather
    return rec


def main(out: str, warm_path: str, record: str) -> None:
    say("imported")
    torch.set_num_threads(1)
    _cpu_map_location()
    spec = importlib.util.spec_from_file_location("rapo_grpo_arith", ROOT / "examples" / "trl" / "rapo_grpo_arith.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    warm = torch.load(warm_path, weights_only=True)
    first = _run(ex, out, warm, None)
    resumed = _run(ex, out, warm, str(Path(out) / "checkpoint-1"))
    torch.save({"first": first, "resumed": resumed}, record)
    say("done")


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # no process-group teardown: gloo's shutdown can abort a process whose peer exited first (after the record is
    # written, which is all the test reads)
    sys.stdout.flush()
    os._exit(0)
