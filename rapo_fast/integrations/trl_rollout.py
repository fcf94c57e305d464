"""RAPO's hybrid rollouts inside TRL: a `rollout_func` for `trl.GRPOTrainer` / `RAPOGRPOTrainer`, and the batch extras.

What it is: `make_rollout_func` (TRL's rollout_func contract over `rapo_fast.rollout`, growing the StepTraces) and
`attach_rollout_extras` (carries its extras into the loss batch and scales TRL's advantages by (1 + a * A_ret)).
What it is not: TRL's generation (no vLLM; top_p, top_k, min_p, repetition_penalty are refused: sampling is at
trainer.temperature), nor a reward function. docs/trl.md, "Hybrid rollouts inside TRL", says why two hooks.
"""

from __future__ import annotations

import math
import numbers
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rapo_fast._checks import brief, check_bool, check_int
from rapo_fast.integrations.trl_setup import ChatEnv, ChatFormat, check_rapo_tags
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.batch import KIND_GEN, KIND_RET, RolloutBatch

__all__ = ["RAPORolloutFunc", "make_rollout_func", "attach_rollout_extras", "prompt_group_id"]

# GRPOConfig sampling options rapo_fast.rollout does not implement, with the value that means "off".
_UNSUPPORTED_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class _Prompt:
    """What rapo_fast.rollout needs of a problem: its prompt text, group id and (chat prompts) token ids; `source` is
    the prompt as TRL gave it (text or messages), what success_fn receives."""

    prompt: str
    qid: int
    source: Any = None
    prompt_ids: list[int] | None = None


def prompt_group_id(prompt: str) -> int:
    """The group id of a prompt (CRC-32 of its text, below StepTraces' off-policy id base): steps the policy took on
    the same prompt share it, which is what a rollout's exclude-own-group rule needs."""
    return zlib.crc32(prompt.encode("utf-8"))


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def _groups(prompts: Sequence[Any], group_size: int, chat: ChatFormat | None) -> list[_Prompt]:
    """TRL's per-process prompt slice (each prompt repeated group_size times in a row) -> one problem per group."""
    if len(prompts) % group_size:
        raise ValueError(
            f"rapo rollout_func: prompts: expected a multiple of num_generations={group_size} on this process "
            f"(per_device_train_batch_size * steps_per_generation), got {len(prompts)}"
        )
    out = []
    for start in range(0, len(prompts), group_size):
        block = prompts[start : start + group_size]
        if any(p != block[0] for p in block):
            raise ValueError(
                f"rapo rollout_func: prompts: expected whole groups of num_generations={group_size} equal prompts on "
                "each process, got a group of different prompts"
            )
        first = block[0]
        if isinstance(first, str):
            out.append(_Prompt(first, prompt_group_id(first), first))
        elif _is_chat(first) and chat is not None:
            text, ids = chat.prompt(first)
            out.append(_Prompt(text, prompt_group_id(text), first, ids))
        else:
            raise TypeError(
                f"rapo rollout_func: prompts: expected text or a list of chat messages ({{'role', 'content'}} dicts), "
                f"got {type(first).__name__}: {first!r:.120}"
            )
    return out


class RAPORolloutFunc:
    """A TRL `rollout_func` running RAPO's hybrid rollouts; pass it as GRPOTrainer(..., rollout_func=...) (built as
    `make_rollout_func(...)`, this class's other name).

    Args: env (`execute(call_text) -> observation text`: the tool), traces (a rapo_fast.StepTraces; None: plain
    on-policy multi-turn rollouts, no retrieval), tokenizer (default: the StepTraces' tokenizer, else the trainer's
    processing_class; each tag <tool> </tool> <retrieve> </retrieve> one token: `add_rapo_tags` adds them),
    success_fn ((prompt as TRL gave it, completion text as TRL's reward functions get it) -> a bool, or a finite number
    that counts as a success above 0.5 (the trainer's reward threshold); anything else, NaN included, raises
    TypeError/ValueError naming success_fn: the successful trajectories' tool steps are added to traces, on every
    process (docs/trl.md, "Several processes"); None: the buffer is not grown), n_hybrid (hybrid rows per group;
    default num_generations // 2), retrieve_prob, mode ("exact" / "splice"), max_steps, max_step_tokens,
    exclude_own_group: as in rapo_fast.rollout; retrieve_at_eval (evaluation rollouts retrieve too; they never grow
    the buffer), chat_tool_turns (conversational prompts: a tool's output is rendered as the chat template's tool
    turn; False: inline in the assistant turn).
    Completions are cut at trainer.max_completion_length. Bad arguments raise TypeError/ValueError here; the
    tokenizer's tags, the stored steps' token ids (below the tokenizer's size and the model's embedding rows) and the
    trainer's sampling options are checked when the trainer is built (RAPOGRPOTrainer) or at the first rollout
    (GRPOTrainer).
    """

    def __init__(
        self,
        env: Any,
        traces: StepTraces | None = None,
        *,
        tokenizer: Any = None,
        success_fn: Callable[[Any, str], bool] | None = None,
        n_hybrid: int | None = None,
        retrieve_prob: float | Callable[[int], float] = 0.5,
        mode: str = "exact",
        max_steps: int = 6,
        max_step_tokens: int = 24,
        exclude_own_group: bool | None = None,
        retrieve_at_eval: bool = False,
        chat_tool_turns: bool = True,
    ) -> None:
        if not callable(getattr(env, "execute", None)):
            raise TypeError(f"make_rollout_func: env: expected execute(call_text) -> text, got {type(env).__name__}")
        if traces is not None and not isinstance(traces, StepTraces):
            hint = " (wrap a StepBuffer: StepTraces(buffer, encoder, tokenizer))" if hasattr(traces, "search") else ""
            raise TypeError(
                f"make_rollout_func: traces: expected a rapo_fast.StepTraces or None, got {type(traces).__name__}{hint}"
            )
        if n_hybrid is not None:
            check_int("make_rollout_func: n_hybrid", n_hybrid, lo=0)
        if success_fn is not None and not callable(success_fn):
            raise TypeError(f"make_rollout_func: success_fn: expected a callable, got {type(success_fn).__name__}")
        for name, flag in (("retrieve_at_eval", retrieve_at_eval), ("chat_tool_turns", chat_tool_turns)):
            check_bool(f"make_rollout_func: {name}", flag)
        if tokenizer is None and traces is not None:
            tokenizer = traces.tokenizer  # the payloads' token ids are this tokenizer's: the policy must share it
        if tokenizer is not None:
            check_rapo_tags(tokenizer, traces=traces)
        self.env, self.traces, self.tokenizer, self.success_fn = env, traces, tokenizer, success_fn
        self.n_hybrid, self.retrieve_prob, self.mode = n_hybrid, retrieve_prob, mode
        self.max_steps, self.max_step_tokens, self.exclude_own_group = max_steps, max_step_tokens, exclude_own_group
        self.retrieve_at_eval, self.chat_tool_turns = retrieve_at_eval, chat_tool_turns
        self._bound: Any = None  # the trainer bind() checked
        self._chat: ChatFormat | None = None
        self.last_batch: RolloutBatch | None = None  # the latest rollout, for inspection

    def bind(self, trainer: Any) -> None:
        """Check the trainer against what the rollout supports (its tokenizer's tags, the stored steps' token ids,
        its sampling options); RAPOGRPOTrainer calls it at construction, a plain GRPOTrainer at the first rollout."""
        tok = self.tokenizer if self.tokenizer is not None else trainer.processing_class
        check_rapo_tags(tok, "rapo rollout_func", self.traces)
        accelerator = getattr(trainer, "accelerator", None)
        model = trainer.model if accelerator is None else accelerator.unwrap_model(trainer.model)
        check_stored_ids(self.traces, tok, model)
        proc = trainer.processing_class
        if self.tokenizer is not None and hasattr(proc, "__len__") and hasattr(self.tokenizer, "__len__"):
            if len(proc) != len(self.tokenizer):
                raise ValueError(
                    f"rapo rollout_func: processing_class: expected the rollout's tokenizer ({len(self.tokenizer)} "
                    f"tokens), got one of {len(proc)} tokens"
                )
        set_ = {k: getattr(trainer, k, off) for k, off in _UNSUPPORTED_SAMPLING.items()}
        set_ = {k: v for k, v in set_.items() if v != _UNSUPPORTED_SAMPLING[k] and not (k == "top_k" and v is None)}
        if set_:
            raise ValueError(
                f"rapo rollout_func: GRPOConfig sampling options: expected their defaults {_UNSUPPORTED_SAMPLING} "
                f"(RAPO's rollout samples at temperature only), got {set_}"
            )
        extra = getattr(getattr(trainer, "args", None), "generation_kwargs", None)
        if extra:
            raise ValueError(f"rapo rollout_func: generation_kwargs: expected None (unused here), got {extra!r}")
        if getattr(trainer, "use_vllm", False):
            raise ValueError("rapo rollout_func: use_vllm: expected False (rollouts run the trainer's model), got True")
        self._chat = None
        if getattr(tok, "chat_template", None) is not None:
            kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
            self._chat = ChatFormat(tok, kwargs, tool_turns=self.chat_tool_turns)
        self._bound = trainer

    def _hybrid_rows(self, group_size: int, train: bool) -> int:
        if self.traces is None or not (train or self.retrieve_at_eval):
            return 0
        return group_size // 2 if self.n_hybrid is None else min(self.n_hybrid, group_size)

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        from rapo_fast.loss.advantages import step_entropy
        from rapo_fast.rollouts.config import RolloutConfig
        from rapo_fast.rollouts.loop import rollout
        from rapo_fast.train.trainer import retrieval_rewards

        if self._bound is not trainer:
            self.bind(trainer)
        train = trainer.model.training
        group_size = trainer.num_generations if train else trainer.num_generations_eval
        chat = self._chat if prompts and _is_chat(prompts[0]) else None
        if prompts and _is_chat(prompts[0]) and chat is None:
            raise ValueError("rapo rollout_func: tokenizer.chat_template: expected one for chat prompts, got None")
        problems = _groups(prompts, group_size, chat)
        tok = self.tokenizer if self.tokenizer is not None else trainer.processing_class
        n_hybrid = self._hybrid_rows(group_size, train)
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
        env = self.env if chat is None or not chat.tool_turns else ChatEnv(self.env, chat)
        batch = rollout(model, tok, env, problems, cfg, traces=self.traces if n_hybrid else None)
        self.last_batch = batch
        spans = batch.step_spans
        step_ent = step_entropy(batch.entropy, spans) if spans.numel() else torch.zeros(0)
        z, scored = retrieval_rewards(batch, step_ent)
        out = _trl_rows(batch, int(trainer.max_completion_length))
        out["retrieval_reward"] = z.tolist()
        out["num_retrievals"] = batch.num_retrievals().tolist()
        added = self._grow(batch, problems, out["completion_ids"], tok, chat) if train else 0  # never at evaluation
        _log(trainer, "train" if train else "eval", batch, z, scored, added, self.traces)
        return out

    def _grow(self, batch: RolloutBatch, problems: list[_Prompt], completion_ids: list, tok: Any, chat: Any) -> int:
        """Add the successful trajectories' generated tool steps to the StepTraces (under their prompt's group id), in
        the form of the seed steps (a chat tool turn is taken off: ChatFormat.plain_step); returns how many it stored.
        Under several processes every process's new steps are gathered and added on each, in process order, so that
        every process holds the same buffer (docs/trl.md, "Several processes"): a collective call, made on every
        process at every training rollout; a failure on one process raises on all of them instead of leaving the
        others waiting."""
        if self.traces is None or self.success_fn is None:
            return 0
        from rapo_fast.train.trainer import onpolicy_steps

        failed: BaseException | None = None
        try:
            done = tok.batch_decode(completion_ids, skip_special_tokens=True)  # the text TRL's reward functions get
            rows = zip(batch.prompt_index.tolist(), done)
            ok = torch.tensor([success_value(self.success_fn(problems[i].source, c)) for i, c in rows])
            hist, steps, groups = onpolicy_steps(batch, ok, tok)
            if chat is not None and chat.tool_turns:
                steps = [chat.plain_step(s) for s in steps]
            local: Any = (self.traces.encode(hist), steps, groups)  # keys made once, where the histories are
        except Exception as exc:
            failed, local = exc, f"{type(exc).__name__}: {exc}"
        parts = gather_objects(local)
        if failed is not None:
            raise failed
        bad = [(rank, part) for rank, part in enumerate(parts) if isinstance(part, str)]
        if bad:
            raise RuntimeError(f"rapo rollout_func: process {bad[0][0]} failed growing the step buffer: {bad[0][1]}")
        steps = [s for _, part, _ in parts for s in part]
        if not steps:
            return 0
        keys = torch.cat([k for k, _, _ in parts])
        _, slots = self.traces.add_encoded(keys, steps, [g for *_, part in parts for g in part], return_slots=True)
        return int((slots >= 0).sum())


def success_value(value: Any) -> float:
    """success_fn's result as 1.0 (a success) or 0.0: a bool (NumPy's, a one-element tensor's too) as it is, a finite
    number as a success above 0.5; anything else raises naming success_fn (a NaN must not count as a success, as
    bool(nan) would)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return float(bool(value))
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"rapo rollout_func: success_fn: expected a bool or a finite number (a success above 0.5), got "
            f"{type(value).__name__} {brief(value)}"
        )
    if not isinstance(value, numbers.Integral) and not math.isfinite(value):  # an int is finite (and may overflow)
        raise ValueError(
            f"rapo rollout_func: success_fn: expected a bool or a finite number (a success above 0.5), got {value}"
        )
    return float(value > 0.5)


def check_stored_ids(traces: StepTraces | None, tokenizer: Any, model: Any) -> None:
    """Every token id the StepTraces stored is below the tokenizer's size and the model's input embedding rows: a
    buffer built with a larger tokenizer would otherwise fail inside the embedding when a step is retrieved
    (IndexError on the CPU, a device-side assert on a GPU). ValueError naming traces and both sizes."""
    if traces is None or not traces.payloads:
        return
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    rows = getattr(emb, "num_embeddings", None)  # the whole table's, also where the weight is sharded
    sizes = [n for n in (vocab, rows) if isinstance(n, int)]
    if not sizes:
        return
    limit = min(sizes)
    tops = {p: max(seg) for p, seg in traces.payloads.items()}
    over = [p for p, top in tops.items() if top >= limit]
    if over:
        worst = max(over, key=tops.__getitem__)
        raise ValueError(
            f"rapo rollout_func: traces: expected token ids below {limit} (the tokenizer's {vocab} tokens, the model's "
            f"input embedding of {rows} rows), got {len(over)} of {len(tops)} stored steps past it (payload {worst} "
            f"holds id {tops[worst]}): build the StepTraces with the rollout's tokenizer, and resize the model's "
            "embeddings to it (add_rapo_tags(tokenizer, model) does)"
        )


def gather_objects(obj: Any) -> list:
    """[obj of process 0, obj of process 1, ...] under torch.distributed's default group (what accelerate, hence TRL,
    sets up for several processes); [obj] in a single process. A collective: every process must call it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# The name a TRL user calls (GRPOTrainer(..., rollout_func=make_rollout_func(env, traces, ...))); the class is the type
# RAPOGRPOTrainer recognises. One signature, stated once.
make_rollout_func = RAPORolloutFunc


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
    # a retrieval point: a tool result reached by a hybrid row (the only place a retrieval can happen)
    rows, ends = batch.step_spans[:, 0], batch.step_spans[:, 2]
    points = ((batch.step_obs_end > ends) & batch.hybrid[rows]).sum()
    dev = trainer.accelerator.device
    size, z_mean = len(traces) if traces is not None else 0, z[has].float().mean() if has.any() else 0.0
    row = [(n_ret > 0).float().mean(), n_ret.float().mean(), (batch.kinds == KIND_RET).sum() / resp, z_mean]
    local = torch.tensor([[float(v) for v in (*row, added, size, points, n_ret.sum())]], device=dev)
    values = trainer.accelerator.gather(local).reshape(-1, local.shape[1]).mean(0).tolist()
    names = (
        "retrieval_rate retrievals_per_traj retrieved_token_frac retrieval_reward buffer_added buffer_size "
        "retrieval_points retrievals"
    ).split()
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
