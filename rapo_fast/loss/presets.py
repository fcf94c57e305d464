"""Named loss configurations for rapo_fast.rapo_loss / RAPOLoss: `rapo_fast.loss.presets` is this module.

Each preset is a dict of rapo_loss keyword options, checked by LossOptions at import, stating its clip, KL and
aggregation choices in full so that it reads as a whole configuration. Use as `rapo_loss(..., **presets.RAPO)` or
`RAPOLoss(preset="RAPO", eps_high=0.3)`; treat the dicts as constants (`get(name)` returns a fresh copy).
What this is not: advantage estimation or rollout settings (group size, ARPO's branching), which live with the trainer.
"""

from __future__ import annotations

from typing import Any

from rapo_fast.loss.options import LossOptions

__all__ = ["GRPO", "DAPO", "DR_GRPO", "GSPO", "RAPO", "ARPO", "PRESETS", "get"]


def _preset(**options: Any) -> dict[str, Any]:
    """A preset's options, checked by LossOptions now (a misspelt option or a bad value fails at import)."""
    LossOptions(**options)
    return options


# DeepSeekMath GRPO: symmetric clip 0.2, k3 KL to the reference with beta 0.04 (needs ref_logp), per-sequence token
# mean then mean over sequences.
GRPO = _preset(
    eps_low=0.2,
    eps_high=0.2,
    beta=0.04,
    kl_estimator="k3",
    loss_agg="seq-mean-token-mean",
    importance_sampling_level="token",
)

# DAPO (arXiv 2503.14476): clip-higher (0.2 / 0.28), no KL, token-level mean over the whole batch.
DAPO = _preset(
    eps_low=0.2,
    eps_high=0.28,
    beta=0.0,
    loss_agg="token-mean",
    importance_sampling_level="token",
)

# Dr. GRPO (arXiv 2503.20783): no length normalisation: token sums divided by a constant (verl's
# seq-mean-token-sum-norm, the constant being the padded length T unless global_num_tokens gives one), no KL.
DR_GRPO = _preset(
    eps_low=0.2,
    eps_high=0.2,
    beta=0.0,
    loss_agg="seq-mean-token-sum-norm",
    importance_sampling_level="token",
)

# GSPO (arXiv 2507.18071): sequence-level ratio (GSPO-token form), clip 3e-4 / 4e-4, seq-mean-token-mean, no KL.
GSPO = _preset(
    eps_low=3e-4,
    eps_high=4e-4,
    beta=0.0,
    loss_agg="seq-mean-token-mean",
    importance_sampling_level="sequence",
)

# RAPO (arXiv 2603.03078), the paper's defaults: importance shaping m = 0.05, clip 0.28 both sides, no KL,
# seq-mean-token-mean, retrieved tokens excluded from the loss.
RAPO = _preset(
    shaping_m=0.05,
    eps_low=0.28,
    eps_high=0.28,
    beta=0.0,
    loss_agg="seq-mean-token-mean",
    offpolicy_train="none",
    importance_sampling_level="token",
)

# ARPO (arXiv 2507.19849): its release trains with verl's GRPO defaults: clip 0.2, verl's dual clip c = 3, KL
# coefficient 0, token-mean. ARPO's own parts (entropy-adaptive branching, soft advantage attribution = plain GRPO
# advantages) live in the rollout, not in the loss.
ARPO = _preset(
    eps_low=0.2,
    eps_high=0.2,
    dual_clip=3.0,
    beta=0.0,
    loss_agg="token-mean",
    importance_sampling_level="token",
)

PRESETS: dict[str, dict[str, Any]] = {
    "GRPO": GRPO,
    "DAPO": DAPO,
    "DR_GRPO": DR_GRPO,
    "GSPO": GSPO,
    "RAPO": RAPO,
    "ARPO": ARPO,
}
_ALIASES = {"DR.GRPO": "DR_GRPO", "DRGRPO": "DR_GRPO", "DR-GRPO": "DR_GRPO"}


def get(preset: str | dict) -> dict[str, Any]:
    """A fresh dict of the options of `preset` (a name, case-insensitive, or a dict of options, copied)."""
    if isinstance(preset, dict):
        return dict(preset)
    if not isinstance(preset, str):
        raise TypeError(f"preset: expected a name in {list(PRESETS)} or a dict, got {type(preset).__name__}")
    key = preset.upper()
    key = _ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"preset: expected one of {list(PRESETS)}, got {preset!r}")
    return dict(PRESETS[key])
