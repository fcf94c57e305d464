"""The verl recipe (examples/verl/) cannot go stale: its config, and its 1-GPU smoke (the base plus the group option
`+recipe=smoke_1gpu`), compose on top of verl's own ppo_trainer config the way `verl.trainer.main_ppo` composes them
and pass verl's `validate_config`; every name it selects (advantage
estimator, policy loss, agent loop, checkpoint callback, reward function, function tool) resolves to rapo_fast's
registered or importable part; the agent-loop YAML's RAPO knobs are the loop's own; the launch script points at that
config; the data preparation writes the fields verl's dataset reads; the search tool's local backend answers through
the tool verl loads; verl's own rollout dump writer writes what the traces tests' copy of it writes
(tests/helpers/verl_dump.py). It cannot run here (8 GPUs, vLLM, a retrieval
server); nothing here pretends to. Not here: the parts' behaviour (the other test_verl_*.py files)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "verl"


def _compose(overrides: list[str]):
    import os

    from hydra import compose, initialize_config_dir

    os.environ["RAPO_RECIPE_DIR"] = str(RECIPE)
    try:
        with initialize_config_dir(config_dir=str(RECIPE / "config"), version_base=None):
            return compose(config_name="rapo_trainer", overrides=overrides)
    finally:
        os.environ.pop("RAPO_RECIPE_DIR", None)


@pytest.fixture(scope="module")
def cfg():
    return _compose([])


@pytest.fixture(scope="module")
def smoke():
    return _compose(["+recipe=smoke_1gpu"])


def _validate(config):
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    return actor, rollout


def test_launch_script_runs_main_ppo_on_this_config():
    text = (RECIPE / "run_rapo_qwen2_5_7b.sh").read_text()
    assert "-m verl.trainer.main_ppo" in text
    assert '--config-path="$RECIPE_DIR/config"' in text and "--config-name=rapo_trainer" in text
    assert (RECIPE / "config" / "rapo_trainer.yaml").exists()


def test_config_composes_and_passes_verl_validation(cfg):
    from verl.trainer.main_ppo import need_reference_policy

    actor, rollout = _validate(cfg)
    # the paper's setting
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == (8, 1)
    assert rollout.n == 16 and rollout.name == "vllm" and rollout.calculate_log_probs
    assert actor.clip_ratio_low == actor.clip_ratio_high == 0.28
    assert actor.loss_agg_mode == "seq-mean-token-mean" and not actor.use_kl_loss and actor.kl_loss_coef == 0
    assert not cfg.algorithm.use_kl_in_reward and not need_reference_policy(cfg)
    assert cfg.algorithm.rapo_ret_coef == 0.2 and cfg.algorithm.rapo_ret_norm == "group"  # the formula as written
    assert cfg.rapo.retrieve_prob == 0.5 and cfg.rapo.n_hybrid == 8
    assert list(cfg.trainer.logger) == ["console", "wandb"] and cfg.trainer.project_name == "rapo"


def test_smoke_recipe_is_the_base_with_small_overrides_and_passes_verl_validation(cfg, smoke):
    from omegaconf import OmegaConf

    from rapo_fast.integrations.verl.agent_loop import resolve_loop_config

    actor, rollout = _validate(smoke)
    assert (smoke.trainer.n_gpus_per_node, smoke.trainer.nnodes, smoke.trainer.total_training_steps) == (1, 1, 2)
    assert (
        smoke.actor_rollout_ref.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and rollout.tensor_model_parallel_size == 1
    )
    assert rollout.name == "vllm" and rollout.n == 4 and smoke.data.train_batch_size == 2
    assert list(smoke.trainer.logger) == ["console"]
    resolved = resolve_loop_config(smoke.rapo, {}, rollout.n)  # the loop's knobs: G = 4, half hybrid as the base
    assert (resolved.group_size, resolved.hybrid.n_hybrid, resolved.hybrid.retrieve_prob) == (4, 2, 0.5)
    # every RAPO and loss knob is the base's: the override file changes sizes only
    same = ["algorithm", "actor_rollout_ref.actor.policy_loss", "reward", "trainer.checkpoint_callback_class"]
    same += [
        "actor_rollout_ref.rollout.multi_turn.function_tool_path",
        "actor_rollout_ref.rollout.agent.default_agent_loop",
    ]
    for key in same:
        assert OmegaConf.select(smoke, key) == OmegaConf.select(cfg, key), key
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.28, 0.28, "seq-mean-token-mean")
    base, over = OmegaConf.to_container(cfg), OmegaConf.to_container(smoke)
    changed = sorted(_diff(base, over))
    assert len(changed) <= 25, changed  # small overrides, not a restated config


def _diff(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _diff(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")


def test_smoke_launch_script_selects_the_smoke_option_and_its_data():
    text = (RECIPE / "run_rapo_smoke_1gpu.sh").read_text()
    assert "-m verl.trainer.main_ppo" in text and "--config-name=rapo_trainer" in text and "+recipe=smoke_1gpu" in text
    assert 'RAPO_SEARCH_BACKEND="${RAPO_SEARCH_BACKEND:-local}"' in text and "smoke/corpus.jsonl" in text
    assert "trainer.logger=[console,wandb]" in text  # RAPO_WANDB=1
    for name in ("questions.jsonl", "corpus.jsonl", "traces.jsonl"):
        assert name in text and (RECIPE / "smoke" / name).exists()


def test_launch_scripts_hand_the_rapo_variables_to_every_ray_worker():
    import os
    import subprocess

    for script in ("run_rapo_qwen2_5_7b.sh", "run_rapo_smoke_1gpu.sh"):
        assert '"${RAPO_RAY_ENV[@]}"' in (RECIPE / script).read_text(), script
    env = {"PATH": os.environ["PATH"], "RAPO_SEARCH_URL": "http://10.0.0.7:8000/retrieve", "RAPO_DATA_DIR": "/nfs/a b"}
    got = subprocess.run(
        ["bash", "-c", f'source "{RECIPE / "ray_env.sh"}"; printf "%s\\n" "${{RAPO_RAY_ENV[@]}}"'],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(got) == 2
    # what the scripts pass composes into verl's ray.init runtime_env (main_ppo merges it over verl's defaults)
    env_vars = _compose(["+recipe=smoke_1gpu", *got]).ray_kwargs.ray_init.runtime_env.env_vars
    assert dict(env_vars) == {"RAPO_SEARCH_URL": "http://10.0.0.7:8000/retrieve", "RAPO_DATA_DIR": "/nfs/a b"}


def test_every_selected_name_resolves_to_a_registered_part(cfg):
    import verl  # noqa: F401  (loads rapo_fast's plugin)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo import core_algos

    assert cfg.algorithm.adv_estimator in core_algos.ADV_ESTIMATOR_REGISTRY
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode in core_algos.POLICY_LOSS_REGISTRY
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop in _agent_loop_registry
    module, _, name = cfg.trainer.checkpoint_callback_class.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_agent_loop_yaml_sets_only_the_loops_own_knobs(cfg):
    import hydra
    from omegaconf import OmegaConf

    from rapo_fast.integrations.verl.agent_loop import LOOP_KEYS, resolve_loop_config

    entries = OmegaConf.load(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    (entry,) = [e for e in entries if e.name == "rapo_tool_agent"]
    cls = hydra.utils.get_class(entry._target_)
    assert cls.__name__ == "RAPOToolAgentLoop"
    knobs = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
    assert set(knobs) <= set(LOOP_KEYS), knobs
    resolved = resolve_loop_config(cfg.rapo, knobs, int(cfg.actor_rollout_ref.rollout.n))  # raises on a bad value
    assert (resolved.hybrid.retrieve_prob, resolved.hybrid.n_hybrid, resolved.exclude_own_group) == (0.5, 8, True)


def test_tool_and_reward_load_as_verl_loads_them(cfg):
    from omegaconf import OmegaConf
    from verl.tools.function_tool import load_function_tools_from_path

    OmegaConf.resolve(cfg)
    tools = load_function_tools_from_path(cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path)
    assert [t.name for t in tools] == ["search"]
    assert "query" in json.dumps(tools[0].tool_schema.model_dump())
    spec = importlib.util.spec_from_file_location("rapo_recipe_reward", cfg.reward.custom_reward_function.path)
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    score = getattr(reward, cfg.reward.custom_reward_function.name)
    assert score("s", "think <answer> The Eiffel Tower. </answer>", ["eiffel tower"]) == 1.0
    assert score("s", "<answer>a</answer> then <answer>Paris</answer>", "paris") == 1.0  # the last answer counts
    assert score("s", "no answer tag: paris", ["paris"]) == 0.0
    assert score("s", "<answer>Lyon</answer>", ["paris", "PARIS!"]) == 0.0


def test_search_tool_local_backend_answers_through_the_tool_verl_loads(smoke, monkeypatch):
    import asyncio

    from omegaconf import OmegaConf
    from verl.tools.function_tool import load_function_tools_from_path, normalize_function_tool_return

    monkeypatch.setenv("RAPO_SEARCH_BACKEND", "local")
    monkeypatch.setenv("RAPO_SEARCH_CORPUS", str(RECIPE / "smoke" / "corpus.jsonl"))
    path = OmegaConf.to_container(smoke, resolve=True)["actor_rollout_ref"]["rollout"]["multi_turn"]
    (tool,) = load_function_tools_from_path(path["function_tool_path"])
    # as verl's agent loop calls a function tool: call(), then its return normalised into a ToolResponse
    response, _, _ = normalize_function_tool_return(asyncio.run(tool.call({"query": "director of Inception"})))
    assert response.text.startswith('Doc 1: "Inception"') and "Christopher Nolan" in response.text
    monkeypatch.setenv("RAPO_SEARCH_BACKEND", "nope")
    with pytest.raises(ValueError, match="RAPO_SEARCH_BACKEND must be one of"):
        asyncio.run(tool.call({"query": "x"}))


def test_verls_rollout_dump_writer_matches_the_traces_tests_copy(tmp_path):
    from helpers.verl_dump import write_generations

    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
    args = (["p1", "p2"], ["o1 é", "o2"], [["a"], None], [1.0, 0.0], {"uid": ["u_0_0", "u_1_0"], "short": [1]})
    trainer_base.PPOTrainer._write_generations(*args, str(tmp_path / "verl"), 7)
    ours = write_generations(*args, str(tmp_path / "ours"), 7)
    assert (tmp_path / "verl" / "7.jsonl").read_bytes() == Path(ours).read_bytes()


def test_prepare_data_writes_verls_fields(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    spec = importlib.util.spec_from_file_location("rapo_recipe_prep", RECIPE / "prepare_data.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    src = tmp_path / "q.jsonl"
    src.write_text(json.dumps({"question": "Who?", "answer": ["A", "B"], "id": 7}) + "\n")
    prep.main(["--train", str(src), "--val", str(src), "--out", str(tmp_path / "out")])
    row = pd.read_parquet(tmp_path / "out" / "train.parquet").iloc[0]
    assert row["agent_name"] == "rapo_tool_agent" and row["extra_info"]["index"] == 7
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1]["content"] == "Who?"
    assert list(row["reward_model"]["ground_truth"]) == ["A", "B"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(ValueError, match=re.escape("expected keys 'question' and 'answer'")):
        prep.main(["--train", str(bad), "--val", str(bad), "--out", str(tmp_path / "o2")])
