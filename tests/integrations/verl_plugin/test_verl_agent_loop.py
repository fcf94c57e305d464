"""The RAPO agent loop (rapo_fast/integrations/verl/agent_loop.py) run through its `run()` the way verl runs it.

The loop is built with hydra.utils.instantiate from verl's agent-loop registry, with the arguments verl's
AgentLoopWorker._run_agent_loop passes (trainer config, server manager, tokenizer, processor, dataset class, data
config, tools). The server manager generates with a tiny LlamaForCausalLM built from a config: its attention and MLP
outputs are zeroed and its embeddings / lm_head set so that it is a bigram model with a known transition table, so the
trajectory's structure is known in advance (think -> a|b -> <tool_call> CALL </tool_call> <|im_end|>; after
</retrieve>: think2 -> a|b|c|d -> ...) while the tokens are sampled and the log-probs are the model's own (checked
against a full forward over the final sequence). The tokenizer is a word-level `tokenizers` tokenizer with a chat
template string (no download); the tool is a verl FunctionTool; the step buffer is an in-process fake client with the
StepBufferClient interface (and rapo_fast's own StepBufferClient over an in-process StepBufferActor). One test runs
verl's real AgentLoopWorker.generate_sequences (constructor bypassed) up to the padded DataProto. Not here: the buffer
actor under Ray (test_verl_buffer_actor.py), the loss and the advantage.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")

import hydra  # noqa: E402
import torch  # noqa: E402
from helpers.verl_tiny import chat_word_tokenizer  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

CALL = '{"name":"lookup","arguments":{}}'
WORDS = (
    "<pad> <unk> <|im_start|> <|im_end|> system user assistant tool what is x think think2 a b c d "
    f"<tool_call> </tool_call> {CALL} fact one two <retrieve> </retrieve>"
).split()
ID = {w: i for i, w in enumerate(WORDS)}
TRANSITIONS = {  # bigram program of the tiny model: next tokens (equally likely) after each token
    "assistant": ["think"],
    "think": ["a", "b"],
    "think2": ["a", "b", "c", "d"],
    "a": ["<tool_call>"],
    "b": ["<tool_call>"],
    "c": ["<tool_call>"],
    "d": ["<tool_call>"],
    "<tool_call>": [CALL],
    CALL: ["</tool_call>"],
    "</tool_call>": ["<|im_end|>"],
    "</retrieve>": ["think2"],
}
SEGMENT = [ID[w] for w in "<retrieve> fact two </retrieve>".split()]
TURN, CTX = 6, 7  # tokens of one assistant turn; of one tool response + generation prompt


def _tokenizer():
    return chat_word_tokenizer(ID)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    H = 32
    cfg = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=H,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-12,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream keeps the token's own embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(len(WORDS), H)
        emb[torch.arange(len(WORDS)), torch.arange(len(WORDS))] = 1.0  # one-hot: RMSNorm makes it sqrt(H) e_i
        model.model.embed_tokens.weight.copy_(emb)
        logits = torch.full((len(WORDS), len(WORDS)), -30.0)  # [from, to]
        logits[:, ID["<|im_end|>"]] = 0.0
        for src, dsts in TRANSITIONS.items():
            logits[ID[src]] = -30.0
            logits[ID[src], [ID[d] for d in dsts]] = 0.0
        head = torch.zeros(len(WORDS), H)
        head[:, : len(WORDS)] = logits.T / math.sqrt(H)
        model.lm_head.weight.copy_(head)
    return model


class TinyServer:
    """verl's server-manager interface (`generate(request_id, *, prompt_ids, sampling_params, ...) -> TokenOutput`)
    over the tiny model: samples at the requested temperature with a generator seeded by the prompt (the same prompt
    gives the same output), returns the sampled tokens' log-probs when sampling_params["logprobs"]."""

    def __init__(self, model, eos: int, max_new: int = 12):
        self.model, self.eos, self.max_new = model, eos, max_new
        self.prompts: list[list[int]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        self.prompts.append(list(prompt_ids))
        gen = torch.Generator().manual_seed(hash(tuple(prompt_ids)) & (2**62 - 1))
        stop = set(sampling_params.get("stop_token_ids") or []) | {self.eos}
        temp = float(sampling_params.get("temperature", 1.0))
        ids, toks, lps = list(prompt_ids), [], []
        with torch.no_grad():
            for _ in range(self.max_new):
                logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                logp = torch.log_softmax(logits / (temp if temp > 0 else 1.0), -1)
                t = int(logp.argmax()) if temp == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(t)
                toks.append(t)
                lps.append(float(logp[t]))
                if t in stop:
                    break
        return TokenOutput(token_ids=toks, log_probs=lps if sampling_params.get("logprobs") else None)


class FakeStepBuffer:
    """In-process StepBufferClient: `retrieve` returns `segment` (payload 7) for every history and records calls."""

    def __init__(self, segment):
        self.segment, self.calls = segment, []

    async def retrieve(self, histories, exclude_groups):
        self.calls.append((list(histories), None if exclude_groups is None else list(exclude_groups)))
        return [(None if self.segment is None else list(self.segment), 7, 0.5) for _ in histories]

    async def add_steps(self, histories, steps, group_ids):
        return None


@pytest.fixture(scope="module")
def env():
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    from rapo_fast.integrations.verl import agent_loop

    agent_loop.register()
    tok = _tokenizer()
    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "look up",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    )
    tool = FunctionTool(name="lookup", fn=lambda: "fact one", tool_schema=schema)
    return {"tok": tok, "model": _model(), "tool": tool, "mod": agent_loop}


def _config(response_length=64, logprobs=True, n=4, rapo=None):
    cfg = {
        "actor_rollout_ref": {
            "rollout": {
                "n": n,
                "prompt_length": 64,
                "response_length": response_length,
                "calculate_log_probs": logprobs,
                "full_determinism": False,
                "multi_turn": {
                    "max_user_turns": None,
                    "max_assistant_turns": 3,
                    "max_parallel_calls": 1,
                    "max_tool_response_length": 256,
                    "tool_response_truncate_side": "middle",
                    "format": "hermes",
                },
            }
        },
        "data": {},
    }
    if rapo is not None:
        cfg["rapo"] = rapo
    return OmegaConf.create(cfg)


def _instantiate(env, cfg, name="rapo_tool_agent", server=None, **yaml_kwargs):
    """Build a loop exactly as AgentLoopWorker._run_agent_loop does (hydra from the registry entry)."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset

    entry = OmegaConf.merge(_agent_loop_registry[name], yaml_kwargs)
    return hydra.utils.instantiate(
        config=entry,
        trainer_config=DictConfigWrap(config=cfg),
        server_manager=server or TinyServer(env["model"], ID["<|im_end|>"]),
        tokenizer=env["tok"],
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(cfg.data),
        tools=ToolListWrap([env["tool"]]),
    )


def _params(logprobs=True):
    return dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=logprobs)


def _sample(uid, index=3):
    return {"raw_prompt": [{"role": "user", "content": "what is x"}], "uid": uid, "index": index}


def _run(env, cfg, uid, *, name="rapo_tool_agent", server=None, extra=None, logprobs=True, **yaml_kwargs):
    """Build the loop inside the running event loop (verl's loops keep the loop they were built in) and run it."""

    async def go():
        loop = _instantiate(env, cfg, name=name, server=server, **yaml_kwargs)
        return await loop.run(_params(logprobs), **_sample(uid), **(extra or {}))

    return asyncio.run(go())


def _with_client(env, client, name="rapo_step_buffer"):
    env["mod"].set_step_buffer_client(name, client)


def _model_logprobs(model, ids, start):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(logp[t - 1, ids[t]]) for t in range(start, len(ids))]


def test_hand_walked_hybrid_trajectory(env):
    tok, client = env["tok"], FakeStepBuffer(SEGMENT)
    _with_client(env, client)
    out = _run(env, _config(), "u-walk", retrieve_prob=1.0, n_hybrid=4, seed=1)
    r, m, lp, ex = out.response_ids, out.response_mask, out.response_logprobs, out.extra_fields
    # turn 1 | tool + gen prompt | retrieved | turn 2 | tool + gen prompt | retrieved | turn 3 (max_assistant_turns)
    kinds = ["g"] * TURN + ["c"] * CTX + ["r"] * 4 + ["g"] * TURN + ["c"] * CTX + ["r"] * 4 + ["g"] * TURN
    assert len(r) == len(kinds) == 40
    words = [WORDS[t] for t in r]
    assert words[:TURN] == ["think", words[1], "<tool_call>", CALL, "</tool_call>", "<|im_end|>"]
    assert words[1] in ("a", "b") and words[18] in ("a", "b", "c", "d") and words[35] in ("a", "b", "c", "d")
    assert words[TURN : TURN + CTX] == "<|im_start|> tool fact one <|im_end|> <|im_start|> assistant".split()
    assert r[13:17] == SEGMENT and r[30:34] == SEGMENT and words[17] == words[34] == "think2"
    assert m == [int(k == "g") for k in kinds]
    assert ex["rapo_retrieved_mask"] == [int(k == "r") for k in kinds]
    assert all(lp[j] == 0.0 for j, k in enumerate(kinds) if k != "g")
    # the log-probs are the model's on the final sequence (the retrieved tokens are real context for it)
    ref = _model_logprobs(env["model"], out.prompt_ids + r, len(out.prompt_ids))
    assert all(abs(lp[j] - ref[j]) < 1e-5 for j, k in enumerate(kinds) if k == "g")
    assert ex["rapo_f_ret"] == pytest.approx(8 / 40)
    assert ex["rapo_step_spans"] == [[0, 6], [17, 23], [34, 40]] and ex["rapo_step_obs_end"] == [13, 30, 40]
    assert ex["rapo_retrieval_steps"] == [[0, 1], [1, 2]] and ex["rapo_num_retrievals"] == 2
    h = [sum(-lp[j] for j in range(s, e)) / (e - s) for s, e in ex["rapo_step_spans"]]
    assert ex["rapo_h_before"] == pytest.approx([h[0], h[1]], abs=1e-12)
    assert ex["rapo_h_after"] == pytest.approx([h[1], h[2]], abs=1e-12)
    assert h == pytest.approx([math.log(2) / 6, math.log(4) / 6, math.log(4) / 6], abs=1e-6)  # the bigram's entropy
    assert ex["rapo_hybrid"] is True
    # the buffer saw the decoded running history and the prompt's group to exclude
    full = out.prompt_ids + r
    n0 = len(out.prompt_ids)
    assert client.calls == [
        ([tok.decode(full[: n0 + 13], skip_special_tokens=True)], [3]),
        ([tok.decode(full[: n0 + 30], skip_special_tokens=True)], [3]),
    ]


def _comparable(out):
    d = out.model_dump()
    d.pop("metrics")  # wall-clock timings
    d["extra_fields"] = {k: v for k, v in d["extra_fields"].items() if not k.startswith("rapo_")}
    return d


@pytest.mark.parametrize("case", ["p0", "non_hybrid", "validate"])
def test_no_retrieval_is_exactly_tool_agent_loop(env, case):
    _with_client(env, FakeStepBuffer(SEGMENT))
    server = TinyServer(env["model"], ID["<|im_end|>"])
    base = _run(env, _config(), "u-base", name="tool_agent", server=server)
    kw = {"retrieve_prob": 0.0 if case == "p0" else 1.0, "n_hybrid": 0 if case == "non_hybrid" else 4}
    extra = {"validate": True} if case == "validate" else None
    out = _run(env, _config(), f"u-{case}", server=server, extra=extra, **kw)
    assert _comparable(out) == _comparable(base)
    assert out.metrics.model_dump().keys() == base.metrics.model_dump().keys()
    ex = out.extra_fields
    assert ex["rapo_retrieved_mask"] == [0] * len(out.response_ids) and ex["rapo_f_ret"] == 0.0
    assert ex["rapo_h_before"] == ex["rapo_h_after"] == [] and ex["rapo_num_retrievals"] == 0
    assert ex["rapo_hybrid"] is (case == "p0")


def test_n_hybrid_of_group_members(env):
    """G = 4 copies of one prompt (one uid) run concurrently as verl's worker runs them: exactly n_hybrid = 2 are
    hybrid and only those retrieve; with hybrid_selection=coin membership is a seeded coin."""
    _with_client(env, FakeStepBuffer(SEGMENT))

    async def group(uid, **kw):
        loops = [_instantiate(env, _config(n=4), retrieve_prob=1.0, n_hybrid=2, **kw) for _ in range(4)]
        return await asyncio.gather(*(lp.run(_params(), **_sample(uid)) for lp in loops))

    outs = asyncio.run(group("u-group"))
    assert [o.extra_fields["rapo_hybrid"] for o in outs] == [True, True, False, False]
    assert [o.extra_fields["rapo_num_retrievals"] for o in outs] == [2, 2, 0, 0]
    coin = [o.extra_fields["rapo_hybrid"] for o in asyncio.run(group("u-coin", hybrid_selection="coin", seed=5))]
    assert coin == [random.Random(f"5:u-coin:{m}").random() < 2 / 4 for m in range(4)]  # the documented seeding

    # verl's v1 worker passes each copy's index as session_id: the member number follows it, not the start order
    async def sessions(uid, order):
        loops = [_instantiate(env, _config(n=4), retrieve_prob=1.0, n_hybrid=2) for _ in order]
        return await asyncio.gather(*(lp.run(_params(), **_sample(uid), session_id=i) for lp, i in zip(loops, order)))

    outs = asyncio.run(sessions("u-session", [3, 1, 0, 2]))
    assert [o.extra_fields["rapo_hybrid"] for o in outs] == [False, True, True, False]


def _worker(env, cfg):
    """verl's real AgentLoopWorker without its constructor (which loads a model config from disk): the attributes
    its generate_sequences / _run_agent_loop / _agent_loop_postprocess / _postprocess read."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.dataset.rl_dataset import RLHFDataset

    w = object.__new__(AgentLoopWorker)
    w.config, w.rollout_config = cfg, cfg.actor_rollout_ref.rollout
    w.llm_client = TinyServer(env["model"], ID["<|im_end|>"])
    w.tokenizer, w.processor, w.hf_model_type = env["tok"], None, None
    w.dataset_cls, w.tools, w.mm_processor_kwargs = RLHFDataset, [env["tool"]], {}
    w.reward_loop_worker_handles, w.distillation_enabled = None, False
    return w


def test_through_verl_agent_loop_worker(env):
    """verl's real AgentLoopWorker.generate_sequences on a DataProto of 2 prompts x G = 2 (interleaved as verl
    repeats them): registry lookup, hydra instantiation, the trajectory info, padding and the DataProto. The RAPO
    knobs come from the trainer config's `rapo` section (n_hybrid 1 of 2, p = 1). Validation never retrieves."""
    import numpy as np
    from verl.protocol import DataProto

    _with_client(env, FakeStepBuffer(SEGMENT), name="buf-worker")
    cfg = _config(n=2, rapo={"retrieve_prob": 1.0, "n_hybrid": 1, "buffer_name": "buf-worker", "loss_agg": "x"})
    rollout = cfg.actor_rollout_ref.rollout
    rollout.update({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "agent": {"default_agent_loop": "tool_agent"}})
    rollout.val_kwargs = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    worker = _worker(env, cfg)
    for validate in (False, True):
        uids = [f"w{validate}-0"] * 2 + [f"w{validate}-1"] * 2
        prompts = np.empty(4, dtype=object)
        prompts[:] = [[{"role": "user", "content": "what is x"}] for _ in range(4)]
        batch = DataProto.from_dict(
            non_tensors={
                "raw_prompt": prompts,
                "uid": np.array(uids, dtype=object),
                "index": np.array([5, 5, 6, 6]),
                "agent_name": np.array(["rapo_tool_agent"] * 4, dtype=object),
            },
            meta_info={"validate": validate},
        )
        out = asyncio.run(worker.generate_sequences(batch))
        nt, tb = out.non_tensor_batch, out.batch
        hybrid = [bool(h) for h in nt["rapo_hybrid"]]
        assert hybrid == ([False] * 4 if validate else [True, False, True, False])
        assert [int(n) for n in nt["rapo_num_retrievals"]] == [2 * h for h in hybrid]
        for i in range(4):
            flags = torch.tensor(nt["rapo_retrieved_mask"][i])
            n = len(flags)
            assert n == int(tb["attention_mask"][i, tb["prompts"].shape[1] :].sum())
            assert int(flags.sum()) == 8 * hybrid[i] and nt["rapo_f_ret"][i] == pytest.approx(float(flags.sum()) / n)
            on = flags.bool()
            assert tb["responses"][i, :n][on].tolist() == SEGMENT * (2 * hybrid[i])
            assert not tb["response_mask"][i, :n][on].any() and not tb["rollout_log_probs"][i, :n][on].any()
            assert len(nt["rapo_h_before"][i]) == len(nt["rapo_h_after"][i]) == 2 * hybrid[i]


def test_edges_truncation_no_room_none_and_options(env):
    # response_length 20: turn 1 (6) + context (7) + segment (4) = 17 fits; turn 2 is cut at 3 tokens
    _with_client(env, FakeStepBuffer(SEGMENT))
    out = _run(env, _config(response_length=20), "u-trunc", retrieve_prob=1.0, n_hybrid=4)
    ex, lp = out.extra_fields, out.response_logprobs
    assert len(out.response_ids) == 20 and ex["rapo_retrieved_mask"] == [0] * 13 + [1] * 4 + [0] * 3
    assert ex["rapo_f_ret"] == pytest.approx(4 / 20) and ex["rapo_step_spans"] == [[0, 6], [17, 20]]
    assert ex["rapo_step_obs_end"] == [13, 20]
    assert ex["rapo_h_after"] == pytest.approx([sum(-x for x in lp[17:20]) / 3])
    # 17 tokens: the segment would leave no room for a generated token -> skipped
    out = _run(env, _config(response_length=17), "u-room", retrieve_prob=1.0, n_hybrid=4)
    assert out.extra_fields["rapo_num_retrievals"] == 0
    # a segment over max_retrieve_tokens is skipped; an empty search inserts nothing; exclusion off -> None
    out = _run(env, _config(), "u-max", retrieve_prob=1.0, n_hybrid=4, max_retrieve_tokens=3)
    assert out.extra_fields["rapo_num_retrievals"] == 0
    client = FakeStepBuffer(None)
    _with_client(env, client)
    out = _run(env, _config(), "u-none", retrieve_prob=1.0, n_hybrid=4, exclude_own_group=False)
    assert out.extra_fields["rapo_num_retrievals"] == 0 and len(client.calls) == 2
    assert all(excl is None for _, excl in client.calls)
    # without engine log-probs the entropies cannot be estimated: the lists stay empty, the mask and F do not
    _with_client(env, FakeStepBuffer(SEGMENT))
    out = _run(env, _config(logprobs=False), "u-nolp", logprobs=False, retrieve_prob=1.0, n_hybrid=4)
    ex = out.extra_fields
    assert out.response_logprobs is None and ex["rapo_num_retrievals"] == 2 and ex["rapo_h_before"] == []
    assert ex["rapo_f_ret"] == pytest.approx(8 / 40)


def test_config_resolution_and_errors(env):
    mod = env["mod"]
    cfg = mod.resolve_loop_config({"retrieve_prob": 0.25, "n_hybrid": 3, "other": 1}, {"n_hybrid": 2}, 8)
    assert (cfg.hybrid.retrieve_prob, cfg.hybrid.n_hybrid, cfg.group_size, cfg.exclude_own_group) == (0.25, 2, 8, True)
    assert mod.resolve_loop_config(None, {}, 16).hybrid.n_hybrid == 8
    bad = [
        ({"retrieve_prob": 1.5}, ValueError, "rapo.retrieve_prob"),
        ({"n_hybrid": 9}, ValueError, "rapo.n_hybrid"),
        ({"group_size": 0}, ValueError, "rapo.group_size"),
        ({"hybrid_selection": "first"}, ValueError, "rapo.hybrid_selection"),
        ({"max_retrieve_tokens": 0}, ValueError, "rapo.max_retrieve_tokens"),
        ({"exclude_own_group": "yes"}, TypeError, "rapo.exclude_own_group"),
        ({"buffer_name": ""}, ValueError, "rapo.buffer_name"),
    ]
    for kw, err, name in bad:
        with pytest.raises(err, match=name):
            mod.resolve_loop_config(None, kw, 8)
    with pytest.raises(TypeError, match="client"):
        mod.set_step_buffer_client("x", object())
    assert mod.retrieved_fraction([]) == 0.0
    assert mod.step_entropy_estimate([-1.0, -3.0], [1, 0], 0, 2) == 1.0


@pytest.mark.parametrize("exclude", [True, False])
def test_with_rapo_fast_step_buffer_client(env, exclude):
    """The buffer side is rapo_fast's own StepBufferClient over a StepBufferActor (in-process, no Ray) holding an
    on-policy step of the prompt's own group (index 3) and an off-policy step (OFFPOLICY_GROUP_BASE + 3): the own
    group's step matches the history better, so it is inserted only when exclude_own_group is false."""
    from rapo_fast.integrations.verl.buffer_actor import StepBufferActor
    from rapo_fast.integrations.verl.buffer_client import StepBufferClient
    from rapo_fast.integrations.verl.buffer_requests import LocalHandle
    from rapo_fast.retrieval.step_traces import OFFPOLICY_GROUP_BASE

    tok = env["tok"]
    actor = StepBufferActor(None, tok, "hashed", capacity=16, window_s=0.0)
    own = "user what is x assistant think a b tool fact one assistant"
    client = StepBufferClient([LocalHandle(actor)])  # encodes the histories, the actor stores keys
    asyncio.run(client.add_steps([own, "system is"], ["fact one", "fact two"], [3, OFFPOLICY_GROUP_BASE + 3]))
    _with_client(env, client, name=f"buf-{exclude}")
    kw = {"retrieve_prob": 1.0, "n_hybrid": 4, "buffer_name": f"buf-{exclude}", "exclude_own_group": exclude}
    out = _run(env, _config(), f"u-real-{exclude}", **kw)
    seg = tok.encode("<retrieve> " + ("fact two" if exclude else "fact one") + " </retrieve>")
    r, flags = out.response_ids, out.extra_fields["rapo_retrieved_mask"]
    assert [t for t, f in zip(r, flags) if f] == seg * 2 and out.extra_fields["rapo_num_retrievals"] == 2
