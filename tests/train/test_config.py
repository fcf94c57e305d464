"""TrainerConfig's checks: every field has a rule (type and range), and each bad value raises TypeError/ValueError
naming the field. Once NaN/inf reached lr, temperature, retrieve_prob and others, temperature=0 and tis_cap=0 passed,
bools passed as ints, and lr=inf turned the parameters NaN at the first step.
Not here: a training step, resume or the presets' contents (test_trainer.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from rapo_fast.train.config import _FIELD_RULES, TrainerConfig

NAN, INF = float("nan"), float("inf")

# field -> bad values (each raises TypeError or ValueError naming the field)
BAD = {
    "strategy": ["beam", 3],
    "group_size": [0, -1, True, 2.0],
    "n_hybrid": [-1, 17, True, 1.5],
    "retrieve_prob": [NAN, INF, -0.1, 1.5, True, "0.5"],
    "mode": ["fast", None],
    "prompts_per_step": [0, True],
    "temperature": [0.0, -1.0, NAN, INF, False],
    "max_steps": [0, 2.5],
    "max_step_tokens": [0, None],
    "exclude_own_group": ["yes", 1, 0.0],
    "arpo_initial": [0, 17, True, 1.0],
    "arpo_beam": [0, True],
    "arpo_k": [0, "20"],
    "arpo_alpha": [NAN, INF, -0.1, 1.1],
    "arpo_beta": [NAN, INF, -INF, "0.2"],
    "advantage_attribution": ["medium", None],
    "ret_coef": [NAN, INF, True],
    "ret_norm": ["all", None, 1],
    "loss": [None, {"warp": 1}, {1: 0.2}, {"beta": 0.04}, {"eps_high": NAN}, {"return_metrics": True}],
    "tis_cap": [0.0, -1.0, NAN, INF, True],
    "lr": [NAN, INF, -1e-3, "1e-3"],
    "weight_decay": [NAN, INF, -0.1],
    "max_grad_norm": [NAN, INF, 0.0, -1.0],
    "updates_per_step": [0, True],
    "n_offpolicy": [0, -1, 1.5, True],
    "arpo_rule": ["Paper", None, 1],
    "arpo_topk": [0, 2.5],
    "mini_batch_groups": [0, -1, 1.5, True, "2"],
    "add_onpolicy_steps": ["no", 1],
    "refresh_kv_every": [0, 1.0],
    "seed": [True, 1.5, -1, 2**64, "0"],
    "log_csv": [3, b"x.csv"],
    "tensorboard_dir": [3, ["runs"]],
}


def test_every_field_has_a_rule_and_bad_cases():
    names = {f.name for f in dataclasses.fields(TrainerConfig)}
    assert set(_FIELD_RULES) == names
    assert set(BAD) == names


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD.items() for v in vs], ids=lambda x: repr(x)[:20])
def test_bad_field_value_raises_naming_it(name, value):
    with pytest.raises((TypeError, ValueError), match=name):
        TrainerConfig.RAPO(**{name: value})
    with pytest.raises((TypeError, ValueError), match=name):
        TrainerConfig(**{name: value}).validate()


def test_good_values_pass():
    TrainerConfig.RAPO(tis_cap=None, max_grad_norm=None, lr=0.0, exclude_own_group=True, seed=2**63 - 1)
    TrainerConfig.ARPO(arpo_initial=16, arpo_beta=-0.5, log_csv="x.csv", tensorboard_dir="runs")
    TrainerConfig.GRPO(retrieve_prob=1, temperature=0.7, loss={"eps_high": 0.28, "loss_agg": "token-mean"})
