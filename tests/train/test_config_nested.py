"""The nested TrainerConfig: YAML/JSON round trips of non-default sections, dotted and nested overrides, errors that
name the dotted field, and the strategy registry. Not here: each field's bad values (test_config.py)."""

from __future__ import annotations

import re

import pytest

from rapo_fast.rollouts.config import STRATEGIES, STRATEGY_CONFIG_FIELDS, ARPOConfig, HybridConfig, RolloutConfig
from rapo_fast.rollouts.strategies import STRATEGY_REGISTRY, RolloutStrategy
from rapo_fast.train.config import TrainerConfig


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_nested_round_trip_of_every_section(tmp_path, suffix):
    cfg = TrainerConfig.ARPO(
        {"rollout.arpo.beam": 3, "rollout.arpo.rule": "released", "rollout.group_size": 6, "optim.lr": 3e-4},
        advantages={"advantage_attribution": "hard", "ret_norm": "retrieved"},
        buffer={"add_onpolicy_steps": True},
        logging={"log_csv": "x.csv"},
        seed=5,
    )
    cfg.save(tmp_path / f"c{suffix}")
    back = TrainerConfig.load(tmp_path / f"c{suffix}")
    assert back == cfg and back.rollout.arpo == ARPOConfig(beam=3, rule="released")
    assert TrainerConfig.from_dict(cfg.to_dict()) == cfg == TrainerConfig.from_json(cfg.to_json())
    assert TrainerConfig.from_yaml(cfg.to_yaml()) == cfg
    assert set(cfg.to_dict()) == {
        "rollout",
        "advantages",
        "loss",
        "optim",
        "buffer",
        "logging",
        "prompts_per_step",
        "seed",
    }
    assert set(cfg.to_dict()["rollout"]) >= {"hybrid", "arpo", "offpolicy_traj"}


def test_overrides_nested_dotted_and_objects_agree():
    a = TrainerConfig.RAPO({"rollout.group_size": 4, "rollout.hybrid.n_hybrid": 2, "loss.eps_high": 0.3})
    b = TrainerConfig.RAPO(rollout={"group_size": 4, "hybrid": {"n_hybrid": 2}}, loss={"eps_high": 0.3})
    c = TrainerConfig.RAPO().replace(
        rollout=TrainerConfig.RAPO().rollout.replace(group_size=4, hybrid=HybridConfig(n_hybrid=2)),
        loss=TrainerConfig.RAPO().loss.replace(eps_high=0.3),
    )
    assert a == b == c and a.loss.shaping_m == 0.05  # a dict for a section updates it, keeping the preset's values
    assert TrainerConfig.GRPO({"rollout.group_size": 4}).rollout.strategy == "on_policy"
    assert TrainerConfig.from_dict({"rollout": {"arpo": {"beam": 3}}}).rollout.arpo.beam == 3


@pytest.mark.parametrize(
    "override, err, path",
    [
        ({"rollout.arpo.beam": 0}, ValueError, "rollout.arpo.beam"),
        ({"rollout.arpo.rule": "Paper"}, ValueError, "rollout.arpo.rule"),
        ({"rollout.hybrid.n_hybrid": 17}, ValueError, "rollout.hybrid.n_hybrid"),
        ({"rollout.hybrid.retrieve_prob": "0.5"}, TypeError, "rollout.hybrid.retrieve_prob"),
        ({"rollout.offpolicy_traj.n_offpolicy": 1.5}, TypeError, "rollout.offpolicy_traj.n_offpolicy"),
        ({"rollout.temperature": 0.0}, ValueError, "rollout.temperature"),
        ({"optim.max_grad_norm": -1.0}, ValueError, "optim.max_grad_norm"),
        ({"loss.eps_high": float("nan")}, ValueError, "loss.eps_high"),
        ({"loss.beta": 0.04}, ValueError, "loss.beta"),
        ({"rollout.arpo.bem": 2}, ValueError, "rollout.arpo: expected fields among"),
        ({"rollout.strategy": "on_policy"}, ValueError, "rollout.hybrid.n_hybrid: expected 0"),
        ({"optimizer": {}}, ValueError, "TrainerConfig: expected fields among"),
    ],
)
def test_errors_name_the_dotted_field(override, err, path):
    with pytest.raises(err, match=re.escape(path)):
        TrainerConfig.RAPO(override)


def test_load_error_names_the_file_and_the_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rollout:\n  arpo:\n    beam: 0\n")
    with pytest.raises(ValueError, match=re.escape(f"{p}: rollout.arpo.beam")):
        TrainerConfig.load(p)


def test_rollout_config_standalone():
    cfg = RolloutConfig(strategy="arpo", group_size=6, arpo={"beam": 3})
    assert cfg.arpo == ARPOConfig(beam=3) and cfg.n_initial == 3 and cfg.strategy_config is cfg.arpo
    assert RolloutConfig(strategy="on_policy").strategy_config is None
    assert RolloutConfig(temperature=0.0).temperature == 0.0  # greedy decoding is a valid rollout
    assert RolloutConfig(hybrid={"retrieve_prob": lambda step: 0.1}).hybrid.retrieve_prob(3) == 0.1
    with pytest.raises(ValueError, match=re.escape("rollout.arpo.initial")):
        RolloutConfig(strategy="arpo", group_size=2, arpo={"initial": 3})
    with pytest.raises(TypeError, match="retrieve_prob"):  # the trainer saves its config: no callable
        TrainerConfig.RAPO(rollout=RolloutConfig(hybrid={"retrieve_prob": lambda step: 0.1}))


def test_strategy_registry():
    assert set(STRATEGY_REGISTRY) == set(STRATEGY_CONFIG_FIELDS) == set(STRATEGIES)
    for name, cls in STRATEGY_REGISTRY.items():
        assert issubclass(cls, RolloutStrategy) and cls.name == name
        assert cls.config_field == STRATEGY_CONFIG_FIELDS[name]
        cfg = RolloutConfig(strategy=name, hybrid={"n_hybrid": 0})
        assert cls(cfg).sub is cfg.strategy_config
