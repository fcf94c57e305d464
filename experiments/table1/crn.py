"""Common random numbers across the methods of one Table-1 seed: `StepSeeds`, the callback that starts the
token sampler's stream from the same state at every step, and `step_seed`, that state's seed.

What this is: with it, every method of a seed shares the warm-up weights (RAPO_SFT_NO_RETRIEVE excepted: its point
is another warm-up), the RL question order (RAPOTrainer.sample_problems reads `random.Random(config.seed)` only) and
the sampler's state at each step's start, so the coin of the retrieval / branching / off-policy decisions and the
first token draws agree whatever earlier steps consumed. What is not shared: the rollouts once the policies differ,
and which draw a row gets within a step once the batches' shapes differ (experiments/table1/runner.md).
What this is not: a variance-reduction estimator; it only removes the between-method noise of the code's random
sources.
"""

from __future__ import annotations

import random
from typing import Any

from rapo_fast.train.callbacks import TrainerCallback


def step_seed(seed: int, step: int) -> int:
    """The sampler's seed for RL step `step` (0-based: the step about to run) of run seed `seed`: a 63-bit draw from a
    generator named by both, so that neighbouring seeds or steps get unrelated streams."""
    for name, v in (("seed", seed), ("step", step)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"step_seed: {name} must be a non-negative int, got {v!r}")
    return random.Random(f"table1-step/{seed}/{step}").getrandbits(63)


class StepSeeds(TrainerCallback):
    """Reseeds the trainer's token generator before every step: before the first at train begin, before each next one
    after the previous step ends (step_seed(seed, trainer.step_count))."""

    def __init__(self, seed: int):
        step_seed(seed, 0)  # validates the seed
        self.seed = seed

    def _reseed(self, trainer: Any) -> None:
        trainer.gen.manual_seed(step_seed(self.seed, trainer.step_count))

    def on_train_begin(self, trainer: Any, num_steps: int) -> bool | None:
        self._reseed(trainer)
        return None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> bool | None:
        self._reseed(trainer)
        return None


__all__ = ["step_seed", "StepSeeds"]
