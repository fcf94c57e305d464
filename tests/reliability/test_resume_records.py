"""Run records after a resume, and SIGTERM: a run resumed from a checkpoint leaves the metrics CSV the uninterrupted
run leaves (one row per step, each step once, equal in every column but the timings), also when the killed process
logged steps past its checkpoint; a SIGTERM during `train(checkpoint_dir=...)` finishes the step in progress, saves a
checkpoint and then ends the process by SIGTERM (or runs the user's own handler), so a preempted run resumes from its
last step; `checkpoint_on_sigterm=False` leaves SIGTERM alone.
The trainers run in a forked child where a signal ends the process. Not here: the checkpoint format itself
(test_save_formats.py, test_fault_injection.py).
"""

from __future__ import annotations

import csv
import os
import signal
import sys
import traceback
from pathlib import Path

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig

TIMINGS = {
    "tokens_per_s",
    "t_rollout",
    "t_retrieval",
    "t_splice",
    "t_buffer",
    "t_step",
    "t_logprob",
    "t_loss",
    "t_optimizer",
}


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    """The loss on its torch path (the Triton interpreter is ~50x slower; the kernels have their own tests)."""
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")


def _make(work: Path, csv_name: str, seed: int = 0, sigterm_at_call: int = 0) -> RAPOTrainer:
    """A trainer on the demo task logging to work/csv_name; its reward function sends SIGTERM to this process during
    its call number `sigterm_at_call` (0: never), i.e. in the middle of that step."""
    task = ChainArithmeticTask()
    tok, problems = task.tokenizer(), task.make_problems(6, seed=0)
    path = work / "t.jsonl"
    if not path.exists():
        write_jsonl(solver_trajectories(task, problems, 3, 0.2, seed=0), path)
    cfg = TrainerConfig.RAPO(
        {
            "rollout.group_size": 4,
            "rollout.hybrid.n_hybrid": 2,
            "prompts_per_step": 2,
            "rollout.max_step_tokens": 6,
            "rollout.max_steps": 2,
            "optim.lr": 5e-3,
            "buffer.add_onpolicy_steps": True,
            "logging.log_csv": str(work / csv_name),
        }
    )
    calls = []

    def reward(env, probs, batch):
        calls.append(1)
        if len(calls) == sigterm_at_call:
            os.kill(os.getpid(), signal.SIGTERM)
        return ((batch.input_ids * batch.loss_mask).sum(1) % 2).float()

    model = build_tiny_policy(tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, seed=seed)
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(dim=32), tok, top_k=2)
    torch.manual_seed(0)
    return RAPOTrainer(model, tok, task, traces, cfg, problems, reward_fn=reward)


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMINGS} for r in csv.DictReader(f)]


def _in_child(fn) -> int:
    """Run fn() in a forked child; its exit status as os.waitpid gives it (exit code 0 when fn returns)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            # SIGTERM's default disposition, as a scheduler's process has (a pytest-xdist worker's handler would
            # otherwise be inherited and turn the signal into an exit code)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            torch.set_num_threads(1)
            fn()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 4
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            sys.stdout.flush()
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def _uninterrupted(work: Path, n: int) -> list[dict]:
    status = _in_child(lambda: _make(work, "u.csv").train(n, progress=False))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    rows = _rows(work / "u.csv")
    assert [r["step"] for r in rows] == [str(i) for i in range(1, n + 1)]
    return rows


def test_a_resumed_run_logs_each_step_once(work):
    """The killed process ran steps 3 and 4 past its checkpoint at step 2 (and logged them); the resumed run does them
    again. Before, the CSV read steps 1, 2, 3, 4, 3, 4."""
    want = _uninterrupted(work, 4)

    def killed_run() -> None:
        t = _make(work, "run.csv")
        t.train(2, progress=False)
        t.save_checkpoint(work / "ckpt")
        t.train(2, progress=False)

    assert _in_child(killed_run) == 0
    assert [r["step"] for r in _rows(work / "run.csv")] == ["1", "2", "3", "4"]

    def resumed() -> None:
        t = _make(work, "run.csv", seed=1)
        t.load_checkpoint(work / "ckpt")
        t.train(2, progress=False)

    assert _in_child(resumed) == 0
    assert _rows(work / "run.csv") == want


def test_sigterm_checkpoints_the_step_in_progress_then_ends_the_process(work):
    """SIGTERM during step 3 of a 10-step train: step 3 completes, the checkpoint holds 3 steps, the process ends by
    SIGTERM; resumed for 2 more steps, the CSV is the uninterrupted 5-step run's."""
    want = _uninterrupted(work, 5)
    status = _in_child(
        lambda: _make(work, "run.csv", sigterm_at_call=3).train(10, progress=False, checkpoint_dir=work / "ckpt")
    )
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    assert [r["step"] for r in _rows(work / "run.csv")] == ["1", "2", "3"]

    def resumed() -> None:
        t = _make(work, "run.csv", seed=1)
        t.load_checkpoint(work / "ckpt")
        assert t.step_count == 3
        t.train(2, progress=False)

    assert _in_child(resumed) == 0
    assert _rows(work / "run.csv") == want


def test_sigterm_runs_the_users_handler_after_the_checkpoint(work):
    def run() -> None:
        def handler(signum, frame):
            sys.exit(7)

        signal.signal(signal.SIGTERM, handler)
        _make(work, "run.csv", sigterm_at_call=2).train(10, progress=False, checkpoint_dir=work / "ckpt")

    status = _in_child(run)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7, status
    assert (work / "ckpt" / "CURRENT").is_file() and len(_rows(work / "run.csv")) == 2


def test_sigterm_opt_out(work):
    status = _in_child(
        lambda: _make(work, "run.csv", sigterm_at_call=2).train(
            10, progress=False, checkpoint_dir=work / "ckpt", checkpoint_on_sigterm=False
        )
    )
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    assert not (work / "ckpt").exists()
