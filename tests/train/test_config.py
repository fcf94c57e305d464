"""TrainerConfig: every field (each leaf of the nested sections, by dotted name) has a rule (type and range), and each
bad value raises TypeError/ValueError naming the field (once NaN/inf reached lr, temperature, retrieve_prob and others,
temperature=0 and tis_cap=0 passed, bools passed as ints, and lr=inf turned the parameters NaN at the first step); the
presets' values; YAML/JSON round trips of non-default sections; dotted and nested overrides; the standalone
RolloutConfig; the strategy registry. Not here: a training step or resume (test_trainer.py), random field combinations
(tests/fuzz/test_fuzz_config.py).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from rapo_fast.rollouts.config import STRATEGIES, STRATEGY_CONFIG_FIELDS, ARPOConfig, HybridConfig, RolloutConfig
from rapo_fast.rollouts.strategies import STRATEGY_REGISTRY, RolloutStrategy
from rapo_fast.train.config import TrainerConfig

NAN, INF = float("nan"), float("inf")

# field -> bad values (each raises TypeError or ValueError naming the field)
BAD = {
    "rollout.strategy": ["beam", 3],
    "rollout.group_size": [0, -1, True, 2.0],
    "rollout.hybrid.n_hybrid": [-1, 17, True, 1.5],
    "rollout.hybrid.retrieve_prob": [NAN, INF, -0.1, 1.5, True, "0.5"],
    "rollout.hybrid.at_prompt": ["yes", 1, 0.0],
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


def test_presets_and_their_round_trips(tmp_path):
    for name in ("RAPO", "GRPO", "ARPO"):
        cfg = TrainerConfig.preset(name, {"rollout.group_size": 8})
        for suffix in (".yaml", ".json"):
            cfg.save(tmp_path / f"c{suffix}")
            assert TrainerConfig.load(tmp_path / f"c{suffix}") == cfg
    rapo = TrainerConfig.RAPO()
    ro = rapo.rollout
    assert (ro.group_size, ro.hybrid.n_hybrid, ro.hybrid.retrieve_prob, rapo.advantages.ret_coef) == (16, 8, 0.5, 0.2)
    assert rapo.loss.shaping_m == 0.05 and rapo.loss.eps_low == rapo.loss.eps_high == 0.28
    assert rapo.loss.loss_agg == "seq-mean-token-mean" and rapo.loss.beta == 0.0
    grpo = TrainerConfig.GRPO()
    assert grpo.rollout.hybrid.n_hybrid == 0 and grpo.rollout.strategy == "on_policy" and grpo.advantages.ret_coef == 0
    with pytest.raises(ValueError, match="preset"):
        TrainerConfig.preset("PPO")
    with pytest.raises(ValueError, match="unknown fields"):
        TrainerConfig.from_dict({"group_sise": 4})


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
        ({"rollout.strategy": "beam"}, ValueError, "rollout.strategy"),
        ({"rollout.group_size": 0}, ValueError, "rollout.group_size"),
        ({"rollout.hybrid.retrieve_prob": 1.5}, ValueError, "rollout.hybrid.retrieve_prob"),
        ({"rollout.mode": "fast"}, ValueError, "rollout.mode"),
        ({"optim.lr": "big"}, TypeError, "optim.lr"),
        ({"loss": {"eps_low": 0.2, "warp": 1}}, ValueError, "warp"),
        ({"advantages.advantage_attribution": "medium"}, ValueError, "advantages.advantage_attribution"),
    ],
)
def test_errors_are_typed_and_name_the_dotted_field(override, err, path):
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
