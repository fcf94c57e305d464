"""rapo_fast inside verl: the verl plugin (agent loop, policy loss, advantage estimator, Ray-served step buffer) and
the adapter functions a verl actor calls.

Modules: policy_loss (the registry-signature RAPO loss), logprobs (verl's fused log-prob contract on rapo_fast's
kernels), plugin (the `verl.plugins` entry point that registers everything into verl), verl_compat (every verl internal
the plugin touches, and the version gate). Importing this package imports neither verl nor ray; the plugin does.
Deliberate difference from the other subpackages (which re-export nothing): this __init__ re-exports the adapter's
public names, so that `rapo_fast.integrations.verl.rapo_policy_loss` (the module path before this became a package)
keeps working.
"""

from rapo_fast.integrations.verl.logprobs import RAPOFusedLinearForPPO, fused_logprobs_from_hidden, logprobs_from_logits
from rapo_fast.integrations.verl.policy_loss import rapo_policy_loss, register_rapo_policy_loss, verl_normaliser

__all__ = [
    "rapo_policy_loss",
    "register_rapo_policy_loss",
    "verl_normaliser",
    "fused_logprobs_from_hidden",
    "logprobs_from_logits",
    "RAPOFusedLinearForPPO",
]
