"""verl 0.9.1's FSDP actor and trl >= 1.16 in one environment (`rapo-fast[verl,trl]`, and the `test` extra).

The clash: verl's `apply_monkey_patch` (verl/models/transformers/monkey_patch.py), run by the FSDP engine's
`init_model` on every model, patches `state_dict` of trl's `AutoModelForCausalLMWithValueHead` whenever trl is
importable (verl's `is_trl_available`). trl 1.16 has no such class (verl's own `fsdp` extra pins trl 0.27), so the
import raised and no actor built. The mend (`register()`, run by plugin.py in every verl process): that module's name
`is_trl_available` becomes "trl is there and has the class", so verl skips the patch of a class that does not exist.
Nothing else in verl changes (its value-head loader for critics keeps verl's check; RAPO has no critic). The check
runs when verl calls it, so loading the plugin imports no trl. docs/verl.md section 1.
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
