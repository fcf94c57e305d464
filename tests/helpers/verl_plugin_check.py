"""A pytest plugin (`-p helpers.verl_plugin_check`) for running verl's own tests with rapo_fast's verl plugin loaded.

At session start it imports verl (which loads the `verl.plugins` entry points) and fails the session unless rapo_fast's
agent loop, policy loss and advantage estimator are in verl's registries; at the end it prints a marker line that
tests/integrations/verl_plugin/test_verl_plugin.py looks for. Not a test module; used only by that test.
"""

from __future__ import annotations

import pytest

MARKER = "rapo_fast verl plugin loaded:"


def registered_names() -> dict[str, bool]:
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo import core_algos

    return {
        "agent_loop rapo_tool_agent": "rapo_tool_agent" in _agent_loop_registry,
        "policy_loss rapo": "rapo" in core_algos.POLICY_LOSS_REGISTRY,
        "adv_estimator rapo": "rapo" in core_algos.ADV_ESTIMATOR_REGISTRY,
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    names = registered_names()
    if not all(names.values()):
        raise pytest.UsageError(f"rapo_fast's verl plugin did not register: {names}")


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"{MARKER} {sorted(registered_names())}")
