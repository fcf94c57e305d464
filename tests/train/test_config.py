"""TrainerConfig's checks: every field (each leaf of the nested sections, by dotted name) has a rule (type and range),
and each bad value raises TypeError/ValueError naming the field. Once NaN/inf reached lr, temperature, retrieve_prob
and others, temperature=0 and tis_cap=0 passed, bools passed as ints, and lr=inf turned the
parameters NaN at the first step.
Not here: a training step, resume or the presets' contents (test_trainer.py).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from rapo_fast.train.config import TrainerConfig

NAN, INF = float("nan"), float("inf")

# field -> bad values (each raises TypeError or ValueError naming the field)
BAD = {
    "rollout.strategy": ["beam", 3],
    "rollout.group_size": [0, -1, True, 2.0],
    "rollout.hybrid.n_hybrid": [-1, 17, True, 1.5],
    "rollout.hybrid.retrieve_prob": [NAN, INF, -0.1, 1.5, True, "0.5"],
    "rollout.mode": ["fast", None],
    "prompts_per_step": [0, True],
    "rollout.temperature": [0.0, -1.0, NAN, INF, False],
    "rollout.max_steps": [0, 2.5],
    "rollout.max_step_tokens": [0, None],
    "rollout.exclude_own_group": ["yes", 1, 0.0],
    "rollout.arpo.initial": [0, 17, True, 1.0],
    "rollout.arpo.beam": [0, True],
    "rollout.arpo.k": [0, "20"],
    "rollout.arpo.alpha": [NAN, INF, -0.1, 1.1],
    "rollout.arpo.beta": [NAN, INF, -INF, "0.2"],
    "advantages.advantage_attribution": ["medium", None],
    "advantages.ret_coef": [NAN, INF, True],
    "advantages.ret_norm": ["all", None, 1],
    "loss": [None, {"warp": 1}, {1: 0.2}, {"beta": 0.04}, {"eps_high": NAN}, {"return_metrics": True}],
    "loss.tis_cap": [0.0, -1.0, NAN, INF, True],
    "optim.lr": [NAN, INF, -1e-3, "1e-3"],
    "optim.weight_decay": [NAN, INF, -0.1],
    "optim.max_grad_norm": [NAN, INF, 0.0, -1.0],
    "optim.updates_per_step": [0, True],
    "rollout.offpolicy_traj.n_offpolicy": [0, -1, 1.5, True],
    "rollout.arpo.rule": ["Paper", None, 1],
    "rollout.arpo.topk": [0, 2.5],
    "optim.mini_batch_groups": [0, -1, 1.5, True, "2"],
    "buffer.add_onpolicy_steps": ["no", 1],
    "buffer.refresh_kv_every": [0, 1.0],
    "seed": [True, 1.5, -1, 2**64, "0"],
    "logging.log_csv": [3, b"x.csv"],
    "logging.tensorboard_dir": [3, ["runs"]],
}


def _leaves(section, prefix=""):
    """Dotted names of the checked fields: every leaf of the nested sections (loss: one field, a LossOptions)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value) and f.name != "loss":
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            assert "check" in f.metadata, f"{prefix}{f.name} has no rule"
            yield f"{prefix}{f.name}"


def test_every_field_has_a_rule_and_bad_cases():
    names = set(_leaves(TrainerConfig()))
    assert set(BAD) - {"loss.tis_cap"} == names


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD.items() for v in vs], ids=lambda x: repr(x)[:20])
def test_bad_field_value_raises_naming_it(name, value):
    with pytest.raises((TypeError, ValueError), match=re.escape(name)):
        TrainerConfig.RAPO({name: value})
    with pytest.raises((TypeError, ValueError), match=re.escape(name)):
        TrainerConfig().replace({name: value}).validate()


def test_good_values_pass():
    TrainerConfig.RAPO(
        {
            "loss.tis_cap": None,
            "optim.max_grad_norm": None,
            "optim.lr": 0.0,
            "rollout.exclude_own_group": True,
            "seed": 2**63 - 1,
        }
    )
    TrainerConfig.ARPO(
        {
            "rollout.arpo.initial": 16,
            "rollout.arpo.beta": -0.5,
            "logging.log_csv": "x.csv",
            "logging.tensorboard_dir": "runs",
        }
    )
    TrainerConfig.GRPO(
        {"rollout.hybrid.retrieve_prob": 1, "rollout.temperature": 0.7},
        loss={"eps_high": 0.28, "loss_agg": "token-mean"},
    )
