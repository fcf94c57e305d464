"""RAPO on verl as a verl user runs it: verl 0.9.1's own `python -m verl.trainer.main_ppo` (v1 trainer, FSDP2 actor,
agent loop, TransferQueue, Ray) for 2 steps with rapo_fast's plugin, unmodified, loaded by verl's entry points.

What runs: one subprocess per test, the command line a user types, with the plugin's agent loop `rapo_tool_agent`,
reward manager `rapo` (buffer growth), advantage `rapo`, loss `rapo_no_dual_clip` and the step-buffer checkpoint
callback. The model is a tiny Llama built from a config and saved with weights that make it a bigram model with a
known program (every turn is `think X <tool_call> CALL </tool_call>`, and `</retrieve>` is followed by `think2`), so
trajectories have tool steps and retrieval boundaries; the tokenizer is word-level, trained here (no download). The
checks read verl's own metrics stream (the `file` logger's JSONL, what `console`/`wandb` also get): the `rapo/*`
rollout, advantage, loss and buffer figures. The second run has 2 PPO mini-batches, so the second one's ratios differ
from 1 and the clip and the importance shaping act.
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
CALL = '{"name":"lookup","arguments":{}}'
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


def _job_dir(root: Path, prompts: list[tuple[str, str]]) -> Path:
    """The files a verl user would have: model directory, parquet data (`prompts`: question, ground truth), tool,
    reward, agent-loop YAML, step-buffer seed JSONL."""
    import pandas as pd

    model = root / "model"
    model.mkdir()
    chat_word_tokenizer(ID).save_pretrained(model)
    _bigram_model(model)
    (root / "tool.py").write_text(TOOL)
    (root / "reward.py").write_text(REWARD)
    (root / "agent_loops.yaml").write_text(AGENT_LOOPS)
    seed = {"query_id": 100, "prompt": "what is v", "steps": ["think a fact two"], "answer": "a", "reward": 1.0}
    (root / "seed.jsonl").write_text(json.dumps(seed) + "\n")
    for split, rows in (("train", prompts), ("val", prompts[:2])):
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


def _overrides(root: Path, *, mini_batch: int, ranks: int, val_before_train: bool, replicas: int = 0) -> list[str]:
    micro = 4 * mini_batch // ranks  # trajectories per rank in a mini-batch (rollout.n = 4): one micro-batch
    return [
        f"data.train_files={root / 'train.parquet'}",
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
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={root / 'tool.py'}",
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
        "+rapo.add_onpolicy_steps=true",
        "+rapo.buffer_name=rapo_step_buffer",
        f"+rapo.step_buffer.path={root / 'seed.jsonl'}",
        "+rapo.step_buffer.num_cpus=0",
        f"+rapo.step_buffer.replicas_per_node={replicas}",
        "trainer.checkpoint_callback_class=rapo_fast.integrations.verl.buffer_setup.StepBufferCheckpointCallback",
        "trainer.total_training_steps=2",
        "trainer.total_epochs=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.val_before_train={str(val_before_train).lower()}",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.nnodes=1",
        "trainer.device=cpu",
        "trainer.logger=[console,file]",
        "trainer.project_name=rapo_e2e",
        "trainer.experiment_name=cpu",
        f"trainer.default_local_dir={root / 'ckpt'}",
        # Ray on a CPU machine: logical GPUs stand for the FSDP ranks; TransferQueue's storage actors and controller
        # need CPUs of their own (with as few as the machine has, it waits for them silently), so Ray is told 16.
        f"+ray_kwargs.ray_init.num_gpus={ranks}",
        "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    tests_dir = HERE.parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(tests_dir), env.get("PYTHONPATH", "")) if p)
    env.update(
        VERL_USE_EXTERNAL_MODULES="verl_cpu_shims",
        VERL_FILE_LOGGER_PATH=str(root / "metrics.jsonl"),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        RAY_DEDUP_LOGS="0",
        WANDB_MODE="disabled",
    )
    env.pop("TRITON_INTERPRET", None)  # the actor runs torch's own kernels; the interpreter only slows it
    return env


def run_main_ppo(root: Path, prompts: list[tuple[str, str]] = PROMPTS, **kw) -> tuple[list[dict], str, float]:
    """Runs `python -m verl.trainer.main_ppo` on the job in `root`; returns the logged steps' metrics, the output and
    the wall time. Fails the test with the output's tail when the run fails."""
    _job_dir(root, prompts)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *_overrides(root, **kw)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    wall = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    (root / "main_ppo.log").write_text(out)
    assert proc.returncode == 0, f"main_ppo exited {proc.returncode} after {wall:.0f} s:\n{out[-6000:]}"
    lines = (root / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], out, wall


def _train_steps(records: list[dict]) -> list[dict]:
    return [r["data"] for r in records if "training/global_step" in r["data"]]


def test_main_ppo_two_rapo_steps_with_validation(tmp_path):
    """2 steps after a validation pass: the loop retrieves (its own group excluded), the reward manager grows the
    buffer, the advantage gives a retrieval term to exactly the hybrid rows, and validation neither searches nor adds.
    """
    records, out, wall = run_main_ppo(tmp_path, mini_batch=2, ranks=1, val_before_train=True)
    print(f"main_ppo wall time: {wall:.1f} s")
    steps = _train_steps(records)
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
    assert sum(m["rapo/buffer/step_queries"] for m in steps) == steps[-1]["rapo/buffer/queries"]


def test_main_ppo_two_minibatches_two_fsdp_ranks(tmp_path):
    """2 PPO mini-batches per step over 2 FSDP ranks (gloo): the second mini-batch runs after an update, so its
    ratios differ from 1 and the clip and the importance shaping act. The buffer has a read replica: searches go to
    it, adds are fanned out to it."""
    records, out, wall = run_main_ppo(
        tmp_path, PROMPTS_RETRIEVAL_REWARD, mini_batch=1, ranks=2, val_before_train=False, replicas=1
    )
    print(f"main_ppo wall time: {wall:.1f} s")
    steps = _train_steps(records)
    assert [s["training/global_step"] for s in steps] == [1, 2]
    for m in steps:
        print(m["training/global_step"], {k: round(v, 5) for k, v in m.items() if k.startswith("actor/")})
    # every group has both rewards, so every mini-batch updates: each step's second mini-batch sees moved ratios
    assert all(m["rapo/adv/z_nonzero_frac/hybrid"] == 1.0 for m in steps)
    assert all(m["actor/grad_norm"] > 0 for m in steps)
    assert max(abs(m["actor/rapo/approx_kl"]) for m in steps) > 0  # signed: the sampled mean of log(ratio)
    assert max(abs(m["actor/rapo/ratio_mean"] - 1.0) for m in steps) > 0
    assert max(m["actor/pg_clipfrac"] for m in steps) > 0
    assert all(m["rapo/rollout/retrieved_frac"] > 0 for m in steps)
    # searches served by a read replica of the buffer (adds fanned out to it): the same counts as without one
    _assert_buffer_actor_figures(steps, replicas=1)
