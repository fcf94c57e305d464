"""TRL adapter: `RAPOGRPOTrainer`, a `trl.GRPOTrainer` whose policy loss goes through `rapo_fast.rapo_loss`.

What it is: a subclass whose `_compute_loss` is one call of the fused hidden-state loss (no [B, T, V] logits), and
`trl_to_rapo_options`, the mapping from TRL's configuration onto one checked `TRLLossPlan` (a LossOptions and TRL's
normaliser), made once when the trainer is built (with retrieval off it reproduces TRL's loss and gradients). The
mapping table, the extras and the rollout hook: docs/trl.md. The TRL path's names: `__all__`.
What it is not: a re-implementation of TRL's generation or rewards; TRL options without an exact counterpart raise
`ValueError` naming the option.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from rapo_fast.loss.options import LossOptions

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - trl is an optional dependency
    raise ImportError(
        'rapo_fast.integrations.trl needs the `trl` extra: pip install -e ".[trl]" in a checkout (rapo-fast[trl])'
    ) from exc

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
    "TRLLossPlan",
    "ForwardLoss",
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
_MULTIMODAL_KEYS = tuple(
    "pixel_values image_grid_thw pixel_attention_mask spatial_shapes image_sizes token_type_ids mm_token_type_ids "
    "image_position_ids".split()
)


@dataclass(frozen=True)
class TRLLossPlan:
    """How one TRL configuration maps onto `rapo_loss`, made and checked once (trl_to_rapo_options): `options`, the
    LossOptions every step passes to rapo_loss (return_metrics on); `normaliser`, TRL's global normaliser resolved per
    batch by `global_num_tokens`: None (rapo_loss's own count), "batch_x_max_len" (dr_grpo), "batch" (grpo: the
    sequence count; luspo: the token-sum normaliser), "num_items" (dapo); `divide_by_grad_accum`: whether TRL divides
    the loss by its gradient-accumulation steps in training mode."""

    options: LossOptions
    normaliser: str | None = None
    divide_by_grad_accum: bool = True

    def global_num_tokens(self, trainer: Any, inputs: Mapping[str, Any]) -> Any:
        """rapo_loss's global_num_tokens for one batch of `trainer`, as TRL normalises that batch."""
        batch = inputs["completion_ids"].shape[0]
        if self.normaliser == "batch_x_max_len":
            return batch * trainer.max_completion_length
        if self.normaliser == "batch":
            return batch
        if self.normaliser != "num_items":
            return None
        items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if trainer.model.training:
            items = items * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        return items


@dataclass(frozen=True)
class ForwardLoss:
    """What the patched model forward's `rapo_fast_loss=` keyword carries: the plan's options and one batch's
    tensors, each under its rapo_loss name (old_logp None: the current log-probs, detached)."""

    options: LossOptions
    targets: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logp: torch.Tensor | None = None
    retrieved_mask: torch.Tensor | None = None
    behav_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    global_num_tokens: Any = None

    def tensors(self) -> dict[str, Any]:
        """rapo_loss's keyword arguments other than the options and the model side."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}


def trl_to_rapo_options(trainer: Any, rapo_options: Mapping[str, Any] | None = None) -> TRLLossPlan:
    """Map a GRPOTrainer's loss configuration (its attributes and `args`) onto one checked TRLLossPlan.

    Reads the trainer attributes TRL's `_compute_loss` reads (loss_type, epsilon_low/high, beta, temperature,
    importance_sampling_level, ...). RAPOGRPOTrainer calls it once, at construction (`trainer.loss_plan`); after
    changing those attributes, assign a new plan. Raises ValueError naming the TRL option when there is no exact
    equivalent, instead of approximating it.
    """
    extras = dict(rapo_options or {})
    unknown = sorted(set(extras) - set(RAPO_EXTRA_OPTIONS))
    if unknown:
        raise ValueError(f"rapo_options: expected keys in {list(RAPO_EXTRA_OPTIONS)}, got unknown option(s) {unknown}")
    options, normaliser, divide = _aggregation(trainer.loss_type)
    options.update(_clip_options(trainer))
    _refuse_unsupported(trainer)
    options.update(_kl_and_entropy_options(trainer, trainer.loss_type))
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
        options["tis_cap"] = _vllm_tis_cap(trainer, extras)
    options["temperature"] = float(trainer.temperature) / _logit_scale(trainer.model)
    plan = TRLLossPlan(LossOptions(**options, **extras, return_metrics=True), normaliser, divide)
    _refuse_without_behaviour_logps(trainer, plan)
    return plan


def _has_behaviour_logps(trainer: Any) -> bool:
    """Whether the batches can carry "sampling_per_token_logps": from vLLM (use_vllm), a rollout_func's "logprobs", or
    a subclass's own `_generate_and_score_completions`; TRL's transformers generation gives none."""
    if getattr(trainer, "use_vllm", False) or getattr(trainer, "rollout_func", None) is not None:
        return True
    own = (GRPOTrainer._generate_and_score_completions, RAPOGRPOTrainer._generate_and_score_completions)
    return type(trainer)._generate_and_score_completions not in own


def _refuse_without_behaviour_logps(trainer: Any, plan: TRLLossPlan) -> None:
    """offpolicy_train="truncated" and tis_cap need the behaviour log-probs: a ValueError now (at construction), not
    a KeyError-like failure at the first step, when the trainer has no way to produce them."""
    truncated = plan.options.offpolicy_train == "truncated"
    if not (truncated or plan.options.tis_cap is not None) or _has_behaviour_logps(trainer):
        return
    what = "offpolicy_train='truncated'" if truncated else "tis_cap"
    raise ValueError(
        f"rapo_options: {what} needs the behaviour log-probs of the sampled tokens (inputs['sampling_per_token_logps']"
        "): expected use_vllm=True, a rollout_func returning 'logprobs' or a subclass overriding "
        "_generate_and_score_completions that adds them, got none of these"
        + (" (offpolicy_train='shaped' needs no behaviour log-probs)" if truncated else "")
    )


def _aggregation(loss_type: str) -> tuple[dict[str, Any], str | None, bool]:
    """(loss_agg option, the global normaliser, the gradient-accumulation division) of TRL's loss_type."""
    if loss_type not in _EXACT_LOSS_TYPES:
        raise ValueError(
            f"loss_type: expected one of {list(_EXACT_LOSS_TYPES)} (the PPO-clip surrogates rapo_fast reproduces "
            f"exactly), got {loss_type!r}"
        )
    token_mean = {"loss_agg": "token-mean"}
    if loss_type == "grpo":
        # TRL averages over all B rows, an all-masked row counting as 0; verl's seq-mean over non-empty rows with the
        # global sequence count B is the same number.
        return {"loss_agg": "seq-mean-token-mean"}, "batch", True
    if loss_type == "dr_grpo":
        return token_mean, "batch_x_max_len", True
    if loss_type == "dapo":
        return token_mean, "num_items", False  # TRL folds the accumulation steps into its num_items normaliser
    # bnpo: the local token count; luspo: (per_token_loss * mask).sum(-1).mean(), a token sum over the row count
    return token_mean, ("batch" if loss_type == "luspo" else None), True


def _clip_options(trainer: Any) -> dict[str, Any]:
    """eps_low / eps_high, TRL's delta as the dual clip, and the importance-sampling level."""
    eps_low, eps_high = float(trainer.epsilon_low), float(trainer.epsilon_high)
    options: dict[str, Any] = dict(eps_low=eps_low, eps_high=eps_high)
    delta = getattr(trainer.args, "delta", None)
    if delta is not None:
        # TRL clamps the unclipped ratio at delta for every token; for A >= 0 the clipped term already wins, for A < 0
        # this is verl's dual clip with c = delta, provided delta exceeds the upper clip bound.
        if not delta > 1.0 + eps_high:
            raise ValueError(f"delta: expected > 1 + epsilon_high = {1 + eps_high} (dual_clip), got {delta}")
        options["dual_clip"] = float(delta)
    options["importance_sampling_level"] = trainer.importance_sampling_level  # checked by LossOptions
    return options


def _kl_and_entropy_options(trainer: Any, loss_type: str) -> dict[str, Any]:
    """beta with the k3 estimator, and a static entropy bonus (bnpo only)."""
    options: dict[str, Any] = {}
    beta = float(trainer.beta)
    if beta != 0.0:
        if getattr(trainer.args, "use_bias_correction_kl", False):
            raise ValueError(
                "use_bias_correction_kl: expected False with beta != 0 (rapo_loss's k3 KL has no importance-ratio "
                "factor), got True"
            )
        # TRL's k3 has no [-10, 10] clamp (verl's has): the adapter reproduces its host.
        options.update(beta=beta, kl_estimator="k3", kl_clamp=False)
    entropy_coef = float(getattr(trainer, "entropy_coef", 0.0) or 0.0)
    if entropy_coef != 0.0:
        if loss_type != "bnpo":
            raise ValueError(
                f"entropy_coef: expected 0 with loss_type={loss_type!r} (TRL normalises its entropy bonus by the local "
                f"token count, which rapo_loss reproduces for loss_type='bnpo' only), got {entropy_coef}"
            )
        options["entropy_coef"] = entropy_coef
    return options


def _refuse_unsupported(trainer: Any) -> None:
    """ValueError for TRL loss features without an exact rapo_loss counterpart."""
    quantile = getattr(trainer, "top_entropy_quantile", 1.0)
    if quantile < 1.0:
        raise ValueError(f"top_entropy_quantile: expected 1.0 (rapo_loss has no entropy token mask), got {quantile}")
    threshold = getattr(trainer, "off_policy_mask_threshold", None)
    if threshold is not None:
        raise ValueError(f"off_policy_mask_threshold: expected None (no sequence mask in rapo_loss), got {threshold}")
    if getattr(trainer, "use_adaptive_entropy", False):
        raise ValueError("use_adaptive_entropy: expected False (a static entropy_coef, bnpo only), got True")
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError("router_aux_loss_coef: expected 0 (no MoE router auxiliary loss in rapo_loss), got nonzero")


def _vllm_tis_cap(trainer: Any, extras: Mapping[str, Any]) -> float:
    """tis_cap of TRL's vLLM importance-sampling correction (mode "token_truncate" without clip_min only)."""
    mode = trainer.vllm_importance_sampling_mode
    clip_min = trainer.vllm_importance_sampling_clip_min
    if mode != "token_truncate" or clip_min not in (None, 0, 0.0):
        raise ValueError(
            "vllm_importance_sampling_mode: expected 'token_truncate' without clip_min (truncated IS, "
            f"min(exp(old - behav), clip_max)), got {mode!r} with clip_min={clip_min}"
        )
    if "tis_cap" in extras:
        raise ValueError("rapo_options: expected no tis_cap while TRL's vLLM importance sampling is on, got one")
    cap = trainer.vllm_importance_sampling_clip_max
    if cap is None:
        raise ValueError("vllm_importance_sampling_clip_max: expected a cap (truncated IS), got None")
    return float(cap)


def _logit_scale(model: Any) -> float:
    """The logit multiplier TRL's fused head applies before the temperature (folded into our temperature)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if (cap := getattr(cfg, "final_logit_softcapping", None)) is not None:
        raise ValueError(f"final_logit_softcapping: expected None (rapo_loss's hidden-state path), got {cap}")
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
        raise ValueError(f"logit scale: expected > 0 (folded into the temperature), got {scale}")
    return scale


def _install_rapo_forward(model: torch.nn.Module, cast_lm_head_to_fp32: bool) -> None:
    """Give `model.forward` a `rapo_fast_loss=` keyword (a ForwardLoss) that runs the backbone and the fused loss inside
    forward.

    Running inside the (possibly DDP/FSDP-wrapped) model's forward keeps the wrappers' hooks armed, the same reason
    TRL's own fused head is a forward keyword. Without the keyword the previous forward runs unchanged.
    """
    if getattr(model, "_rapo_fast_forward_installed", False):
        return
    previous_forward = model.forward

    def _forward(self, *args, rapo_fast_loss: ForwardLoss | None = None, **kwargs):
        if rapo_fast_loss is None:
            return previous_forward(*args, **kwargs)
        import rapo_fast

        call = rapo_fast_loss
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        # Completion token j is predicted by the hidden state one position earlier.
        hidden = hidden[:, -call.targets.shape[1] - 1 : -1]
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
            given_old = call.old_logp is not None
            if not given_old:
                # TRL skips the old log-probs when they equal the current ones (one iteration per generation) and
                # uses logp.detach(); a no-grad chunked pass gives the same values without holding [N, V].
                with torch.no_grad():
                    old = rapo_fast.token_logprobs(
                        hidden=hidden,
                        weight=weight,
                        bias=bias,
                        targets=call.targets,
                        temperature=call.options.temperature,
                    )
                call = replace(call, old_logp=old)
            loss, metrics = rapo_fast.rapo_loss(
                hidden=hidden, weight=weight, bias=bias, options=call.options, **call.tensors()
            )
            seq_clip = _sequence_clip_fractions(metrics.token_logp, call, given_old)
            return loss, {**metrics.scalars(), "seq_clip": seq_clip}

    model.forward = types.MethodType(_forward, model)
    model._rapo_fast_forward_installed = True


@torch.no_grad()
def _sequence_clip_fractions(logp: torch.Tensor, call: ForwardLoss, given_old: bool) -> torch.Tensor:
    """[2, B]: each row's fraction of low- / high-clipped tokens as TRL defines them (ratio below 1 - eps_low with
    A < 0 / above 1 + eps_high with A > 0, the unshaped ratio, per token or per sequence), NaN for a row without
    tokens in the loss: what TRL's clip_ratio/low_min and high_max reduce. `logp`: the log-probs the loss used
    (rapo_loss's metrics.token_logp), so no log-prob pass of its own; without given old log-probs the ratio is 1."""
    opts = call.options
    mask = call.loss_mask.bool()
    if call.retrieved_mask is not None:
        mask = mask & ~call.retrieved_mask
    mask = mask.float()
    if given_old:
        logp = logp.float()
        log_ratio = torch.where(mask > 0, logp - call.old_logp.float(), torch.zeros_like(logp))
    else:
        log_ratio = torch.zeros_like(mask)
    adv = call.advantages.float()
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
        from accelerate.utils import is_peft_model
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            # rapo_loss recomputes logits from the lm_head weight in backward, outside any ZeRO-3 gather.
            raise ValueError("deepspeed: expected no ZeRO-3 (rapo_loss reads the lm_head weight in backward), got it")
        self.loss_plan = trl_to_rapo_options(self, self.rapo_options)  # once: checked here, not at every step
        if isinstance(self.rollout_func, RAPORolloutFunc):
            self.rollout_func.bind(self)  # the tokenizer's tags and the sampling options, before any step
            traces = self.rollout_func.traces
            has_cb = any(isinstance(cb, StepTracesCheckpoint) for cb in self.callback_handler.callbacks)
            if traces is not None and not has_cb:
                self.add_callback(StepTracesCheckpoint(traces))  # the buffer saved with, resumed from checkpoints
        target = self.model.get_base_model() if is_peft_model(self.model) else self.model
        _install_rapo_forward(target, bool(getattr(self.args, "cast_lm_head_to_fp32", False)))

    def forward_loss(self, inputs: Mapping[str, Any]) -> ForwardLoss:
        """The plan's options and one batch's tensors, as the patched forward takes them."""
        plan = self.loss_plan
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        retrieved = inputs.get("retrieved_mask")
        behav = None  # rapo_loss refuses None (naming behav_logp) where tis_cap or offpolicy_train='truncated' need it
        if plan.options.tis_cap is not None or plan.options.offpolicy_train == "truncated":
            behav = inputs.get("sampling_per_token_logps")
            if behav is not None and old is not None:
                # TRL zeroes the log-ratio where vLLM could not score a token (NaN): weight 1, as with behav = old.
                behav = torch.where(torch.isnan(behav), old, behav)
        return ForwardLoss(
            options=plan.options,
            targets=completion_ids,
            advantages=inputs["advantages"],
            loss_mask=mask.bool(),
            response_mask=completion_mask.bool(),
            old_logp=old,
            retrieved_mask=None if retrieved is None else retrieved.bool(),
            behav_logp=behav,
            ref_logp=inputs["ref_per_token_logps"] if plan.options.beta != 0.0 else None,
            global_num_tokens=plan.global_num_tokens(self, inputs),
        )

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
            raise ValueError(f"inputs: expected text-only inputs, got multimodal fields {present}")
        call = self.forward_loss(inputs)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        # Same autocast context as TRL's log-prob pass, so mixed-precision runs see the same backbone numerics.
        with self.accelerator.autocast():
            loss, metrics = model(input_ids=input_ids, attention_mask=attention_mask, rapo_fast_loss=call)
        mode = "train" if self.model.training else "eval"
        if self.loss_plan.divide_by_grad_accum and mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        self._log_rapo_metrics(mode, metrics)
        return loss

    def _log_rapo_metrics(self, mode: str, metrics: Mapping[str, torch.Tensor]) -> None:
        """Record our metrics under TRL's names where one exists (a mean over processes of per-process values)."""
        names = {"clip_frac_low": "clip_ratio/low_mean", "clip_frac_high": "clip_ratio/high_mean"}
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
            name = key if key in ("kl", "entropy") else names.get(key, f"rapo/{key}")
            self._metrics[mode][name].append(self.accelerator.gather(value.detach().float().reshape(1)).mean().item())
        if "clip_frac_low" in metrics and "clip_frac_high" in metrics:
            # TRL's region: low- or high-clipped, disjoint (opposite advantage signs) over the same token count
            region = (metrics["clip_frac_low"] + metrics["clip_frac_high"]).detach().float().reshape(1)
            self._metrics[mode]["clip_ratio/region_mean"].append(self.accelerator.gather(region).mean().item())
