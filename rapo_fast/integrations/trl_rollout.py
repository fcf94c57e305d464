"""RAPO's hybrid rollouts inside TRL: a `rollout_func` for `trl.GRPOTrainer` / `RAPOGRPOTrainer`, and the batch extras.

What it is: `make_rollout_func(env, traces, ...)` returns a callable with TRL's rollout_func contract that runs
`rapo_fast.rollout` on the trainer's model (a hybrid row may insert a retrieved step between <retrieve> tags), grows
the StepTraces from the successful steps, and returns per row "env_mask" (1 on sampled tokens only, so tool output
and retrieved steps get no gradient in any GRPOTrainer), "retrieved_mask", "retrieval_reward" and "num_retrievals";
`attach_rollout_extras` (RAPOGRPOTrainer's `_generate_and_score_completions` override) carries them into the loss
batch and scales TRL's advantages by (1 + a * A_ret). docs/trl.md, "Hybrid rollouts inside TRL", says why two hooks.
What it is not: TRL's generation (no vLLM, top_p or top_k; sampling at trainer.temperature), a reward function, or a
chat-template path (prompts are plain text).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rapo_fast.rollouts.batch import KIND_GEN, KIND_RET, RolloutBatch

__all__ = ["RAPORolloutFunc", "make_rollout_func", "attach_rollout_extras", "prompt_group_id"]


@dataclass(frozen=True)
class _Prompt:
    """What rapo_fast.rollout needs of a problem: its prompt text and its group id."""

    prompt: str
    qid: int


def prompt_group_id(prompt: str) -> int:
    """The group id of a prompt (CRC-32 of its text, below StepTraces' off-policy id base): steps the policy took on
    the same prompt share it, which is what a rollout's exclude-own-group rule needs."""
    return zlib.crc32(prompt.encode("utf-8"))


def _groups(prompts: Sequence[Any], group_size: int) -> list[_Prompt]:
    """TRL's per-process prompt slice (each prompt repeated group_size times in a row) -> one problem per group."""
    if any(not isinstance(p, str) for p in prompts):
        raise ValueError("rapo rollout_func: prompts must be plain text (conversational prompts are not supported)")
    if len(prompts) % group_size:
        raise ValueError(
            f"rapo rollout_func: {len(prompts)} prompts on this process is not a multiple of num_generations="
            f"{group_size}; make per_device_train_batch_size * steps_per_generation a multiple of num_generations"
        )
    out = []
    for start in range(0, len(prompts), group_size):
        block = prompts[start : start + group_size]
        if any(p != block[0] for p in block):
            raise ValueError("rapo rollout_func: each process must receive whole groups of num_generations prompts")
        out.append(_Prompt(block[0], prompt_group_id(block[0])))
    return out


class RAPORolloutFunc:
    """TRL rollout_func running hybrid RAPO rollouts (see the module docstring and `make_rollout_func`)."""

    def __init__(
        self,
        env: Any,
        traces: Any = None,
        *,
        tokenizer: Any = None,
        success_fn: Callable[[str, str], bool] | None = None,
        n_hybrid: int | None = None,
        retrieve_prob: float | Callable[[int], float] = 0.5,
        mode: str = "exact",
        max_steps: int = 6,
        max_step_tokens: int = 24,
        exclude_own_group: bool | None = None,
    ) -> None:
        if not hasattr(env, "execute"):
            raise TypeError("rapo rollout_func: env must have execute(call_text) -> observation text")
        if n_hybrid is not None and (not isinstance(n_hybrid, int) or n_hybrid < 0):
            raise ValueError(f"rapo rollout_func: n_hybrid must be None or an int >= 0, got {n_hybrid!r}")
        self.env, self.traces, self.tokenizer, self.success_fn = env, traces, tokenizer, success_fn
        self.n_hybrid, self.retrieve_prob, self.mode = n_hybrid, retrieve_prob, mode
        self.max_steps, self.max_step_tokens, self.exclude_own_group = max_steps, max_step_tokens, exclude_own_group
        self.last_batch: RolloutBatch | None = None  # the latest rollout, for inspection

    def _hybrid_rows(self, group_size: int) -> int:
        if self.traces is None:
            return 0
        return group_size // 2 if self.n_hybrid is None else min(self.n_hybrid, group_size)

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        from rapo_fast.loss.advantages import step_entropy
        from rapo_fast.rollouts.config import RolloutConfig
        from rapo_fast.rollouts.loop import rollout
        from rapo_fast.train.trainer import retrieval_rewards

        train = trainer.model.training
        group_size = trainer.num_generations if train else trainer.num_generations_eval
        problems = _groups(prompts, group_size)
        tok = self.tokenizer if self.tokenizer is not None else trainer.processing_class
        n_hybrid = self._hybrid_rows(group_size)
        cfg = RolloutConfig(
            group_size=group_size,
            strategy="hybrid" if n_hybrid else "on_policy",
            hybrid={"n_hybrid": n_hybrid, "retrieve_prob": self.retrieve_prob},
            exclude_own_group=self.exclude_own_group,
            mode=self.mode,
            temperature=float(trainer.temperature),
            max_steps=self.max_steps,
            max_step_tokens=self.max_step_tokens,
        )
        model = trainer.accelerator.unwrap_model(trainer.model)
        batch = rollout(model, tok, self.env, problems, cfg, traces=self.traces if n_hybrid else None)
        self.last_batch = batch
        spans = batch.step_spans
        step_ent = step_entropy(batch.entropy, spans) if spans.numel() else torch.zeros(0)
        z, scored = retrieval_rewards(batch, step_ent)
        out = _trl_rows(batch, int(trainer.max_completion_length))
        out["retrieval_reward"] = z.tolist()
        out["num_retrievals"] = batch.num_retrievals().tolist()
        added = self._grow(batch, problems, tok)
        _log(trainer, "train" if train else "eval", batch, z, scored, added, self.traces)
        return out

    def _grow(self, batch: RolloutBatch, problems: list[_Prompt], tok: Any) -> int:
        """Add the successful trajectories' generated tool steps to the StepTraces (under their prompt's group id)."""
        if self.traces is None or self.success_fn is None:
            return 0
        from rapo_fast.train.trainer import onpolicy_steps

        ok = torch.tensor(
            [float(bool(self.success_fn(problems[int(i)].prompt, c))) for i, c in
             zip(batch.prompt_index, batch.completions)]
        )  # fmt: skip
        hist, steps, groups = onpolicy_steps(batch, ok, tok)
        if not steps:
            return 0
        _, slots = self.traces.add_steps(hist, steps, groups, return_slots=True)
        return int((slots >= 0).sum())


def make_rollout_func(env: Any, traces: Any = None, **kwargs: Any) -> RAPORolloutFunc:
    """A TRL `rollout_func` running RAPO's hybrid rollouts; pass it as GRPOTrainer(..., rollout_func=...).

    Args: env (`execute(call_text) -> observation text`: the tool), traces (a rapo_fast.StepTraces; None: plain
    on-policy multi-turn rollouts, no retrieval), tokenizer (default: the trainer's processing_class; it must speak the
    tags <tool> </tool> <retrieve> </retrieve>), success_fn ((prompt, completion text) -> bool: the successful
    trajectories' tool steps are added to traces; None: the buffer is not grown), n_hybrid (hybrid rows per group;
    default num_generations // 2), retrieve_prob, mode ("exact" / "splice"), max_steps, max_step_tokens,
    exclude_own_group: as in rapo_fast.rollout. Completions are cut at trainer.max_completion_length.
    """
    return RAPORolloutFunc(env, traces, **kwargs)


def _trl_rows(batch: RolloutBatch, max_len: int) -> dict[str, list]:
    """The rollout's rows in TRL's layout: prompt ids, completion ids (cut at max_len), per-token lists."""
    out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "retrieved_mask")}
    lengths = batch.attention_mask.sum(1).tolist()
    for b, (p, n) in enumerate(zip(batch.prompt_len.tolist(), lengths)):
        end = min(n, p + max_len)
        kinds = batch.kinds[b, p:end]
        out["prompt_ids"].append(batch.input_ids[b, :p].tolist())
        out["completion_ids"].append(batch.input_ids[b, p:end].tolist())
        out["logprobs"].append(batch.behav_logp[b, p:end].tolist())
        out["env_mask"].append((kinds == KIND_GEN).long().tolist())
        out["retrieved_mask"].append((kinds == KIND_RET).long().tolist())
    return out


def _log(trainer: Any, mode: str, batch: RolloutBatch, z: torch.Tensor, scored: torch.Tensor, added: int, traces):
    """rapo/* metrics of the rollout, beside TRL's own (averaged over processes)."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return
    n_ret = batch.num_retrievals()
    resp = ((batch.kinds >= KIND_GEN) & (batch.attention_mask > 0)).sum().clamp_min(1)
    has = scored > 0
    local = torch.stack([
        (n_ret > 0).float().mean(),
        n_ret.float().mean(),
        (batch.kinds == KIND_RET).sum() / resp,
        z[has].float().mean() if has.any() else torch.tensor(0.0),
        torch.tensor(float(added)),
        torch.tensor(float(len(traces) if traces is not None else 0)),
    ]).float().to(trainer.accelerator.device)  # fmt: skip
    values = trainer.accelerator.gather(local.reshape(1, -1)).reshape(-1, local.numel()).mean(0).tolist()
    names = ("retrieval_rate", "retrievals_per_traj", "retrieved_token_frac", "retrieval_reward", "buffer_added",
             "buffer_size")  # fmt: skip
    for name, value in zip(names, values):
        metrics[mode][f"rapo/{name}"].append(value)


def attach_rollout_extras(trainer: Any, inputs: list[dict], output: dict, retrieval_coef: float) -> dict:
    """Put the rollout_func's per-row extras into the batch GRPOTrainer built (`output`): "retrieved_mask" as a bool
    [B, T_completion] tensor, and the RAPO advantage (1 + retrieval_coef * A_ret) * A, where A is TRL's advantage and
    A_ret the retrieval reward group-normalised over all processes' rows (rapo_fast.loss.advantages.
    retrieval_advantage, as rapo_advantages; a group without retrievals gets A_ret = 0, so A is unchanged bit for
    bit). `inputs` are the input rows TRL merged the rollout_func's extra fields into. A batch without those fields
    is returned unchanged."""
    if not inputs or "retrieved_mask" not in inputs[0]:
        return output
    from rapo_fast.loss.advantages import retrieval_advantage

    ids = output["completion_ids"]
    mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for i, row in enumerate(inputs):
        values = torch.as_tensor(row["retrieved_mask"][: ids.shape[1]], dtype=torch.bool)
        mask[i, : values.numel()] = values.to(ids.device)
    output["retrieved_mask"] = mask
    if retrieval_coef == 0.0 or "retrieval_reward" not in inputs[0]:
        return output
    adv = output["advantages"]
    z = torch.tensor([float(row["retrieval_reward"]) for row in inputs], dtype=torch.float32, device=adv.device)
    z_all = trainer.accelerator.gather(z)
    group_size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
    groups = torch.arange(z_all.numel(), device=z_all.device) // group_size
    a_ret = retrieval_advantage(z_all, groups)
    start = trainer.accelerator.process_index * len(inputs)
    local = a_ret[start : start + len(inputs)].to(adv.dtype)
    output["advantages"] = (1.0 + retrieval_coef * local) * adv
    return output
