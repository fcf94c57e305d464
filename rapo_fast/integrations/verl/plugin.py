"""The `verl.plugins` entry point: importing this module checks verl's version, then registers rapo_fast's parts.

What it is: the target of `[project.entry-points."verl.plugins"] rapo_fast` (pyproject.toml), loaded by `import verl`
in every process (the driver and every Ray worker). First verl_compat's version gate: a verl outside its supported
range fails the load (RAPO_FAST_VERL_UNCHECKED=1 overrides). Then it registers the agent loop "rapo_tool_agent"
(agent_loop.py), the policy losses "rapo" / "rapo_no_dual_clip" with verl's worker loss wrapped so the retrieval
fields reach them (actor_loss.py), the advantage estimator "rapo" (advantage.py) and the reward manager "rapo" that
grows the buffer (buffer_growth.py); the step buffer (buffer_actor.py) needs no registration.
`VERL_USE_EXTERNAL_PLUGINS=none` turns verl's discovery off; `VERL_USE_EXTERNAL_MODULES=` this module loads it.
What it is not: the parts themselves; not importable without verl. The one module of rapo_fast that registers at
import time. Why the warning below: verl logs a plugin's failure at DEBUG level only, so a failed registration would
otherwise surface as "unknown agent loop rapo_tool_agent" much later, on a remote worker.
"""

from __future__ import annotations

import logging

__all__ = ["register", "REGISTERED"]

_log = logging.getLogger(__name__)


def register() -> tuple[str, ...]:
    """Check the installed verl's version (verl_compat.check_version: RuntimeError outside its supported range), then
    register every part into verl (idempotent); returns the names of the parts registered."""
    from rapo_fast.integrations.verl import verl_compat

    verl_compat.check_version()
    from rapo_fast.integrations.verl import actor_loss, advantage, agent_loop, buffer_actor, buffer_growth

    parts = (("actor_loss", actor_loss), ("advantage", advantage), ("agent_loop", agent_loop),
             ("buffer_actor", buffer_actor), ("buffer_growth", buffer_growth))  # fmt: skip
    for _, module in parts:
        module.register()
    return tuple(name for name, _ in parts)


try:
    REGISTERED = register()
except Exception:  # verl swallows this at DEBUG level: say it loudly, then let verl see it too
    _log.warning("rapo_fast: registering the verl plugin failed", exc_info=True)
    raise
