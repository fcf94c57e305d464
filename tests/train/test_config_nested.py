"""The nested TrainerConfig: YAML/JSON round trips of non-default sections, dotted and nested overrides, errors that
name the dotted field, the conversion of the former flat format (every flat field lands in its nested place; a
converted config equals the nested one built directly and trains identically; load warns), flat keywords refused by
the presets with their new place, and the strategy registry. Not here: each field's bad values (test_config.py)."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from rapo_fast.loss import presets
from rapo_fast.loss.options import LossOptions
from rapo_fast.rollouts.config import STRATEGIES, STRATEGY_CONFIG_FIELDS, ARPOConfig, HybridConfig, RolloutConfig
from rapo_fast.rollouts.strategies import STRATEGY_REGISTRY, RolloutStrategy
from rapo_fast.train.config import TrainerConfig
from rapo_fast.train.config_compat import FLAT_FIELDS, convert_flat_config

# a config in the former flat format, every field set to a value other than its default where one is allowed
FLAT = {
    "strategy": "arpo",
    "group_size": 8,
    "n_hybrid": 0,
    "retrieve_prob": 0.25,
    "mode": "splice",
    "prompts_per_step": 3,
    "temperature": 0.7,
    "max_steps": 4,
    "max_step_tokens": 12,
    "exclude_own_group": True,
    "n_offpolicy": 2,
    "arpo_initial": 3,
    "arpo_beam": 4,
    "arpo_k": 5,
    "arpo_alpha": 0.6,
    "arpo_beta": 0.3,
    "arpo_rule": "released",
    "arpo_topk": 7,
    "advantage_attribution": "hard",
    "ret_coef": 0.1,
    "ret_norm": "retrieved",
    "loss": {"eps_high": 0.3, "dual_clip": 3.0},
    "tis_cap": 1.5,
    "lr": 2e-3,
    "weight_decay": 0.01,
    "max_grad_norm": 0.5,
    "updates_per_step": 2,
    "mini_batch_groups": 1,
    "add_onpolicy_steps": True,
    "refresh_kv_every": 2,
    "seed": 7,
    "log_csv": "m.csv",
    "tensorboard_dir": "tb",
}


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _load_flat(d):
    with pytest.warns(FutureWarning, match="convert_flat_config"):
        return TrainerConfig.from_dict(d)


def test_every_flat_field_lands_in_its_nested_place():
    assert len(FLAT_FIELDS) == 33 and set(FLAT) == set(FLAT_FIELDS)
    cfg = _load_flat(FLAT)
    for old, new in FLAT_FIELDS.items():
        if old != "loss":
            assert _get(cfg, new) == FLAT[old], (old, new)
    # the flat loss dict was the whole loss: options it left out are rapo_loss's defaults, not the RAPO preset's
    assert cfg.loss == LossOptions(eps_high=0.3, dual_clip=3.0, tis_cap=1.5)


def test_converted_flat_defaults_equal_the_presets():
    """The former defaults of each preset, written flat (as the former to_dict wrote them), load as the preset."""
    base = {k: v for k, v in FLAT.items() if k not in ("loss", "tis_cap")}
    base |= dict(strategy="hybrid", n_hybrid=8, mode="exact", temperature=1.0, arpo_initial=None, lr=1e-3)
    assert _load_flat(base | {"loss": dict(presets.RAPO), "tis_cap": 2.0}).loss == TrainerConfig.RAPO().loss
    assert _load_flat({"lr": 1e-3}) == TrainerConfig.RAPO()  # missing loss and tis_cap: the former defaults
    grpo_flat = {"strategy": "on_policy", "n_hybrid": 0, "ret_coef": 0.0, "loss": dict(presets.RAPO, shaping_m=0.0)}
    assert _load_flat(grpo_flat) == TrainerConfig.GRPO()
    arpo_flat = {
        "strategy": "arpo",
        "n_hybrid": 0,
        "ret_coef": 0.0,
        "loss": dict(presets.ARPO),
        "arpo_rule": "released",
    }
    assert _load_flat(arpo_flat) == TrainerConfig.ARPO({"rollout.arpo.rule": "released"})
    assert convert_flat_config(grpo_flat)["rollout"] == {"strategy": "on_policy", "hybrid": {"n_hybrid": 0}}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_old_flat_file_loads_with_a_warning_and_round_trips_nested(tmp_path, suffix):
    import yaml

    p = tmp_path / f"old{suffix}"
    p.write_text(json.dumps(FLAT) if suffix == ".json" else yaml.safe_dump(FLAT))
    with pytest.warns(FutureWarning, match="flat format"):
        cfg = TrainerConfig.load(p)
    assert cfg == _load_flat(FLAT)
    cfg.save(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved file is nested: no conversion
        assert TrainerConfig.load(p) == cfg
    assert "rollout" in p.read_text() and "arpo_beam" not in p.read_text()


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
        ({"rollout.arpo.bem": 2}, ValueError, "rollout.arpo: unknown fields ['bem']"),
        ({"rollout.strategy": "on_policy"}, ValueError, "rollout.hybrid.n_hybrid: must be 0"),
        ({"optimizer": {}}, ValueError, "TrainerConfig: unknown fields ['optimizer']"),
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


def test_presets_refuse_flat_keywords_saying_where_they_went():
    with pytest.raises(TypeError, match=re.escape("arpo_beam -> 'rollout.arpo.beam'")):
        TrainerConfig.ARPO(arpo_beam=3)
    with pytest.raises(TypeError, match=re.escape("tis_cap -> 'loss.tis_cap'")):
        TrainerConfig.RAPO({"tis_cap": 1.0})


def test_rollout_config_standalone():
    cfg = RolloutConfig(strategy="arpo", group_size=6, arpo={"beam": 3})
    assert cfg.arpo == ARPOConfig(beam=3) and cfg.n_initial == 3 and cfg.strategy_config is cfg.arpo
    assert RolloutConfig(strategy="on_policy").strategy_config is None
    assert RolloutConfig(temperature=0.0).temperature == 0.0  # greedy decoding is a valid rollout
    assert RolloutConfig(hybrid={"retrieve_prob": lambda step: 0.1}).hybrid.retrieve_prob(3) == 0.1
    assert RolloutConfig.from_legacy({"arpo_beam": 3, "n_hybrid": 2}) == RolloutConfig(
        arpo={"beam": 3}, hybrid={"n_hybrid": 2}
    )
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


def test_converted_config_trains_identically():
    """One GRPO step from a flat config (converted) and from the nested one built directly: equal metrics, weights."""
    from rapo_fast.demo.tasks import ChainArithmeticTask
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.train.trainer import RAPOTrainer

    task = ChainArithmeticTask()
    tok, problems = task.tokenizer(), task.make_problems(4, seed=0)
    flat = {
        "strategy": "on_policy",
        "n_hybrid": 0,
        "ret_coef": 0.0,
        "loss": dict(presets.RAPO, shaping_m=0.0),
        "group_size": 2,
        "prompts_per_step": 1,
        "max_step_tokens": 4,
        "max_steps": 1,
    }
    nested = TrainerConfig.GRPO(
        {"rollout.group_size": 2, "prompts_per_step": 1, "rollout.max_step_tokens": 4, "rollout.max_steps": 1}
    )
    out = []
    for cfg in (_load_flat(flat), nested):
        model = build_tiny_policy(tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, seed=0)
        m = RAPOTrainer(model, tok, task, None, cfg, problems).step()
        kept = sorted((k, v) for k, v in m.items() if not k.startswith("t_") and k != "tokens_per_s")  # not timings
        out.append((repr(kept), [p.detach() for p in model.parameters()]))  # repr: NaN metrics compare equal
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))
