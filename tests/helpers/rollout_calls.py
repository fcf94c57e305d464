"""rollout() with its settings given as the former flat keywords (group_size=..., n_hybrid=..., arpo_beam=...), for
tests whose subject is not the configuration: the keywords become a RolloutConfig (RolloutConfig.from_legacy) and
rollout() gets it as cfg, so these tests run the current API and raise no DeprecationWarning. The keyword shim itself
is tested in tests/rollouts/test_rollout_config.py. Not a library API.
"""

from __future__ import annotations

from rapo_fast.rollouts.config import RolloutConfig
from rapo_fast.rollouts.loop import rollout

_RESOURCES = ("traces", "offpolicy", "generator", "seed")


def rollout_flat(model, tokenizer, env, problems, **kw):
    """rollout(model, tokenizer, env, problems, RolloutConfig.from_legacy(settings), **resources)."""
    resources = {k: kw.pop(k) for k in _RESOURCES if k in kw}
    try:
        cfg = RolloutConfig.from_legacy(kw)
    except TypeError as e:  # as rollout()'s shim: a wrong-typed setting is a ValueError
        raise ValueError(str(e)) from None
    return rollout(model, tokenizer, env, problems, cfg, **resources)
