"""Hooks into RAPOTrainer.train: per-step callbacks that can add metrics, feed the progress bar and stop training.

What this is: `TrainerCallback` (the base; all no-ops) and `EvalCallback` (an evaluation inside the training loop). The
order of the calls within `train`: docs/training.md section 1.
What this is not: the training loop (rapo_fast/train/trainer.py) or an evaluation (pass your own, e.g.
rapo_fast.train.sft.evaluate).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rapo_fast._checks import check_float, check_int


class TrainerCallback:
    """Base class of the hooks RAPOTrainer.train calls; override the ones you need (see the module docstring)."""

    def on_train_begin(self, trainer: Any, num_steps: int) -> bool | None:
        """Before the first step; `trainer.step_count` is the number of steps already done (0, or more on resume).
        Return True to stop before any step (e.g. a target already reached)."""
        return None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> bool | None:
        """After each step. `step` is trainer.step_count (1-based, counting steps of earlier `train` calls and of a
        resumed checkpoint); `metrics` the step's metrics (add keys to put them in the history). Return True to stop
        training after this step."""
        return None

    def on_train_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        """After the last step (also after an early stop); `history` holds this call's metrics, one dict per step."""

    def progress_fields(self) -> dict[str, str]:
        """Extra fields for the progress bar's postfix (name -> formatted value); shown after each step."""
        return {}


class EvalCallback(TrainerCallback):
    """Evaluate inside the training loop: `eval_fn(trainer) -> float` at the start (`at_start`), at every step that
    is a multiple of `every`, and at the last step of the call (also when another callback stopped training
    early). Each score is appended to `curve` as (step, score)
    and stored in that step's metrics under `name`; the latest shows in the progress bar. With `target`, training
    stops at the first evaluation whose score is >= target. `seconds` sums the time spent evaluating.
    """

    def __init__(
        self,
        eval_fn: Callable[[Any], float],
        every: int,
        *,
        at_start: bool = True,
        target: float | None = None,
        name: str = "eval",
    ):
        if not callable(eval_fn):
            raise TypeError(f"EvalCallback: eval_fn: expected trainer -> float, got {type(eval_fn).__name__}")
        every = check_int("EvalCallback: every", every, lo=1)
        target = check_float("EvalCallback: target", target, allow_none=True)
        self.eval_fn, self.every, self.at_start, self.target, self.name = eval_fn, every, at_start, target, name
        self.curve: list[tuple[int, float]] = []
        self.seconds = 0.0
        self._last_step = 0

    def evaluate(self, trainer: Any, step: int) -> float:
        """Run eval_fn now, record (step, score) in the curve and return the score."""
        t0 = time.perf_counter()
        score = float(self.eval_fn(trainer))
        self.seconds += time.perf_counter() - t0
        self.curve.append((step, score))
        return score

    def reached(self, score: float) -> bool:
        return self.target is not None and score >= self.target

    def on_train_begin(self, trainer: Any, num_steps: int) -> bool | None:
        self._last_step = trainer.step_count + num_steps
        if self.at_start:
            return self.reached(self.evaluate(trainer, trainer.step_count))
        return None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> bool | None:
        if step % self.every and step != self._last_step:
            return None
        score = self.evaluate(trainer, step)
        metrics[self.name] = score
        return self.reached(score)

    def on_train_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        # stopped early by another callback: the last step run still gets its evaluation
        if history and (not self.curve or self.curve[-1][0] != trainer.step_count):
            history[-1][self.name] = self.evaluate(trainer, trainer.step_count)

    def progress_fields(self) -> dict[str, str]:
        return {self.name: f"{self.curve[-1][1]:.2f}"} if self.curve else {}


__all__ = ["TrainerCallback", "EvalCallback"]
