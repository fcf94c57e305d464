"""verl 0.9.1's FSDP actor and trl >= 1.16 in one environment (`rapo-fast[verl,trl]`, and the `test` extra).

What it is: `register()` (run by plugin.py in every verl process) makes verl's monkey_patch module's
`is_trl_available` mean "trl is there and has AutoModelForCausalLMWithValueHead", so verl skips patching a class trl
1.16 no longer has. Why and what else is untouched: docs/verl.md section 1. The check runs when verl calls it, so
loading the plugin imports no trl.
What it is not: a change to trl or to rapo_fast's TRL adapter (rapo_fast/integrations/trl.py, which needs trl 1.16).
"""

from __future__ import annotations

import functools
import warnings

from rapo_fast.integrations.verl import verl_compat

__all__ = ["VALUE_HEAD", "trl_has_value_head", "register"]

TARGET = "verl.models.transformers.monkey_patch:is_trl_available"
VALUE_HEAD = "AutoModelForCausalLMWithValueHead"


@functools.cache
def trl_has_value_head() -> bool:
    """Whether trl is installed and has the value-head class verl's monkey patch imports (where verl looks: trl, then
    trl.experimental.ppo)."""
    with warnings.catch_warnings():  # trl warns on any import of trl.experimental: this is only a probe
        warnings.simplefilter("ignore")
        try:
            import trl
        except Exception:  # not installed, or broken: verl's patch could not import the class either
            return False
        if hasattr(trl, VALUE_HEAD):
            return True
        try:
            from trl.experimental import ppo
        except ImportError:
            return False
        return hasattr(ppo, VALUE_HEAD)


def _is_trl_available_with_value_head() -> bool:
    """verl's is_trl_available as its monkey patch means it: trl is there and has the class it patches."""
    return trl_has_value_head()


def register() -> None:
    """Installs the check into verl's monkey-patch module (idempotent)."""
    verl_compat.replace(TARGET, _is_trl_available_with_value_head)
