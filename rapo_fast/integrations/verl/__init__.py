"""rapo_fast inside verl: the verl plugin (agent loop, policy loss, advantage estimator, Ray-served step buffer) and
the adapter functions a verl actor calls.

Importing this package imports neither verl nor ray; the plugin does. Deliberate difference from the other
subpackages (which re-export nothing): this __init__ re-exports the adapter's public names, so that
`rapo_fast.integrations.verl.rapo_policy_loss` (the module path before this became a package) keeps working.
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
