"""Common random numbers across table1's methods (experiments/table1/crn.py): the per-step sampler seeds, the
callback that applies them, and, through run_one in miniature, that the methods of a seed ask the same questions at
every step from the same sampler state and start from the same continuous endpoint."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from experiments.table1 import jobs, setting
from experiments.table1.crn import StepSeeds, step_seed
from experiments.table1.families import AliasFamily
from rapo_fast.train.trainer import RAPOTrainer


def test_step_seeds_are_fixed_and_distinct():
    grid = [(seed, step) for seed in range(5) for step in range(20)]
    seeds = [step_seed(a, b) for a, b in grid]
    assert seeds == [step_seed(a, b) for a, b in grid]
    assert len(set(seeds)) == len(grid) and all(0 <= x < 2**63 for x in seeds)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="step_seed: seed must be a non-negative int"):
            step_seed(bad, 0)
    with pytest.raises(ValueError, match="step_seed: step must be a non-negative int, got -2"):
        step_seed(0, -2)


def test_the_callback_reseeds_before_every_step():
    trainer = SimpleNamespace(gen=torch.Generator().manual_seed(123), step_count=0)
    cb = StepSeeds(7)

    def fresh(step):
        return torch.Generator().manual_seed(step_seed(7, step)).get_state()

    cb.on_train_begin(trainer, 5)
    assert torch.equal(trainer.gen.get_state(), fresh(0))
    torch.rand(50, generator=trainer.gen)  # what a step's rollout consumes does not carry over
    trainer.step_count = 3
    cb.on_step_end(trainer, 3, {})
    assert torch.equal(trainer.gen.get_state(), fresh(3))
    assert not torch.equal(fresh(3), fresh(4))


def test_methods_of_a_seed_share_questions_and_sampler_states(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    s = dict(
        setting.QUICK,
        seeds=1,
        sft_steps=4,
        rl_steps=3,
        eval_every=3,
        n_eval=12,
        n_train=8,
        solver_traces=4,
        families=["kb_alias"],
        methods=["GRPO", "RAPO", "GRPO_ONPOLICY_MATCHED"],
        encoder="hashed",
    )
    seen: list[tuple[list[int], torch.Tensor]] = []
    real = RAPOTrainer.sample_problems

    def recording(self):
        # called first thing in a step, before the rollout draws from the generator
        probs = real(self)
        seen.append(([p.qid for p in probs], self.gen.get_state().clone()))
        return probs

    monkeypatch.setattr(RAPOTrainer, "sample_problems", recording)
    monkeypatch.setattr(AliasFamily, "step_seeds", True, raising=False)  # kb_alias's recorded runs predate it
    paths = jobs.prepare("kb_alias", 0, s, tmp_path)
    rows, per_method = [], []
    for m in s["methods"]:
        seen.clear()
        rows.append(jobs.run_one("kb_alias", m, 0, s, paths, "hashed"))
        per_method.append(list(seen))
    grpo = per_method[0]
    assert len(grpo) == 3 and len({tuple(q) for q, _ in grpo}) > 1  # three steps, not one question set replayed
    for other in per_method[1:]:
        assert [q for q, _ in other] == [q for q, _ in grpo]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(other, grpo))
    for t, (_, state) in enumerate(grpo):
        assert torch.equal(state, torch.Generator().manual_seed(step_seed(0, t)).get_state())
    assert len({r["heldout_logp_start"] for r in rows}) == 1  # one warm-up, one endpoint
    assert all(math.isfinite(r["heldout_logp_start"]) and r["heldout_logp_final"] < 0.0 for r in rows)
