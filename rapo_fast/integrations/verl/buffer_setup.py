"""Setting up RAPO's step buffer for a verl job: the one-time build CLI, the config keys, the checkpoint hook.

What this is: `main(argv)` (the build), `step_buffer_options` / `step_buffer_from_config` (the job's buffer from
`rapo.step_buffer.*`), `onpolicy_steps` / `check_growth_config` (the buffer-growth rule) and
`StepBufferCheckpointCallback` (verl 0.9.1's checkpoint hook); all in docs/verl.md section 4.
What it is not: the actor or the client (buffer_actor.py). Importing it imports neither ray nor verl (verl only inside
`resume_checkpoint_dir`, ray when a client is made).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from rapo_fast.integrations.verl import verl_compat
from rapo_fast.integrations.verl.buffer_actor import (
    CHECKPOINT_SUBDIR,
    DEFAULT_NAME,
    build_step_buffer_from_jsonl,
    get_or_create_step_buffer,
    get_step_buffer,
)
from rapo_fast.integrations.verl.buffer_client import StepBufferClient

__all__ = [
    "main",
    "step_buffer_options",
    "resume_checkpoint_dir",
    "step_buffer_from_config",
    "StepBufferCheckpointCallback",
    "onpolicy_steps",
    "check_growth_config",
]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rapo_fast.integrations.verl.buffer_setup --jsonl traces.jsonl --out DIR --tokenizer MODEL_PATH`."""
    p = argparse.ArgumentParser(description="Build RAPO's step buffer for verl from off-policy JSONL traces.")
    p.add_argument("--jsonl", required=True, help="trajectories (docs/formats.md): query_id, prompt, steps, reward")
    p.add_argument("--out", required=True, help="directory to save the buffer into (rapo.step_buffer.path)")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer path: the policy's (payloads are its token ids)")
    p.add_argument("--encoder", default="hashed", help="'hashed', 'hashed:<dim>' or 'minilm' (default: hashed)")
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--top-k", type=int, default=5, help="trajectories kept per query, by reward (paper: 5)")
    p.add_argument("--capacity", type=int, default=None, help="slots in all (default 4x the off-policy steps)")
    p.add_argument("--metric", default="cosine", choices=("cosine", "ip", "l2"))
    p.add_argument("--eviction", default="fifo", choices=("fifo", "lowest_score"))
    p.add_argument("--trust-remote-code", action="store_true")
    a = p.parse_args(argv)
    out = build_step_buffer_from_jsonl(
        a.jsonl,
        a.out,
        a.tokenizer,
        encoder=a.encoder,
        num_shards=a.num_shards,
        trust_remote_code=a.trust_remote_code,
        top_k=a.top_k,
        capacity=a.capacity,
        metric=a.metric,
        eviction=a.eviction,
    )
    print(f"step buffer saved to {out} ({a.num_shards} shard(s), encoder {a.encoder})")
    return 0


def onpolicy_steps(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    step_spans: Sequence[Sequence[int]],
    step_obs_end: Sequence[int],
    reward: float,
    decode: Callable[[list[int]], str],
    threshold: float = 0.5,
) -> tuple[list[str], list[str]]:
    """The (history, step) texts of one finished trajectory that go into the buffer, by rapo_fast's own trainer's rule
    (rapo_fast.train.trainer: `_add_onpolicy`): nothing unless reward > threshold; per step [start, end) of the
    response with its tool response ending at obs_end, the step is response[start:obs_end] and its history prompt +
    response[:start]; a step with obs_end == end (the answer, no tool call) is not a step. step_spans / step_obs_end
    are the agent loop's extra fields rapo_step_spans / rapo_step_obs_end. decode: token ids -> text, the same decoding
    the loop uses for its retrieval queries. The caller adds them: `await client.add_steps(hist, steps, [gid] * n)`."""
    if len(step_spans) != len(step_obs_end):
        raise ValueError(f"onpolicy_steps: step_obs_end: expected {len(step_spans)} entries, got {len(step_obs_end)}")
    hist, steps = [], []
    if not reward > threshold:
        return hist, steps
    ids = list(prompt_ids) + list(response_ids)
    p = len(prompt_ids)
    for (start, end), obs_end in zip(step_spans, step_obs_end):
        if obs_end == end:
            continue
        if not 0 <= start <= end <= obs_end <= len(response_ids):
            raise ValueError(
                f"onpolicy_steps: step_spans: expected in the response, got [{start}, {end}) obs_end {obs_end}"
            )
        hist.append(decode(ids[: p + start]))
        steps.append(decode(ids[p + start : p + obs_end]))
    return hist, steps


def step_buffer_options(config: Any) -> dict:
    """The buffer's settings from the trainer config's `rapo.step_buffer` (added with `+rapo.step_buffer.<key>=`):
    name (default: rapo.buffer_name, the agent loop's key, else "rapo_step_buffer"), path (the built buffer or a
    JSONL), encoder, num_shards, replicas_per_node (read replicas of each shard per node; default 0: none),
    num_cpus, num_gpus, tokenizer (default: the policy's, actor_rollout_ref.model.tokenizer_path or .path),
    capacity/top_k/metric/eviction (JSONL source only), window_s, max_batch, allow_missing_on_resume."""
    rapo = config.get("rapo", None) or {}
    sb = dict(rapo.get("step_buffer", None) or {})
    model = config.actor_rollout_ref.model
    # one name for the loop and the buffer: the agent loop reads rapo.buffer_name
    out = {"name": sb.pop("name", None) or rapo.get("buffer_name", None) or DEFAULT_NAME, "path": sb.pop("path", None)}
    out["tokenizer"] = sb.pop("tokenizer", None) or model.get("tokenizer_path", None) or model.path
    out["trust_remote_code"] = bool(model.get("trust_remote_code", False))
    out["allow_missing_on_resume"] = bool(sb.pop("allow_missing_on_resume", False))
    return {**out, **sb}


def resume_checkpoint_dir(config: Any) -> str | None:
    """The global_step_N folder verl's v1 trainer will resume from (PPOTrainer._load_checkpoint's rule), or None."""
    mode = config.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = str(config.trainer.resume_from_path)
        return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    find_latest_ckpt_path = verl_compat.get("verl.utils.checkpoint.checkpoint_manager:find_latest_ckpt_path")
    folder = config.trainer.default_local_dir
    return find_latest_ckpt_path(folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder))


def step_buffer_from_config(config: Any) -> StepBufferClient:
    """The job's buffer: the existing actor(s), else created from the checkpoint verl resumes from
    (global_step_N/rapo_step_buffer), else from rapo.step_buffer.path. A resumed run whose checkpoint lacks the
    buffer raises unless rapo.step_buffer.allow_missing_on_resume is set (then: built from path again)."""
    opts = step_buffer_options(config)
    name, path, allow = opts.pop("name"), opts.pop("path"), opts.pop("allow_missing_on_resume")
    with contextlib.suppress(ValueError):
        return get_step_buffer(name)
    ckpt = resume_checkpoint_dir(config)
    if ckpt is not None:
        saved = os.path.join(ckpt, CHECKPOINT_SUBDIR)
        if os.path.isdir(saved):
            path = saved
        elif not allow:
            raise FileNotFoundError(
                f"step_buffer_from_config: resuming from {ckpt}, which has no {CHECKPOINT_SUBDIR}/ (the step buffer "
                "was not saved with it); set +rapo.step_buffer.allow_missing_on_resume=true to rebuild it from "
                "rapo.step_buffer.path"
            )
    if path is None:
        raise ValueError("step_buffer_from_config: rapo.step_buffer.path: expected a buffer or traces JSONL, got none")
    return get_or_create_step_buffer(name, path, **opts)


def check_growth_config(config: Any) -> None:
    """With `rapo.add_onpolicy_steps: true`, the job must score its rollouts through the "rapo" reward manager
    (buffer_growth.RapoRewardManager, found by its marker attribute: verl may load it by module) inside the agent-loop
    workers, where the agent loop's fields are: raises ValueError otherwise. Nothing to check when the key is off."""
    rapo = config.get("rapo", None) or {}
    add = rapo.get("add_onpolicy_steps", False)
    if add is False:
        return
    if add is not True:
        raise ValueError(f"rapo.add_onpolicy_steps: expected a bool, got {add!r}")
    resolve_reward_manager_cls = verl_compat.get("verl.trainer.ppo.reward:resolve_reward_manager_cls")
    cls = resolve_reward_manager_cls(config)
    if not getattr(cls, "rapo_grows_step_buffer", False):
        raise ValueError(
            f"reward.reward_manager: expected rapo with rapo.add_onpolicy_steps, got {cls.__name__}: set "
            "reward.reward_manager.name=rapo (and rapo.inner_reward_manager to the one used before)"
        )
    rm = config.reward.reward_model
    if rm.get("enable", False) and not rm.get("enable_resource_pool", False):
        raise ValueError(
            "reward.reward_model.enable_resource_pool: expected true with rapo.add_onpolicy_steps and a reward model "
            "(the rollouts scored in the agent-loop workers), got false: set it to true"
        )
    if rm.get("enable", False) and config.reward.custom_reward_function.get("path", None) is None:
        raise ValueError(
            "reward.custom_reward_function.path: expected one with rapo.add_onpolicy_steps and a reward model, got "
            "none: without it verl's RewardLoopWorker.compute_score_disrm scores the rollouts, calling no manager"
        )


class StepBufferCheckpointCallback:
    """verl's `trainer.checkpoint_callback_class` (verl/trainer/ppo/checkpoint_callback.py, v1 trainer): built on the
    driver in PPOTrainer.__init__, before any rollout, it creates the job's buffer (`step_buffer_from_config`, so the
    driver owns the actors); `on_save` saves it (its shards' primaries: read replicas hold the same state) into
    `<global_step_N>/rapo_step_buffer` after verl's own checkpoint. Duck-typed to verl's CheckpointCallback (verl
    only instantiates it by name and calls on_save)."""

    def __init__(self, config: Any = None):
        check_growth_config(config)  # rapo.add_onpolicy_steps needs the "rapo" reward manager: fail before training
        self.config = config
        self.client = step_buffer_from_config(config)

    def on_save(self, trainer: Any = None, global_step: int = 0, checkpoint_dir: str = "", **kwargs: Any) -> None:
        if not checkpoint_dir:
            raise ValueError("StepBufferCheckpointCallback.on_save: checkpoint_dir: expected global_step_N, got None")
        self.client.save(os.path.join(checkpoint_dir, CHECKPOINT_SUBDIR))


if __name__ == "__main__":
    raise SystemExit(main())
