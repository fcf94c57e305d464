"""The contract between the policy-loss kernels and their launchers, named once: the per-token code, the rows of the
stacked per-token inputs, the layout of the metric partial sums, and the vocabularies of the options the kernels
take by index (rapo_fast/loss/options.py's KernelArg encodes a choice as its index here).

Plain Python, importable without Triton: the kernels and rapo_fast/loss both import it, so no kernel imports from
rapo_fast/loss. What this is not: the math (docs/loss.md section 3) or the public metric names (policy_loss.py turns
these sums into them, docs/loss.md section 5).
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "OFFPOLICY_MODES",
    "KL_ESTIMATORS",
    "TokenCode",
    "TokenInput",
    "REQUIRED_INPUTS",
    "NUM_INPUTS",
    "Metric",
    "NUM_METRICS",
]

# LossOptions.offpolicy_train and .kl_estimator: the kernels compare each with its index in these tuples
OFFPOLICY_MODES = ("none", "shaped", "truncated")
KL_ESTIMATORS = ("k1", "k2", "k3")


class TokenCode(IntEnum):
    """Class of one token (an int8 per token)."""

    SKIP = 0  # not in the loss
    ON = 1  # on-policy token in the loss
    OFF = 2  # retrieved token trained off-policy (offpolicy_train != "none")


class TokenInput(IntEnum):
    """Rows of the op's stacked per-token inputs [len(TokenInput), N] (policy_op.stack_token_inputs), in the compute
    dtype. The presence mask has bit `1 << row` set for each row given; the optional rows are read only then."""

    OLD = 0  # old_logp
    ADV = 1  # advantage
    W = 2  # aggregation weight
    SCALE = 3  # importance-shaping scale 1 + m F_s
    CODE = 4  # TokenCode, as a number
    SEQLR = 5  # GSPO sequence log-ratio (optional: importance_sampling_level="sequence")
    BEHAV = 6  # behaviour log-prob (optional: tis_cap, offpolicy_train="truncated")
    REF = 7  # reference log-prob (optional: its KL term and metric)


REQUIRED_INPUTS = (TokenInput.OLD, TokenInput.ADV, TokenInput.W, TokenInput.SCALE, TokenInput.CODE)
NUM_INPUTS = len(TokenInput)


class Metric(IntEnum):
    """Columns of the metric partial sums: each is a sum over the tokens of one class (on, off, active = on | off)."""

    N_ON = 0  # count of on-policy tokens
    N_OFF = 1  # count of off-policy (retrieved, trained) tokens
    N_ACTIVE = 2  # count of tokens in the loss
    CLIP_HIGH = 3  # on: clipped at 1 + eps_high
    CLIP_LOW = 4  # on: clipped at 1 - eps_low
    DUAL_CLIP = 5  # on: dual-clipped
    RATIO = 6  # on: importance ratio r
    APPROX_KL = 7  # on: old_logp - logp
    KL = 8  # active: KL_k(logp, ref_logp)
    ENTROPY = 9  # active: entropy H
    TIS_WEIGHT = 10  # on: truncated IS weight
    OFFPOLICY_WEIGHT = 11  # off: off-policy weight


NUM_METRICS = len(Metric)
