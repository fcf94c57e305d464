"""RAPO on verl as a verl user runs it: verl 0.9.1's own `python -m verl.trainer.main_ppo` (v1 trainer, FSDP2 actor,
agent loop, TransferQueue, Ray) with rapo_fast's plugin, unmodified, loaded by verl's entry points.

What runs: two main_ppo subprocesses, the command line a user types, with the plugin's agent loop `rapo_tool_agent`,
reward manager `rapo` (buffer growth), advantage `rapo`, loss `rapo_no_dual_clip` and the step-buffer checkpoint
callback, over 2 FSDP ranks. The first validates, trains 2 steps and saves at step 2; the second resumes from that
checkpoint with the step buffer restored and trains step 3 with 2 PPO mini-batches (the second one's ratios differ
from 1, so the clip and the importance shaping act) and a read replica of the buffer. The model is a tiny Llama built
from a config and saved with weights that make it a bigram model with a known program (every turn is
`think X <tool_call> CALL </tool_call>`, and `</retrieve>` is followed by `think2`), so trajectories have tool steps
and retrieval boundaries; the tokenizer is word-level, trained here (no download). The tool is the recipe's `search`
(examples/verl/search_tool.py, http backend), answered by a Search-R1-style retrieval server the test starts on the
loopback (retrieval_server.py: faiss over a small synthetic corpus). The checks read verl's own metrics stream (the
`file` logger's JSONL, what `console`/`wandb` also get): the `rapo/*` rollout, advantage, loss and buffer figures;
and the buffers saved at steps 2 and 3, loaded here.
What it is not: vLLM, a GPU, NCCL or multi-node. verl 0.9.1 has no CPU path, so verl_cpu_shims.py (this folder,
loaded by verl through VERL_USE_EXTERNAL_MODULES) adds a CPU platform, the FSDP engine on it, gloo process groups and
a small transformers rollout server; everything else is verl's code. Skipped without verl (the main environment).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Minutes of CI: run once, in .ci/run's verl stage, which sets RAPO_FAST_VERL_E2E=1 (the main suite may run in an
# environment that already holds verl, and would run it a second time).
if os.environ.get("RAPO_FAST_VERL_E2E") != "1":
    pytest.skip(
        "verl's main_ppo end to end: set RAPO_FAST_VERL_E2E=1 (.ci/run's verl stage does)", allow_module_level=True
    )
pytest.importorskip("verl")
pytest.importorskip("ray")
pytest.importorskip("transfer_queue")
pytestmark = pytest.mark.slow  # minutes: each run starts Ray, TransferQueue and ~10 worker processes

import torch  # noqa: E402
from helpers.verl_tiny import chat_word_tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parents[2] / "examples" / "verl"
CALL = '{"name":"search","arguments":{"query":"x"}}'
WORDS = (
    "<pad> <unk> <|im_start|> <|im_end|> system user assistant tool what is x y z w think think2 a b c d "
    f"<tool_call> </tool_call> {CALL} fact one two <retrieve> </retrieve>"
).split()
ID = {w: i for i, w in enumerate(WORDS)}
# The bigram program: next tokens and their probabilities (uneven, so the entropy estimates and the retrieval rewards
# differ between rollouts). Tokens not listed end the turn.
TRANSITIONS = {
    "assistant": {"think": 1.0},
    "think": {"a": 0.7, "b": 0.3},
    "think2": {"a": 0.45, "b": 0.25, "c": 0.2, "d": 0.1},  # no probability shared with "think"
    "a": {"<tool_call>": 1.0},
    "b": {"<tool_call>": 1.0},
    "c": {"<tool_call>": 1.0},
    "d": {"<tool_call>": 1.0},
    "<tool_call>": {CALL: 1.0},
    CALL: {"</tool_call>": 1.0},
    "</tool_call>": {"<|im_end|>": 1.0},
    "</retrieve>": {"think2": 1.0},
}
# The retrieval server's corpus (retrieval_server.py): the recipe's search tool answers "Doc 1: <the best passage>".
CORPUS = ["fact one x", "fact two y", "fact one z", "fact two w", "a b c d"]
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if ground_truth in solution_str.split() else 0.0
"""
AGENT_LOOPS = """
- name: rapo_tool_agent
  _target_: rapo_fast.integrations.verl.agent_loop.RAPOToolAgentLoop
  retrieve_prob: 1.0
  n_hybrid: 2
"""
PROMPTS = [("what is x", "b"), ("what is y", "c"), ("what is z", "b"), ("what is w", "c")]
# The mini-batch run rewards a response that went on from a retrieved step ("think2" follows only `</retrieve>`): each
# group's 2 hybrid rows retrieve and its 2 others cannot, so every mini-batch has non-zero advantages and the first
# one's update moves the second one's ratios. (With the answers above, a mini-batch of one group sometimes had no
# success at all, hence zero advantages, no update, ratios of exactly 1 and no clip: a flaky test.)
PROMPTS_RETRIEVAL_REWARD = [(q, "think2") for q, _ in PROMPTS]
RANKS = 2  # FSDP ranks (gloo) in both runs: a resume needs the world size the checkpoint was saved with
TIMEOUT_S = 900  # a run takes 1.5 to 7 minutes, depending on how loaded the machine is (process start-ups)


def _bigram_model(d: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    h = 32
    cfg = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=h,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-12,
        tie_word_embeddings=False,
        eos_token_id=ID["<|im_end|>"],
        pad_token_id=ID["<pad>"],
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream keeps the token's own embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(len(WORDS), h)
        emb[torch.arange(len(WORDS)), torch.arange(len(WORDS))] = 1.0  # one-hot: RMSNorm makes it sqrt(h) e_i
        model.model.embed_tokens.weight.copy_(emb)
        logits = torch.full((len(WORDS), len(WORDS)), -30.0)  # [from, to]
        logits[:, ID["<|im_end|>"]] = 0.0
        for src, dsts in TRANSITIONS.items():
            logits[ID[src]] = -30.0
            for dst, p in dsts.items():
                logits[ID[src], ID[dst]] = math.log(p)
        head = torch.zeros(len(WORDS), h)
        head[:, : len(WORDS)] = logits.T / math.sqrt(h)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(d)
    model.generation_config.save_pretrained(d)


def _job_dir(root: Path) -> Path:
    """The files a verl user would have: model directory, parquet data (question, ground truth: `train` answers the
    task, `train_retrieval_reward` rewards going on from a retrieved step), reward, agent-loop YAML, step-buffer seed
    JSONL."""
    import pandas as pd

    model = root / "model"
    model.mkdir()
    chat_word_tokenizer(ID).save_pretrained(model)
    _bigram_model(model)
    (root / "reward.py").write_text(REWARD)
    (root / "agent_loops.yaml").write_text(AGENT_LOOPS)
    seed = {"query_id": 100, "prompt": "what is v", "steps": ["think a fact two"], "answer": "a", "reward": 1.0}
    (root / "seed.jsonl").write_text(json.dumps(seed) + "\n")
    splits = (("train", PROMPTS), ("train_retrieval_reward", PROMPTS_RETRIEVAL_REWARD), ("val", PROMPTS[:2]))
    for split, rows in splits:
        recs = [
            {
                "data_source": "rapo_tiny",
                "prompt": [{"role": "user", "content": q}],
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {"index": i, "split": split},
                "agent_name": "rapo_tool_agent",
            }
            for i, (q, gt) in enumerate(rows)
        ]
        pd.DataFrame(recs).to_parquet(root / f"{split}.parquet")
    return root


def _run_keys(steps: int = 2, save_freq: int = -1, grow: bool = True) -> list[str]:
    """How long a run trains, when it saves and whether the buffer grows (the resumed run differs there)."""
    return [
        f"+rapo.add_onpolicy_steps={str(grow).lower()}",
        f"trainer.total_training_steps={steps}",
        # 2 batches an epoch: a run resumed at step 2 starts in epoch 1 (verl: global step // steps per epoch), which
        # needs a second epoch; total_training_steps ends every run before it matters
        "trainer.total_epochs=2",
        f"trainer.save_freq={save_freq}",
    ]


def _overrides(
    root: Path, *, mini_batch: int, val_before_train: bool, replicas: int = 0, train: str = "train", **run
) -> list[str]:
    micro = 4 * mini_batch // RANKS  # trajectories per rank in a mini-batch (rollout.n = 4): one micro-batch
    return [
        f"data.train_files={root / (train + '.parquet')}",
        f"data.val_files={root / 'val.parquet'}",
        "data.train_batch_size=2",
        "data.val_batch_size=2",
        "data.max_prompt_length=32",
        "data.max_response_length=96",
        "data.return_raw_chat=true",
        "data.dataloader_num_workers=0",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={root / 'model'}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # verl's default is flash_attention_2
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=rapo_no_dual_clip",
        # a tight clip with a small step: the update moves the ratios past it without breaking the bigram program
        # (at lr 0.05 two Adam steps left no tool calls, so no retrievals, in step 2)
        "actor_rollout_ref.actor.clip_ratio_low=0.02",
        "actor_rollout_ref.actor.clip_ratio_high=0.02",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.optim.lr=0.01",
        "actor_rollout_ref.actor.fsdp_config.param_offload=false",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=4",
        # one rollout server over both ranks (a server per rank would add a process start to a run for nothing)
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={RANKS}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={RECIPE / 'search_tool.py'}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.agent.default_agent_loop=rapo_tool_agent",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={root / 'agent_loops.yaml'}",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "algorithm.adv_estimator=rapo",
        "algorithm.use_kl_in_reward=false",
        "+algorithm.rapo_ret_coef=0.2",
        "+algorithm.rapo_ret_norm=retrieved",
        f"reward.custom_reward_function.path={root / 'reward.py'}",
        "reward.reward_manager.name=rapo",
        "reward.num_workers=1",
        "+rapo.n_hybrid=2",
        "+rapo.buffer_name=rapo_step_buffer",
        f"+rapo.step_buffer.path={root / 'seed.jsonl'}",
        "+rapo.step_buffer.num_cpus=0",
        f"+rapo.step_buffer.replicas_per_node={replicas}",
        "trainer.checkpoint_callback_class=rapo_fast.integrations.verl.buffer_setup.StepBufferCheckpointCallback",
        "trainer.test_freq=-1",
        f"trainer.val_before_train={str(val_before_train).lower()}",
        f"trainer.n_gpus_per_node={RANKS}",
        "trainer.nnodes=1",
        "trainer.device=cpu",
        "trainer.logger=[console,file]",
        "trainer.project_name=rapo_e2e",
        "trainer.experiment_name=cpu",
        f"trainer.default_local_dir={root / 'ckpt'}",
        # Ray on a CPU machine: logical GPUs stand for the FSDP ranks; TransferQueue's storage actors and controller
        # need CPUs of their own (with as few as the machine has, it waits for them silently), so Ray is told 16.
        f"+ray_kwargs.ray_init.num_gpus={RANKS}",
        "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        *_run_keys(**run),
    ]


def _env(root: Path, search_url: str, run: str) -> dict[str, str]:
    env = dict(os.environ)
    tests_dir = HERE.parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(tests_dir), env.get("PYTHONPATH", "")) if p)
    env.update(
        VERL_USE_EXTERNAL_MODULES="verl_cpu_shims",
        VERL_FILE_LOGGER_PATH=str(root / f"metrics_{run}.jsonl"),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        RAY_DEDUP_LOGS="0",
        WANDB_MODE="disabled",
        # the recipe's search tool, http backend, as a job runs it (the agent-loop workers inherit this environment)
        RAPO_SEARCH_BACKEND="http",
        RAPO_SEARCH_URL=search_url,
        RAPO_SEARCH_TOPK="1",
    )
    env.pop("TRITON_INTERPRET", None)  # the actor runs torch's own kernels; the interpreter only slows it
    return env


def run_main_ppo(root: Path, search, run: str, **kw) -> list[dict]:
    """Runs `python -m verl.trainer.main_ppo` on the job in `root` (made on the first run there; a later run resumes
    from its checkpoints, verl's resume_mode=auto); returns the logged steps' metrics. Fails the test with the
    output's tail when the run fails."""
    if not (root / "model").exists():
        _job_dir(root)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *_overrides(root, **kw)]
    t0 = time.monotonic()
    log = root / f"main_ppo_{run}.log"  # written as the run goes: a run that times out still shows where it was
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=root, env=_env(root, search.url, run), stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "nothing (timed out)"
    wall = time.monotonic() - t0
    out = log.read_text(errors="replace")
    assert rc == 0, f"main_ppo ({run}) exited {rc} after {wall:.0f} s:\n{out[-6000:]}"
    print(f"main_ppo ({run}) wall time: {wall:.1f} s")
    lines = (root / f"metrics_{run}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _train_steps(records: list[dict]) -> list[dict]:
    return [r["data"] for r in records if "training/global_step" in r["data"]]


@pytest.fixture(scope="module")
def search():
    """The loopback retrieval server the runs' search tool calls (one for the module; its queries accumulate)."""
    from retrieval_server import RetrievalServer

    with RetrievalServer(CORPUS) as server:
        yield server


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, search) -> tuple[Path, list[dict], list[dict], int]:
    """The first main_ppo: a validation pass, then 2 steps, saving at step 2. Returns the job folder, its metric
    records, its training steps, and how many queries the retrieval server got during it."""
    root = tmp_path_factory.mktemp("main_ppo")
    asked = len(search.queries)
    records = run_main_ppo(root, search, "first", mini_batch=2, val_before_train=True, save_freq=2)
    return root, records, _train_steps(records), len(search.queries) - asked


def test_main_ppo_two_rapo_steps_with_validation_and_search_tool(first_run, search):
    """2 steps after a validation pass: the loop retrieves (its own group excluded), the reward manager grows the
    buffer, the advantage gives a retrieval term to exactly the hybrid rows, and validation neither searches nor adds;
    the tool calls go to the recipe's search tool, which asks the loopback retrieval server.
    """
    root, records, steps, asked = first_run
    # verl's tool loop called the recipe's search tool, which called the server with the model's query
    assert asked > 0 and set(search.queries) == {"x"}
    assert [s["training/global_step"] for s in steps] == [1, 2]
    assert any(k.startswith("val-core/") for r in records for k in r["data"])  # the validation pass ran
    for m in steps:
        rapo = sorted(k for k in m if k.startswith("rapo/"))
        print(m["training/global_step"], {k: round(m[k], 4) for k in rapo})
        # rollout: half of each group hybrid, every hybrid member retrieved, tokens inserted
        assert m["rapo/rollout/hybrid_frac"] == pytest.approx(0.5)
        assert m["rapo/rollout/retrieved_frac"] > 0 and m["rapo/rollout/retrievals_per_hybrid_traj"] > 0
        assert m["rapo/rollout/retrieval_score/max"] > 0 and m["rapo/rollout/search_latency_ms/mean"] > 0
        for key in ("skipped_no_result", "skipped_too_long", "skipped_no_room", "retrieve_calls", "growth_steps"):
            assert f"rapo/rollout/{key}" in m
        # advantage: the retrieval reward Z on exactly the hybrid rows; A_ret (normalised over the retrieving rows)
        # never on a non-hybrid row
        assert m["rapo/adv/z_nonzero_frac/hybrid"] == 1.0 and m["rapo/adv/z_nonzero_frac/non_hybrid"] == 0.0
        assert m["rapo/adv/a_ret_nonzero_frac/non_hybrid"] == 0.0
        # the loss ran inside FSDP with the retrieved tokens' fraction
        assert m["actor/rapo/retrieved_frac"] > 0
    assert max(m["rapo/adv/a_ret_nonzero_frac/hybrid"] for m in steps) > 0
    last = steps[-1]
    # buffer: grew from the training rollouts' successful steps, and only from them (validation ran before step 1
    # and its rollouts are scored too: the counters equal what the two training batches asked for)
    assert last["rapo/buffer/steps_added"] > 0
    assert last["rapo/buffer/steps_added"] + last["rapo/buffer/steps_dropped"] == sum(
        m["rapo/rollout/growth_steps"] for m in steps
    )
    # (queries: one per history searched, however the client and the actor batch the requests)
    assert last["rapo/buffer/queries"] == sum(m["rapo/rollout/retrieve_calls"] for m in steps)
    assert last["rapo/buffer/size"] > steps[0]["rapo/buffer/size"] - steps[0]["rapo/buffer/steps_added"]
    # step 2's prompts retrieve step 1's steps (same task family, own group excluded): far nearer than the seed step
    assert steps[1]["rapo/rollout/retrieval_score/mean"] > steps[0]["rapo/rollout/retrieval_score/mean"]
    _assert_buffer_actor_figures(steps, replicas=0)


def _assert_buffer_actor_figures(steps: list[dict], *, replicas: int) -> None:
    """The buffer actors' own figures, read after each step's rollouts: every caller's query searched there once,
    nothing left waiting (the trainer is synchronous), the actor's search time inside the caller's latency."""
    for m in steps:
        assert m["rapo/buffer/replicas"] == replicas and m["rapo/buffer/shards"] == 1
        assert m["rapo/buffer/step_queries"] == m["rapo/rollout/retrieve_calls"] > 0
        assert m["rapo/buffer/pending"] == 0 and m["rapo/buffer/pending_max"] >= 1
        assert 0 < m["rapo/buffer/search_ms/mean"] <= m["rapo/buffer/search_ms/max"]
        assert m["rapo/buffer/search_ms/max"] <= m["rapo/rollout/search_latency_ms/max"]


def _saved_buffer(root: Path, step: int):
    """The step buffer that the checkpoint callback saved with verl's global_step_<step>, loaded in this process."""
    from rapo_fast._atomic import read_version
    from rapo_fast.integrations.verl.buffer_actor import CHECKPOINT_SUBDIR
    from rapo_fast.integrations.verl.buffer_client import SAVE_FORMAT, SAVE_PREFIX, SAVE_VERSION, StepBufferSaveError
    from rapo_fast.retrieval.encoders import make_encoder
    from rapo_fast.retrieval.step_traces import StepTraces

    saved = root / "ckpt" / f"global_step_{step}" / CHECKPOINT_SUBDIR
    with read_version(saved, SAVE_PREFIX, SAVE_FORMAT, SAVE_VERSION, StepBufferSaveError) as v:
        return StepTraces.load(v.path / "shard_0", make_encoder("hashed"), chat_word_tokenizer(ID))


def test_main_ppo_resumed_with_the_buffer_two_minibatches(first_run, search):
    """A second main_ppo resumes from the first run's step-2 checkpoint (verl's resume_mode=auto) with the step
    buffer restored, and runs step 3 with 2 PPO mini-batches over the 2 FSDP ranks (gloo): the second mini-batch runs
    after an update, so its ratios differ from 1 and the clip and the importance shaping act. The restored buffer has
    a read replica (searches go to it) and does not grow in this run, so the buffer it saves at step 3 must be the
    one saved at step 2: same size, same retrievals. Its prompts reward going on from a retrieved step, so each
    mini-batch (one group) has non-zero advantages."""
    root, _, before, _ = first_run
    records = run_main_ppo(
        root,
        search,
        "resumed",
        train="train_retrieval_reward",
        mini_batch=1,
        val_before_train=False,
        replicas=1,
        steps=3,
        save_freq=1,
        grow=False,
    )
    steps = _train_steps(records)
    assert [s["training/global_step"] for s in steps] == [3]  # verl resumed from global_step_2
    m = steps[0]
    print(3, {k: round(v, 5) for k, v in m.items() if k.startswith(("actor/", "rapo/"))})
    # the buffer actor was built from global_step_2's save: the size the first run ended with, nothing added since
    assert m["rapo/buffer/size"] == before[-1]["rapo/buffer/size"] and m["rapo/buffer/steps_added"] == 0
    # its searches found the first run's own steps, as step 2 did (a buffer rebuilt from the seed has only the seed)
    assert m["rapo/rollout/retrieval_score/mean"] > before[0]["rapo/rollout/retrieval_score/mean"]
    _assert_buffer_actor_figures(steps, replicas=1)
    # every group has both rewards, so both mini-batches update: the second one sees moved ratios
    assert m["rapo/adv/z_nonzero_frac/hybrid"] == 1.0 and m["actor/grad_norm"] > 0
    assert abs(m["actor/rapo/approx_kl"]) > 0  # signed: the sampled mean of log(ratio)
    assert abs(m["actor/rapo/ratio_mean"] - 1.0) > 0 and m["actor/pg_clipfrac"] > 0
    saved, resaved = _saved_buffer(root, 2), _saved_buffer(root, 3)
    assert len(saved) == len(resaved) == before[-1]["rapo/buffer/payloads"]
    histories = ["what is x think a", "<|im_start|> user what is y <|im_end|> <|im_start|> assistant think", "a b c"]
    for exclude in (None, [0, 1, 2]):
        a, b = saved.retrieve(histories, exclude), resaved.retrieve(histories, exclude)
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        assert all(seg is not None for seg in a[0])
