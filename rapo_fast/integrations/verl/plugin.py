"""The `verl.plugins` entry point: importing this module checks verl's version, then registers rapo_fast's parts.

What it is: the target of `[project.entry-points."verl.plugins"] rapo_fast` (pyproject.toml), loaded by `import verl`
in every process; what it registers: docs/verl.md section 1. Why the warning below: verl logs a plugin's failure at
DEBUG level only, so a failed registration would otherwise surface as "unknown agent loop rapo_tool_agent" much later,
on a remote worker.
What it is not: the parts themselves; not importable without verl. The one module of rapo_fast that registers at
import time.
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
    from rapo_fast.integrations.verl import (
        actor_loss,
        advantage,
        agent_loop,
        buffer_actor,
        buffer_growth,
        metrics,
        trl_clash,
    )

    parts = (
        ("actor_loss", actor_loss),
        ("advantage", advantage),
        ("agent_loop", agent_loop),
        ("buffer_actor", buffer_actor),
        ("buffer_growth", buffer_growth),
        ("metrics", metrics),
        ("trl_clash", trl_clash),
    )
    for _, module in parts:
        module.register()
    return tuple(name for name, _ in parts)


try:
    REGISTERED = register()
except Exception:  # verl swallows this at DEBUG level: say it loudly, then let verl see it too
    _log.warning("rapo_fast: registering the verl plugin failed", exc_info=True)
    raise
