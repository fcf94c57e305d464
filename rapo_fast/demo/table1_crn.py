"""Common random numbers across the methods of one `rapo-fast table1` seed: what the runs of a seed share, and the
callback that makes the token sampler's stream start from the same state at every step.

What is shared, per seed, by every method (so that the paired difference by seed compares methods, not draws):
- the weights at the start (one warm-up file per seed; RAPO_SFT_NO_RETRIEVE alone starts from the warm-up without
  retrieved steps) and torch's global seed when the policy is built;
- the RL question order: RAPOTrainer.sample_problems draws from `random.Random(config.seed)`, which nothing else
  reads, `prompts_per_step` questions a step from the same training list, so step t asks the same questions under
  every method (GRPO_ONPOLICY_MATCHED included: it changes the group size, not the questions);
- the token sampler's generator at the start of each step: `StepSeeds` reseeds `trainer.gen` before step t from
  (seed, t), so the coin of the retrieval / branching / off-policy decisions (the rollout's first draw from it) and
  the first token draws are the same for every method at every step, whatever the earlier steps consumed;
- the held-out questions, the evaluation (greedy, no draws) and the continuous endpoint (teacher-forced, no draws).
What is not shared: the rollouts themselves once the policies differ (different probabilities turn the same uniform
draws into different tokens), and, within a step, which draw a row gets depends on the batch's shape (a method with
more rows, retrieved blocks or branches consumes the stream differently), so draws line up row for row only while
the rows do. The optimiser's updates differ by construction. What this is not: a variance-reduction estimator; it
only removes the between-method noise that the code's random sources would otherwise add.
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
