"""The step buffer grows from a verl job's own rollouts (rapo_fast/integrations/verl/buffer_growth.py): verl's real
AgentLoopWorker (its real constructor, from a tiny model directory) runs the RAPO agent loop, sends every finished
trajectory to verl's real RewardLoopWorker, whose reward manager is the "rapo" one built by verl's own
load_reward_manager around verl's NaiveRewardManager and a custom reward function; the manager adds the successful
training trajectories' tool steps to the buffer. Checked against the known trajectory layout: the right steps with
the right texts under the right group ids; nothing from failed trajectories, validation rollouts, or with the option
off; the score unchanged; a later rollout of another prompt retrieves an added step. Once in-process (the buffer is
rapo_fast's StepBufferClient over an in-process StepBufferActor, the reward worker called directly), once under Ray's
local CPU cluster (verl's RewardLoopManager starts the reward worker actor; the buffer is a Ray actor).

Driven around verl: the LLM server (a scripted server manager: every turn is `think X <tool_call> CALL </tool_call>`,
X = a, b, c for turns 1-3), and the AgentLoopManager's dispatch (generate_sequences is called on the worker directly).
Skipped without verl and ray (the main environment).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")
ray = pytest.importorskip("ray")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from helpers.ray_local import local_ray  # noqa: E402
from helpers.verl_tiny import chat_word_tokenizer  # noqa: E402

from rapo_fast.integrations.verl.buffer_requests import LocalHandle  # noqa: E402

CALL = '{"name":"lookup","arguments":{}}'
WORDS = (
    "<pad> <unk> <|im_start|> <|im_end|> system user assistant tool what is x y think a b c d "
    f"<tool_call> </tool_call> {CALL} fact one <retrieve> </retrieve>"
).split()
ID = {w: i for i, w in enumerate(WORDS)}
TURN, CTX = 6, 7  # tokens of one assistant turn; of one tool response + the next generation prompt
SPANS, OBS_END = [(0, 6), (13, 19), (26, 32)], [13, 26, 32]  # 3 turns (max_assistant_turns): the last is the answer
TOOL = '''
from verl.tools.function_tool import function_tool


@function_tool
def lookup() -> str:
    """Look the fact up."""
    return "fact one"
'''
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if ground_truth in solution_str.split() else 0.0
"""
GROWTH_FILE = "rapo_fast/integrations/verl/buffer_growth.py"


class ScriptedServer:
    """verl's server-manager interface: turn k of a trajectory (k = assistant turns already in the prompt) is
    `think X <tool_call> CALL </tool_call> <|im_end|>` with X = a, b, c, d for k = 0, 1, 2, >= 3; log-prob -0.5 each."""

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        k = sum(t == ID["assistant"] for t in prompt_ids) - 1
        words = ["think", "abcd"[min(k, 3)], "<tool_call>", CALL, "</tool_call>", "<|im_end|>"]
        lps = [-0.5] * len(words) if sampling_params.get("logprobs") else None
        return TokenOutput(token_ids=[ID[w] for w in words], log_probs=lps)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A directory verl's HFModelConfig loads: a word-level tokenizer with a chat template and a tiny Llama config;
    plus the tool and the reward function files."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny")
    chat_word_tokenizer(ID).save_pretrained(d)
    dims = {"hidden_size": 16, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2}
    LlamaConfig(vocab_size=len(WORDS), num_hidden_layers=1, architectures=["LlamaForCausalLM"], **dims).save_pretrained(
        d
    )
    (d / "tool.py").write_text(TOOL)
    (d / "reward.py").write_text(REWARD)
    return d


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with local_ray():
        yield


def _config(model_dir, buffer_name: str, add: bool | None = True, retrieve_prob: float = 0.0, importlib=False):
    """verl's own ppo_trainer config, composed by hydra as main_ppo composes it, with the reward manager selected by
    name from verl's registry (or, importlib=True, by module: verl's importlib source) and the RAPO keys in `rapo`."""
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    if importlib:
        manager = [
            "reward.reward_manager.source=importlib",
            "reward.reward_manager.module.path=pkg://rapo_fast.integrations.verl.buffer_growth",
            "reward.reward_manager.name=RapoRewardManager",
        ]
    else:
        manager = ["reward.reward_manager.name=rapo"]
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.prompt_length=32",
        "actor_rollout_ref.rollout.response_length=64",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.default_agent_loop=rapo_tool_agent",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={model_dir / 'tool.py'}",
        f"reward.custom_reward_function.path={model_dir / 'reward.py'}",
        "reward.num_workers=1",
        *manager,
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    rapo = {"buffer_name": buffer_name, "retrieve_prob": retrieve_prob, "n_hybrid": 2, "onpolicy_add_window_s": 0.02}
    if add is not None:
        rapo["add_onpolicy_steps"] = add
    with open_dict(cfg):
        cfg.rapo = rapo
    return cfg


PROMPTS = {5: ("what is x", "c"), 6: ("what is y", "d")}  # index -> (question, ground truth): 5 succeeds, 6 fails


def _batch(tag: str, validate: bool, indices=(5, 6)):
    """Two prompts x G = 2, repeated as verl's trainer repeats them (interleaved), as the dataset gives them."""
    from verl.protocol import DataProto

    rows = [i for i in indices for _ in range(2)]
    obj = lambda xs: np.array(xs + [None], dtype=object)[:-1]  # noqa: E731  (an object array of dicts/lists)
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": obj([[{"role": "user", "content": PROMPTS[i][0]}] for i in rows]),
            "uid": np.array([f"{tag}-{i}" for i in rows], dtype=object),
            "index": np.array(rows),
            "agent_name": np.array(["rapo_tool_agent"] * len(rows), dtype=object),
            "data_source": np.array(["tiny"] * len(rows), dtype=object),
            "reward_model": obj([{"ground_truth": PROMPTS[i][1], "style": "rule"} for i in rows]),
        },
        meta_info={"validate": validate, "global_steps": 1},
    )


def _rollout(cfg, batch, reward_handles=None):
    """verl's real AgentLoopWorker (real constructor: model config, tokenizer, tools from cfg) generating `batch`;
    reward_handles None: verl's real RewardLoopWorker, built in-process from cfg, scores every trajectory."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.reward_loop import RewardLoopWorker

    async def go():
        handles = reward_handles or [LocalHandle(RewardLoopWorker(cfg, None))]
        worker = AgentLoopWorker(cfg, ScriptedServer(), reward_loop_worker_handles=handles)
        return await worker.generate_sequences(batch)

    return asyncio.run(go())


def _trajectory(out, i: int) -> tuple[list[int], list[int]]:
    """Row i's prompt and response ids without verl's padding."""
    tb = out.batch
    p = tb["prompts"].shape[1]
    prompt = tb["prompts"][i][tb["attention_mask"][i, :p].bool()].tolist()
    return prompt, tb["responses"][i][: int(tb["attention_mask"][i, p:].sum())].tolist()


def _expected_steps(tok, out, i: int) -> list[tuple[str, str]]:
    """(history, step) texts of row i's two tool steps, from the known layout (the third turn is the answer)."""
    prompt, resp = _trajectory(out, i)
    dec = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (the agent loop's history decoding)
    return [(dec(prompt + resp[:s]), dec(resp[s:e])) for (s, _), e in list(zip(SPANS, OBS_END))[:2]]


def _scores(out) -> list[float]:
    return out.batch["rm_scores"].sum(-1).tolist()


def _in_process_buffer(model_dir, name: str):
    """rapo_fast's StepBufferClient over an in-process StepBufferActor (empty, 64 slots), installed for `name`."""
    from rapo_fast.integrations.verl import agent_loop
    from rapo_fast.integrations.verl.buffer_actor import StepBufferActor
    from rapo_fast.integrations.verl.buffer_client import StepBufferClient

    actor = StepBufferActor(None, str(model_dir), "hashed", capacity=64, window_s=0.0)
    client = StepBufferClient([LocalHandle(actor)])
    agent_loop.set_step_buffer_client(name, client)
    return actor, client


def test_training_successes_grow_the_buffer_validation_and_failures_do_not(model_dir):
    from transformers import AutoTokenizer
    from verl.experimental.reward_loop import RewardLoopWorker
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    from rapo_fast.integrations.verl import agent_loop, buffer_growth
    from rapo_fast.integrations.verl.buffer_setup import check_growth_config

    agent_loop.register()
    buffer_growth.register()
    buffer_growth.register()  # idempotent
    assert get_reward_manager_cls("rapo") is buffer_growth.RapoRewardManager
    tok = AutoTokenizer.from_pretrained(model_dir)
    actor, client = _in_process_buffer(model_dir, "grow-local")
    cfg = _config(model_dir, "grow-local")
    check_growth_config(cfg)

    async def manager():  # what verl's load_reward_manager builds in the reward worker
        return RewardLoopWorker(cfg, None).reward_manager

    rm = asyncio.run(manager())
    assert isinstance(rm, buffer_growth.RapoRewardManager) and type(rm.inner).__name__ == "NaiveRewardManager"

    out = _rollout(cfg, _batch("train", validate=False))
    assert _scores(out) == [1.0, 1.0, 0.0, 0.0]  # the inner (naive) manager's score, unchanged
    assert [bool(v) for v in out.non_tensor_batch["rapo_validate"]] == [False] * 4
    assert list(out.non_tensor_batch["rapo_group"]) == [5, 5, 6, 6]
    assert actor.counters["steps_added"] == 4  # 2 tool steps x the 2 successful members of prompt 5; none of 6
    assert actor.counters["add_calls"] <= 2  # concurrent trajectories' steps batched within the window
    (h0, s0), (h1, s1) = _expected_steps(tok, out, 0)
    assert _expected_steps(tok, out, 1) == [(h0, s0), (h1, s1)]
    assert s0 == f"think a <tool_call> {CALL} </tool_call> <|im_start|> tool fact one <|im_start|> assistant"
    assert s1 == s0.replace(" a ", " b ", 1) and h1 == f"{h0} {s0}" and h0.endswith("what is x <|im_start|> assistant")
    for h, st in ((h0, s0), (h1, s1)):
        seg, pid, score = asyncio.run(client.retrieve([h]))[0]
        assert seg == tok.encode(f"<retrieve> {st} </retrieve>", add_special_tokens=False)
        assert pid >= 0 and score == pytest.approx(1.0, abs=1e-5)
        assert asyncio.run(client.retrieve([h], [5]))[0][1] == -1  # stored under prompt 5's group id
        assert asyncio.run(client.retrieve([h], [6]))[0][1] >= 0

    val = _rollout(cfg, _batch("val", validate=True))  # validation: scored, never added
    assert (
        _scores(val) == [1.0, 1.0, 0.0, 0.0] and [bool(v) for v in val.non_tensor_batch["rapo_validate"]] == [True] * 4
    )
    off = _rollout(_config(model_dir, "grow-local", add=None), _batch("off", validate=False))  # the default: off
    assert _scores(off) == _scores(out)
    for key in ("acc", "rapo_f_ret", "rapo_step_spans"):
        assert list(off.non_tensor_batch[key]) == list(out.non_tensor_batch[key])
    assert actor.counters["steps_added"] == 4

    # a later rollout of prompt 6 (both members hybrid, p = 1, its own group excluded) retrieves an added step
    later = _rollout(_config(model_dir, "grow-local", add=False, retrieve_prob=1.0), _batch("later", False, (6,)))
    want = tok.encode(f"<retrieve> {s1} </retrieve>", add_special_tokens=False)
    for i in range(2):
        flags, resp = later.non_tensor_batch["rapo_retrieved_mask"][i], _trajectory(later, i)[1]
        assert later.non_tensor_batch["rapo_num_retrievals"][i] == 2
        first = flags.index(1)
        assert resp[first : first + len(want)] == want  # after turn 1 its history is nearest h1: s1 follows
    assert actor.counters["steps_added"] == 4
    agent_loop.set_step_buffer_client("grow-local", None)


def test_under_ray_with_verls_reward_loop_manager(model_dir):
    """verl's RewardLoopManager starts the reward worker as a Ray actor (the manager loaded by module name: verl's
    importlib route, which needs no registration in the worker); the buffer is a Ray actor found by name there."""
    from transformers import AutoTokenizer
    from verl.experimental.reward_loop import RewardLoopManager

    from rapo_fast.integrations.verl.buffer_actor import get_or_create_step_buffer
    from rapo_fast.integrations.verl.buffer_setup import check_growth_config

    tok = AutoTokenizer.from_pretrained(model_dir)
    client = get_or_create_step_buffer(
        "grow-ray", None, tokenizer=str(model_dir), capacity=64, num_cpus=0, ready_timeout_s=120, encoder="hashed"
    )
    cfg = _config(model_dir, "grow-ray", importlib=True)
    check_growth_config(cfg)
    mgr = RewardLoopManager(cfg)
    try:
        out = _rollout(cfg, _batch("ray-train", validate=False), mgr.reward_loop_worker_handles)
        assert _scores(out) == [1.0, 1.0, 0.0, 0.0]
        assert client.stats()[0]["steps_added"] == 4
        _rollout(cfg, _batch("ray-val", validate=True), mgr.reward_loop_worker_handles)
        assert client.stats()[0]["steps_added"] == 4
        (h0, s0), _ = _expected_steps(tok, out, 1)
        seg, _, score = asyncio.run(client.retrieve([h0], [6]))[0]
        assert seg == tok.encode(f"<retrieve> {s0} </retrieve>", add_special_tokens=False) and score > 0.999
    finally:
        for h in [*client.handles, *mgr.reward_loop_workers]:
            ray.kill(h)


def test_config_checks_and_errors(model_dir):
    from omegaconf import open_dict

    from rapo_fast.integrations.verl import buffer_growth
    from rapo_fast.integrations.verl.buffer_setup import StepBufferCheckpointCallback, check_growth_config

    buffer_growth.register()
    cfg = _config(model_dir, "grow-cfg")
    g = buffer_growth.growth_config(cfg)
    assert (g.add_onpolicy_steps, g.onpolicy_reward_threshold, g.inner_reward_manager) == (True, 0.5, "naive")
    assert (g.buffer_name, g.history_skip_special_tokens) == ("grow-cfg", True)
    assert buffer_growth.growth_config(_config(model_dir, "x", add=None)).add_onpolicy_steps is False
    naive = _config(model_dir, "grow-cfg")
    naive.reward.reward_manager.name = "naive"
    with pytest.raises(ValueError, match="reward.reward_manager.name=rapo"):
        check_growth_config(naive)
    with pytest.raises(ValueError, match="reward.reward_manager.name=rapo"):  # the driver hook fails before training
        StepBufferCheckpointCallback(naive)
    naive.rapo.add_onpolicy_steps = False
    check_growth_config(naive)  # off: any reward manager
    colocated = _config(model_dir, "grow-cfg")
    colocated.reward.reward_model.enable = True
    with pytest.raises(ValueError, match="enable_resource_pool"):
        check_growth_config(colocated)
    colocated.reward.reward_model.enable_resource_pool = True
    check_growth_config(colocated)
    bad_values = {
        "add_onpolicy_steps": ("yes", TypeError),
        "onpolicy_reward_threshold": ("x", TypeError),
        "inner_reward_manager": ("rapo", ValueError),
        "onpolicy_add_window_s": (-1.0, ValueError),
    }
    for key, (bad, err) in bad_values.items():
        c = _config(model_dir, "grow-cfg")
        with open_dict(c):
            c.rapo[key] = bad
        with pytest.raises(err, match=f"rapo.{key}"):
            buffer_growth.growth_config(c)


def test_grow_skips_what_is_not_a_successful_rapo_training_rollout(model_dir):
    """RapoRewardManager.grow on DataProtos shaped as AgentLoopWorker._compute_score builds them: no extra fields,
    another loop's fields, validation, a failure, a missing group id."""
    from verl.protocol import DataProto

    from rapo_fast.integrations.verl import buffer_growth

    cfg = _config(model_dir, "grow-unit")
    _, client = _in_process_buffer(model_dir, "grow-unit")

    def data(fields):
        nt = {"prompt_len": np.array([2]), "response_len": np.array([3])}
        if fields is not None:
            nt["tool_extra_fields"] = np.array([fields, None], dtype=object)[:1]
        t = {
            "prompts": torch.tensor([[ID["what"], ID["x"]]]),
            "responses": torch.tensor([[ID["think"], ID["a"], ID["b"]]]),
        }
        return DataProto.from_dict(tensors=t, non_tensors=nt)

    ok = {"rapo_step_spans": [[0, 1], [2, 3]], "rapo_step_obs_end": [2, 3], "rapo_validate": False, "rapo_group": 9}

    async def go():
        from transformers import AutoTokenizer

        rm = buffer_growth.RapoRewardManager(cfg, AutoTokenizer.from_pretrained(model_dir), None)
        cases = [(None, 1.0), ({"x": 1}, 1.0), ({**ok, "rapo_validate": True}, 1.0), (ok, 0.5), (ok, 1.0)]
        got = [await rm.grow(data(f), r) for f, r in cases]
        with pytest.raises(ValueError, match="group id"):
            await rm.grow(data({**ok, "rapo_group": None}), 1.0)
        return got

    assert asyncio.run(go()) == [0, 0, 0, 0, 1]
    seg, _, score = asyncio.run(client.retrieve(["what x"], None))[0]
    assert seg == [ID["<retrieve>"], ID["think"], ID["a"], ID["</retrieve>"]] and score == pytest.approx(1.0, abs=1e-5)
    from rapo_fast.integrations.verl import agent_loop

    agent_loop.set_step_buffer_client("grow-unit", None)
