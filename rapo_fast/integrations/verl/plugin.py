"""The `verl.plugins` entry point: importing this module registers rapo_fast's parts into verl.

What it is: the target of `[project.entry-points."verl.plugins"] rapo_fast` (pyproject.toml). `import verl` loads that
entry-point group in every process that imports verl (the driver and every Ray worker: the agent-loop workers, the
actor), so what is registered here exists wherever verl looks it up: the agent loop "rapo_tool_agent"
(agent_loop.py), the policy losses "rapo" and "rapo_no_dual_clip" with verl's worker loss wrapped so that the
retrieval fields reach them (actor_loss.py), and the advantage estimator "rapo" (advantage.py); the step buffer
(buffer_actor.py) is an actor and a checkpoint callback, nothing to register; the reward manager "rapo" that grows
the buffer from the job's successful steps (buffer_growth.py). `VERL_USE_EXTERNAL_PLUGINS=none`
turns verl's discovery off; `VERL_USE_EXTERNAL_MODULES=rapo_fast.integrations.verl.plugin` loads it explicitly.
It is the one module of rapo_fast that registers at import time (an entry point is loaded by importing it).
What it is not: the parts themselves, and not importable without verl (it imports verl's registries).

Why the warning below: verl loads plugins inside a `try` that logs failures at DEBUG level only, so a plugin that
failed to register would otherwise look like "unknown agent loop rapo_tool_agent" much later, on a remote worker.
"""

from __future__ import annotations

import logging

__all__ = ["register", "REGISTERED"]

_log = logging.getLogger(__name__)


def register() -> tuple[str, ...]:
    """Register every part into verl (idempotent); returns the names of the parts registered."""
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
