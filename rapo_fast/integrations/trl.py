"""TRL adapter: `RAPOGRPOTrainer`, a `trl.GRPOTrainer` whose policy loss goes through `rapo_fast.rapo_loss`.

What it is: a subclass whose `_compute_loss` is one call of the fused hidden-state loss (no [B, T, V] logits), and
`trl_to_rapo_options`, the mapping from TRL's configuration (with retrieval off it reproduces TRL's loss and
gradients). The mapping table, the extras and the rollout hook: docs/trl.md. The TRL path's names: `__all__`.
What it is not: a re-implementation of TRL's generation or rewards; TRL options without an exact counterpart raise
`ValueError` naming the option.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from rapo_fast.loss.options import LossOptions

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - trl is an optional dependency
    raise ImportError("rapo_fast.integrations.trl needs `trl` (pip install trl)") from exc

# The TRL path from one import: the trainer, the rollout function, the tokenizer set-up, the buffer and its encoders,
# the checkpoint callback.
from rapo_fast.integrations.trl_checkpoint import StepTracesCheckpoint
from rapo_fast.integrations.trl_rollout import RAPORolloutFunc, make_rollout_func
from rapo_fast.integrations.trl_setup import add_rapo_tags, check_rapo_tags
from rapo_fast.retrieval.encoders import HashedNgramEncoder, MiniLMEncoder, PolicyHiddenEncoder
from rapo_fast.retrieval.step_traces import StepTraces

__all__ = [
    "RAPOGRPOTrainer",
    "trl_to_rapo_options",
    "make_rollout_func",
    "RAPORolloutFunc",
    "add_rapo_tags",
    "check_rapo_tags",
    "StepTraces",
    "StepTracesCheckpoint",
    "HashedNgramEncoder",
    "MiniLMEncoder",
    "PolicyHiddenEncoder",
]

# LossOptions fields a user may set through `rapo_options`; everything else comes from TRL's own configuration.
RAPO_EXTRA_OPTIONS = ("shaping_m", "offpolicy_train", "gamma", "is_cap", "tis_cap")
_EXACT_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Inputs TRL forwards for vision-language models; the hidden-state path here is text-only.
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class TRLLossPlan:
    """How one TRL configuration maps onto `rapo_loss`: its keyword options and the normaliser TRL applies.

    `options` holds the rapo_loss options the mapping sets (fields of rapo_fast.loss.options.LossOptions; checked by
    it when the plan is made); `loss_options()` gives them as a LossOptions.
    `global_num_tokens` is one of: None (rapo_loss's own count), "batch_x_max_len" (dr_grpo), "batch" (grpo: the
    sequence count; luspo: the token-sum normaliser), "num_items" (dapo); it is resolved per call from the batch,
    because TRL's normalisers depend on it.
    `divide_by_grad_accum` says whether TRL divides the loss by its gradient-accumulation steps in training mode.
    """

    options: dict[str, Any] = field(default_factory=dict)
    global_num_tokens: str | None = None
    divide_by_grad_accum: bool = True
    use_tis: bool = False

    def loss_options(self) -> LossOptions:
        return LossOptions(**self.options)


def trl_to_rapo_options(trainer: Any, rapo_options: Mapping[str, Any] | None = None) -> TRLLossPlan:
    """Map a GRPOTrainer's loss configuration (its attributes and `args`) onto `rapo_loss` options.

    Reads the trainer attributes TRL's `_compute_loss` reads (loss_type, epsilon_low/high, beta, temperature,
    importance_sampling_level, ...), so it reflects changes made to them after construction. Raises ValueError naming
    the TRL option when there is no exact equivalent, instead of approximating it.
    """
    extras = dict(rapo_options or {})
    unknown = sorted(set(extras) - set(RAPO_EXTRA_OPTIONS))
    if unknown:
        raise ValueError(f"rapo_options: unknown option(s) {unknown}; allowed: {list(RAPO_EXTRA_OPTIONS)}")
    plan = _aggregation_plan(trainer.loss_type)
    plan.options.update(_clip_options(trainer))
    _refuse_unsupported(trainer)
    plan.options.update(_kl_and_entropy_options(trainer, trainer.loss_type))
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
        plan.options["tis_cap"] = _vllm_tis_cap(trainer, extras)
        plan.use_tis = True
    plan.options["temperature"] = float(trainer.temperature) / _logit_scale(trainer.model)
    plan.options.update(extras)
    if extras.get("tis_cap") is not None:
        plan.use_tis = True
    plan.loss_options()  # the values, checked now (at the trainer's construction) rather than at the first step
    _refuse_without_behaviour_logps(trainer, plan)
    return plan


def _has_behaviour_logps(trainer: Any) -> bool:
    """Whether the trainer's batches can carry "sampling_per_token_logps": TRL fills it from vLLM's sampling
    log-probs (use_vllm) or from a rollout_func's "logprobs"; a subclass that overrides
    `_generate_and_score_completions` (where a "retrieved_mask" must come from too) may add it itself. TRL's
    transformers generation gives none."""
    if getattr(trainer, "use_vllm", False) or getattr(trainer, "rollout_func", None) is not None:
        return True
    own = (GRPOTrainer._generate_and_score_completions, RAPOGRPOTrainer._generate_and_score_completions)
    return type(trainer)._generate_and_score_completions not in own


def _refuse_without_behaviour_logps(trainer: Any, plan: TRLLossPlan) -> None:
    """offpolicy_train="truncated" and tis_cap need the behaviour log-probs: a ValueError now (at construction), not
    a KeyError-like failure at the first step, when the trainer has no way to produce them."""
    truncated = plan.options.get("offpolicy_train") == "truncated"
    if not (truncated or plan.use_tis) or _has_behaviour_logps(trainer):
        return
    what = "offpolicy_train='truncated'" if truncated else "tis_cap"
    raise ValueError(
        f"rapo_options: {what} needs the behaviour log-probs of the sampled tokens (inputs['sampling_per_token_logps']"
        "), which TRL provides only with use_vllm=True or a rollout_func returning 'logprobs' (or a subclass "
        "overriding _generate_and_score_completions that adds them); this trainer has none of these"
        + (": use offpolicy_train='shaped', which needs no behaviour log-probs" if truncated else "")
    )


def _aggregation_plan(loss_type: str) -> TRLLossPlan:
    """loss_agg, the global normaliser and the gradient-accumulation division of TRL's loss_type."""
    if loss_type not in _EXACT_LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r} has no exact rapo_fast equivalent (its surrogate is not the PPO-clip one); "
            f"use one of {list(_EXACT_LOSS_TYPES)}"
        )
    if loss_type == "grpo":
        # TRL averages over all B rows, an all-masked row counting as 0; verl's seq-mean over non-empty rows with the
        # global sequence count B is the same number.
        return TRLLossPlan(options={"loss_agg": "seq-mean-token-mean"}, global_num_tokens="batch")
    if loss_type == "bnpo":
        return TRLLossPlan(options={"loss_agg": "token-mean"})
    if loss_type == "dr_grpo":
        return TRLLossPlan(options={"loss_agg": "token-mean"}, global_num_tokens="batch_x_max_len")
    if loss_type == "dapo":
        # TRL folds the accumulation steps into its num_items normaliser
        return TRLLossPlan(
            options={"loss_agg": "token-mean"}, global_num_tokens="num_items", divide_by_grad_accum=False
        )
    # luspo: (per_token_loss * mask).sum(-1).mean(), i.e. a token sum over the row count
    return TRLLossPlan(options={"loss_agg": "token-mean"}, global_num_tokens="batch")


def _clip_options(trainer: Any) -> dict[str, Any]:
    """eps_low / eps_high, TRL's delta as the dual clip, and the importance-sampling level."""
    eps_low, eps_high = float(trainer.epsilon_low), float(trainer.epsilon_high)
    options: dict[str, Any] = dict(eps_low=eps_low, eps_high=eps_high)
    delta = getattr(trainer.args, "delta", None)
    if delta is not None:
        # TRL clamps the unclipped ratio at delta for every token; for A >= 0 the clipped term already wins, for A < 0
        # this is verl's dual clip with c = delta, provided delta exceeds the upper clip bound.
        if not delta > 1.0 + eps_high:
            raise ValueError(f"delta={delta} must exceed 1 + epsilon_high={1 + eps_high} to map onto dual_clip")
        options["dual_clip"] = float(delta)
    if trainer.importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={trainer.importance_sampling_level!r} is not 'token'/'sequence'")
    options["importance_sampling_level"] = trainer.importance_sampling_level
    return options


def _kl_and_entropy_options(trainer: Any, loss_type: str) -> dict[str, Any]:
    """beta with the k3 estimator, and a static entropy bonus (bnpo only)."""
    options: dict[str, Any] = {}
    beta = float(trainer.beta)
    if beta != 0.0:
        if getattr(trainer.args, "use_bias_correction_kl", False):
            raise ValueError(
                "use_bias_correction_kl=True multiplies TRL's KL by the importance ratio; rapo_loss's k3 KL has no "
                "such factor. Set use_bias_correction_kl=False to use RAPOGRPOTrainer with beta != 0."
            )
        # TRL's k3 has no [-10, 10] clamp (verl's has): the adapter reproduces its host.
        options.update(beta=beta, kl_estimator="k3", kl_clamp=False)
    entropy_coef = float(getattr(trainer, "entropy_coef", 0.0) or 0.0)
    if entropy_coef != 0.0:
        if loss_type != "bnpo":
            raise ValueError(
                f"entropy_coef != 0 with loss_type={loss_type!r}: TRL normalises its entropy bonus by the local token "
                "count whatever the loss type, which rapo_loss reproduces only for loss_type='bnpo'"
            )
        options["entropy_coef"] = entropy_coef
    return options


def _refuse_unsupported(trainer: Any) -> None:
    """ValueError for TRL loss features without an exact rapo_loss counterpart."""
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        raise ValueError("top_entropy_quantile < 1 (high-entropy token mask) is not supported by rapo_loss")
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        raise ValueError("off_policy_mask_threshold (off-policy sequence mask) is not supported by rapo_loss")
    if getattr(trainer, "use_adaptive_entropy", False):
        raise ValueError("use_adaptive_entropy is not supported: set a static entropy_coef (bnpo only)")
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError("MoE router auxiliary loss is not supported: set router_aux_loss_coef=0")


def _vllm_tis_cap(trainer: Any, extras: Mapping[str, Any]) -> float:
    """tis_cap of TRL's vLLM importance-sampling correction (mode "token_truncate" without clip_min only)."""
    mode = trainer.vllm_importance_sampling_mode
    clip_min = trainer.vllm_importance_sampling_clip_min
    if mode != "token_truncate" or clip_min not in (None, 0, 0.0):
        raise ValueError(
            f"vllm_importance_sampling_mode={mode!r} (clip_min={clip_min}) has no rapo_fast equivalent; use "
            "'token_truncate' without clip_min (truncated IS, min(exp(old - behav), clip_max))"
        )
    if "tis_cap" in extras:
        raise ValueError("tis_cap given in rapo_options while TRL's vLLM importance sampling is on; set only one")
    cap = trainer.vllm_importance_sampling_clip_max
    if cap is None:
        raise ValueError("vllm_importance_sampling_clip_max=None (untruncated IS) is not supported: set a cap")
    return float(cap)


def _logit_scale(model: Any) -> float:
    """The logit multiplier TRL's fused head applies before the temperature (folded into our temperature)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        raise ValueError("models with final_logit_softcapping are not supported by rapo_loss's hidden-state path")
    # Same lookup order as trl.trainer.utils.add_fused_lm_head.
    scale = getattr(cfg, "logit_scale", None)
    if scale is None:
        scale = getattr(cfg, "output_multiplier", None)
    if scale is None:
        scale = getattr(cfg, "lm_head_multiplier", None)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:
        scale = cfg.logits_scaling if cfg.model_type == "hyperclovax" else 1.0 / cfg.logits_scaling
    scale = 1.0 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"logit scale {scale} must be > 0 to fold into the temperature")
    return scale


def _install_rapo_forward(model: torch.nn.Module, cast_lm_head_to_fp32: bool) -> None:
    """Give `model.forward` a `rapo_fast_loss=` keyword that runs the backbone and the fused loss inside forward.

    Running inside the (possibly DDP/FSDP-wrapped) model's forward keeps the wrappers' hooks armed, the same reason
    TRL's own fused head is a forward keyword. Without the keyword the previous forward runs unchanged.
    """
    if getattr(model, "_rapo_fast_forward_installed", False):
        return
    previous_forward = model.forward

    def _forward(self, *args, rapo_fast_loss: dict | None = None, **kwargs):
        if rapo_fast_loss is None:
            return previous_forward(*args, **kwargs)
        import rapo_fast

        loss_kwargs = dict(rapo_fast_loss)
        keep = loss_kwargs.pop("logits_to_keep")
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        # Completion token j is predicted by the hidden state one position earlier.
        hidden = hidden[:, -keep - 1 : -1]
        head = self.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: the gathered weight the model actually uses
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        hidden = hidden.to(weight.device)
        if cast_lm_head_to_fp32 or hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        # TRL runs an fp32-cast head outside autocast; so does this path.
        autocast_off = torch.autocast(hidden.device.type, enabled=False) if cast_lm_head_to_fp32 else nullcontext()
        with autocast_off:
            given_old = loss_kwargs.get("old_logp") is not None
            if not given_old:
                # TRL skips the old log-probs when they equal the current ones (one iteration per generation) and
                # uses logp.detach(); a no-grad chunked pass gives the same values without holding [N, V].
                with torch.no_grad():
                    loss_kwargs["old_logp"] = rapo_fast.token_logprobs(
                        hidden=hidden,
                        weight=weight,
                        bias=bias,
                        targets=loss_kwargs["targets"],
                        temperature=loss_kwargs["options"].temperature,
                    )
            loss, metrics = rapo_fast.rapo_loss(
                hidden=hidden, weight=weight, bias=bias, return_metrics=True, **loss_kwargs
            )
            seq_clip = _sequence_clip_fractions(metrics.token_logp, loss_kwargs, given_old)
            return loss, {**metrics.scalars(), "seq_clip": seq_clip}

    model.forward = types.MethodType(_forward, model)
    model._rapo_fast_forward_installed = True


@torch.no_grad()
def _sequence_clip_fractions(logp: torch.Tensor, loss_kwargs: dict, given_old: bool) -> torch.Tensor:
    """[2, B]: each row's fraction of low- / high-clipped tokens as TRL defines them (ratio below 1 - eps_low with
    A < 0 / above 1 + eps_high with A > 0, the unshaped ratio, per token or per sequence), NaN for a row without
    tokens in the loss: what TRL's clip_ratio/low_min and high_max reduce. `logp`: the log-probs the loss used
    (rapo_loss's metrics.token_logp), so no log-prob pass of its own; without given old log-probs the ratio is 1."""
    opts = loss_kwargs["options"]
    mask = loss_kwargs["loss_mask"].bool()
    if loss_kwargs.get("retrieved_mask") is not None:
        mask = mask & ~loss_kwargs["retrieved_mask"]
    mask = mask.float()
    old = loss_kwargs["old_logp"]
    if given_old:
        logp = logp.float()
        log_ratio = torch.where(mask > 0, logp - old.float(), torch.zeros_like(logp))
    else:
        log_ratio = torch.zeros_like(mask)
    adv = loss_kwargs["advantages"].float()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    if opts.importance_sampling_level == "sequence":
        ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
        low = ((ratio < 1 - opts.eps_low) & (adv < 0)).float().mean(-1)  # one value per sequence, as TRL's
        high = ((ratio > 1 + opts.eps_high) & (adv > 0)).float().mean(-1)
        return torch.stack([low, high])
    ratio = torch.exp(log_ratio)
    count = mask.sum(-1)
    low = (((ratio < 1 - opts.eps_low) & (adv < 0)).float() * mask).sum(-1) / count
    high = (((ratio > 1 + opts.eps_high) & (adv > 0)).float() * mask).sum(-1) / count
    return torch.stack([low, high])  # 0 / 0 = NaN for an empty row, excluded by TRL's nanmin / nanmax


class RAPOGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose policy loss is `rapo_fast.rapo_loss` on the hidden states (see the module docstring).

    Args:
        *args, **kwargs: passed to `trl.GRPOTrainer` unchanged.
        rapo_options: RAPO extras (keys of `RAPO_EXTRA_OPTIONS`), e.g. {"shaping_m": 0.05} for the paper's shaping.
            Per-token extras come from the inputs dict: "retrieved_mask" and "sampling_per_token_logps".
        retrieval_coef: `a` of RAPO's advantage (1 + a * A_ret) * A, applied when the rollout_func
            (rapo_fast.integrations.trl_rollout) returns retrieval rewards; 0 keeps TRL's advantages.
    """

    def __init__(
        self,
        *args: Any,
        rapo_options: Mapping[str, Any] | None = None,
        retrieval_coef: float = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.rapo_options = dict(rapo_options or {})
        self.retrieval_coef = float(retrieval_coef)
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            # rapo_loss recomputes logits from the lm_head weight in backward, outside any ZeRO-3 gather.
            raise ValueError("RAPOGRPOTrainer does not support DeepSpeed ZeRO-3")
        trl_to_rapo_options(self, self.rapo_options)  # fail at construction, not at the first step
        if isinstance(self.rollout_func, RAPORolloutFunc):
            self.rollout_func.bind(self)  # the tokenizer's tags and the sampling options, before any step
            traces = self.rollout_func.traces
            has_cb = any(isinstance(cb, StepTracesCheckpoint) for cb in self.callback_handler.callbacks)
            if traces is not None and not has_cb:
                self.add_callback(StepTracesCheckpoint(traces))  # the buffer saved with, resumed from checkpoints
        target = self.model.get_base_model() if _is_peft(self.model) else self.model
        _install_rapo_forward(target, bool(getattr(self.args, "cast_lm_head_to_fp32", False)))

    def rapo_loss_kwargs(self, inputs: Mapping[str, Any], plan: TRLLossPlan) -> dict[str, Any]:
        """Build the `rapo_loss` keyword arguments (minus the model-dependent hidden/weight) for one batch."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        batch, width = completion_ids.shape
        old = inputs.get("old_per_token_logps")
        opts = plan.loss_options()
        kwargs: dict[str, Any] = dict(
            options=opts,
            targets=completion_ids,
            advantages=inputs["advantages"],
            loss_mask=mask.bool(),
            response_mask=completion_mask.bool(),
            logits_to_keep=width,
        )
        kwargs["old_logp"] = old  # None: the current log-probs, detached (resolved in the model's forward)
        if "retrieved_mask" in inputs and inputs["retrieved_mask"] is not None:
            kwargs["retrieved_mask"] = inputs["retrieved_mask"].bool()
        if opts.beta != 0.0:
            kwargs["ref_logp"] = inputs["ref_per_token_logps"]
        needs_behav = plan.use_tis or opts.offpolicy_train == "truncated"
        if needs_behav:
            behav = inputs.get("sampling_per_token_logps")
            if behav is None:
                raise ValueError("tis_cap / offpolicy_train='truncated' need inputs['sampling_per_token_logps']")
            if old is not None:
                # TRL zeroes the log-ratio where vLLM could not score a token (NaN): weight 1, as with behav = old.
                behav = torch.where(torch.isnan(behav), old, behav)
            kwargs["behav_logp"] = behav
        mode = "train" if self.model.training else "eval"
        if plan.global_num_tokens == "batch_x_max_len":
            kwargs["global_num_tokens"] = batch * self.max_completion_length
        elif plan.global_num_tokens == "batch":
            kwargs["global_num_tokens"] = batch
        elif plan.global_num_tokens == "num_items":
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normaliser = normaliser * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            kwargs["global_num_tokens"] = normaliser
        return kwargs

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's batch, plus the per-token "retrieved_mask" and RAPO's advantage when the rollout_func gave them.

        Why the override: TRL forwards a rollout_func's extra fields to the reward functions only (merged into the
        input rows), not into this batch; attach_rollout_extras moves them here."""
        output = super()._generate_and_score_completions(inputs)
        from rapo_fast.integrations.trl_rollout import attach_rollout_extras

        return attach_rollout_extras(self, inputs, output, self.retrieval_coef)

    def _compute_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
        """TRL's loss hook, computed by `rapo_fast.rapo_loss` on the backbone's hidden states."""
        present = [k for k in _MULTIMODAL_KEYS if inputs.get(k) is not None]
        if present:
            raise ValueError(f"RAPOGRPOTrainer handles text-only inputs; got {present}")
        plan = trl_to_rapo_options(self, self.rapo_options)
        loss_kwargs = self.rapo_loss_kwargs(inputs, plan)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        # Same autocast context as TRL's log-prob pass, so mixed-precision runs see the same backbone numerics.
        with self.accelerator.autocast():
            loss, metrics = model(input_ids=input_ids, attention_mask=attention_mask, rapo_fast_loss=loss_kwargs)
        mode = "train" if self.model.training else "eval"
        if plan.divide_by_grad_accum and mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        self._log_rapo_metrics(mode, metrics)
        return loss

    def _log_rapo_metrics(self, mode: str, metrics: Mapping[str, torch.Tensor]) -> None:
        """Record our metrics under TRL's names where one exists (a mean over processes of per-process values)."""
        names = {
            "clip_frac_low": "clip_ratio/low_mean",
            "clip_frac_high": "clip_ratio/high_mean",
            "kl": "kl",
            "entropy": "entropy",
            "ratio_mean": "rapo/ratio_mean",
            "retrieved_frac": "rapo/retrieved_frac",
        }
        seq_clip = metrics.pop("seq_clip", None)
        if seq_clip is not None:
            from trl.trainer.utils import nanmax, nanmin

            gathered = self.accelerator.gather(seq_clip.float().T.contiguous())  # [B_all, 2]
            self._metrics[mode]["clip_ratio/low_min"].append(nanmin(gathered[:, 0]).item())
            self._metrics[mode]["clip_ratio/high_max"].append(nanmax(gathered[:, 1]).item())
            if self.importance_sampling_level == "sequence":
                # TRL averages one clip flag per sequence there; rapo_loss's fractions count tokens
                metrics["clip_frac_low"], metrics["clip_frac_high"] = gathered.mean(0).unbind()
        for key, value in metrics.items():
            if not torch.is_tensor(value):
                continue
            name = names.get(key, f"rapo/{key}")
            self._metrics[mode][name].append(self.accelerator.gather(value.detach().float().reshape(1)).mean().item())
        if "clip_frac_low" in metrics and "clip_frac_high" in metrics:
            # TRL's region: low- or high-clipped, disjoint (opposite advantage signs) over the same token count
            region = (metrics["clip_frac_low"] + metrics["clip_frac_high"]).detach().float().reshape(1)
            self._metrics[mode]["clip_ratio/region_mean"].append(self.accelerator.gather(region).mean().item())


def _is_peft(model: Any) -> bool:
    from accelerate.utils import is_peft_model

    return bool(is_peft_model(model))
