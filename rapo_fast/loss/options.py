"""Argument checks of rapo_loss / policy_loss_from_logp and the option vocabularies they accept.

What this is: the validation that runs before any kernel (it may sync with the device once: target range, NaN in
advantages, cu_seqlens), returning the facts the launcher needs. What it is not: the loss math
(rapo_fast/loss/policy_loss.py,
kernels/loss/policy_loss.py) or generic checks (rapo_fast/_checks.py, which this module uses).
"""

from __future__ import annotations

from typing import Any

import torch

from rapo_fast import _checks as C

OFFPOLICY_MODES = ("none", "shaped", "truncated")
IS_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# keyword options of rapo_loss (everything but the tensors); RAPOLoss and the presets use these names
OPTION_DEFAULTS: dict[str, Any] = dict(
    shaping_m=0.0, offpolicy_train="none", gamma=0.1, is_cap=2.0, tis_cap=None, eps_low=0.2, eps_high=0.2,
    dual_clip=None, importance_sampling_level="token", beta=0.0, kl_estimator="k3", entropy_coef=0.0,
    temperature=1.0, loss_agg="token-mean", return_metrics=False,
)


def _validate_model_inputs(a: dict) -> tuple[torch.Tensor, tuple, int]:
    """rapo_loss's logits / hidden + weight + bias / targets checks; returns (targets, targets' shape, V)."""
    logits, hidden, weight, bias = a["logits"], a["hidden"], a["weight"], a["bias"]
    if (logits is None) == (hidden is None):
        raise ValueError("logits/hidden: pass exactly one of logits [..., V] or hidden [..., H] (+ weight [V, H]), "
                         f"got {'both' if logits is not None else 'neither'}")
    targets = C.check_tensor("targets", a["targets"], ndim=(1, 2), dtypes=C.INT_DTYPES)
    tshape = tuple(targets.shape)
    if logits is not None:
        C.check_tensor("logits", logits, dtypes=C.FLOAT_DTYPES)
        if logits.dim() != targets.dim() + 1 or tuple(logits.shape[:-1]) != tshape:
            raise ValueError(f"logits: expected shape {tshape + ('V',)} (targets' shape + vocab), got "
                             f"{tuple(logits.shape)}")
        vocab = logits.shape[-1]
        if weight is not None or bias is not None:
            raise ValueError("weight/bias: only with hidden=, not with logits")
    else:
        C.check_tensor("hidden", hidden, dtypes=C.FLOAT_DTYPES)
        if hidden.dim() != targets.dim() + 1 or tuple(hidden.shape[:-1]) != tshape:
            raise ValueError(f"hidden: expected shape {tshape + ('H',)} (targets' shape + hidden), got "
                             f"{tuple(hidden.shape)}")
        if weight is None:
            raise ValueError("weight: required with hidden= (the lm_head weight [V, H])")
        C.check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,))
        if weight.shape[1] != hidden.shape[-1]:
            raise ValueError(f"weight: expected shape (V, {hidden.shape[-1]}), got {tuple(weight.shape)}")
        vocab = weight.shape[0]
        C.check_optional_tensor("bias", bias, shape=(vocab,), dtypes=(hidden.dtype,))
    if vocab < 1:
        raise ValueError("logits/weight: vocabulary size must be >= 1")
    return targets, tshape, vocab


def _validate(a: dict) -> dict:
    """Check every argument of rapo_loss; return facts the launcher needs (rows, segment count, K)."""
    for k, choices in (("offpolicy_train", OFFPOLICY_MODES), ("importance_sampling_level", IS_LEVELS),
                       ("kl_estimator", KL_ESTIMATORS), ("loss_agg", LOSS_AGG_MODES)):
        C.check_choice(k, a[k], choices)
    C.check_float("shaping_m", a["shaping_m"], min_value=-1.0, min_inclusive=False)
    C.check_float("gamma", a["gamma"], min_value=0.0, min_inclusive=False)
    C.check_float("is_cap", a["is_cap"], min_value=0.0, min_inclusive=False)
    C.check_float("tis_cap", a["tis_cap"], min_value=0.0, min_inclusive=False, allow_none=True)
    C.check_float("eps_low", a["eps_low"], min_value=0.0, max_value=1.0)
    C.check_float("eps_high", a["eps_high"], min_value=0.0)
    C.check_float("dual_clip", a["dual_clip"], min_value=1.0, min_inclusive=False, allow_none=True)
    C.check_float("beta", a["beta"])
    C.check_float("entropy_coef", a["entropy_coef"])
    C.check_float("temperature", a.get("temperature", 1.0), min_value=0.0, min_inclusive=False)
    if not isinstance(a["return_metrics"], bool):
        raise TypeError(f"return_metrics: expected bool, got {type(a['return_metrics']).__name__}")

    if "logp" in a:  # policy_loss_from_logp: log-probs (and entropy) given, no logits/hidden/targets
        logp = C.check_tensor("logp", a["logp"], ndim=(1, 2), dtypes=C.FLOAT_DTYPES)
        tshape = tuple(logp.shape)
        C.check_optional_tensor("entropy", a["entropy"], shape=tshape, dtypes=C.FLOAT_DTYPES)
        if a["entropy_coef"] != 0.0 and a["entropy"] is None:
            raise ValueError(f"entropy: required when entropy_coef != 0 (entropy_coef={a['entropy_coef']})")
        targets = logits = hidden = weight = bias = None
        vocab = None
    else:
        targets, tshape, vocab = _validate_model_inputs(a)
        logits, hidden, weight, bias = a["logits"], a["hidden"], a["weight"], a["bias"]
    for k in ("old_logp", "behav_logp", "ref_logp"):
        C.check_optional_tensor(k, a[k], shape=tshape, dtypes=C.FLOAT_DTYPES)
    for k in ("loss_mask", "retrieved_mask", "response_mask"):
        C.check_optional_tensor(k, a[k], shape=tshape, dtypes=C.MASK_DTYPES)
    if a["old_logp"] is None or a["loss_mask"] is None:
        raise ValueError("old_logp/loss_mask: required")
    cu = a["cu_seqlens"]
    flat = len(tshape) == 1
    max_len = tshape[-1]
    if cu is not None:
        if not flat:
            raise ValueError(f"cu_seqlens: only for flat inputs (targets / logp [N]); got shape {tshape}")
        rows = C.check_cu_seqlens("cu_seqlens", cu, tshape[0])
        max_len = int(cu.detach().cpu().diff().max())
    else:
        rows = 1 if flat else tshape[0]
    adv = C.check_tensor("advantages", a["advantages"], dtypes=C.FLOAT_DTYPES)
    if tuple(adv.shape) not in (tshape, (rows,)):
        raise ValueError(f"advantages: expected shape {tshape} (per token) or ({rows},) (per sequence), got "
                         f"{tuple(adv.shape)}")
    dev = C.check_same_device(logp=a.get("logp"), entropy=a.get("entropy"), targets=targets, logits=logits,
                              hidden=hidden, weight=weight, bias=bias, old_logp=a["old_logp"], advantages=adv,
                              loss_mask=a["loss_mask"], retrieved_mask=a["retrieved_mask"],
                              response_mask=a["response_mask"], behav_logp=a["behav_logp"], ref_logp=a["ref_logp"],
                              cu_seqlens=cu)
    if targets is not None:
        C.check_index_range("targets", targets, vocab)
    C.check_finite("advantages", adv)
    C.check_finite("old_logp", a["old_logp"], allow_inf=True)
    if a["offpolicy_train"] == "truncated" and a["behav_logp"] is None:
        raise ValueError("behav_logp: required when offpolicy_train='truncated' (the behaviour log-probs of the "
                         "retrieved tokens)")
    if a["tis_cap"] is not None and a["behav_logp"] is None:
        raise ValueError("behav_logp: required when tis_cap is set (truncated importance sampling)")
    if a["beta"] != 0.0 and a["ref_logp"] is None:
        raise ValueError(f"ref_logp: required when beta != 0 (beta={a['beta']})")
    for k in ("behav_logp", "ref_logp"):
        if a[k] is not None:
            C.check_finite(k, a[k], allow_inf=True)
    g = a["global_num_tokens"]
    if g is not None:
        if isinstance(g, torch.Tensor):
            if g.numel() != 1 or g.dtype == torch.bool:
                raise ValueError(f"global_num_tokens: expected a number or a 1-element numeric tensor, got shape "
                                 f"{tuple(g.shape)} dtype {g.dtype}")
            if g.device != dev and g.device.type != "cpu":
                raise ValueError(f"global_num_tokens: expected device {dev} or cpu, got {g.device}")
        else:
            C.check_float("global_num_tokens", g, min_value=0.0, min_inclusive=False)
    return dict(flat=flat, rows=rows, max_len=max(max_len, 1), device=dev, shape=tshape)
