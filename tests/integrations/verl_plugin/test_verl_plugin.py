"""rapo_fast's verl plugin loads through the `verl.plugins` entry point (in a fresh interpreter, as a Ray worker would
import verl), registers its agent loop, policy loss and advantage estimator, and leaves verl's own CPU agent-loop tests
passing while loaded.

verl's own tests are not in its wheel: .ci/run downloads verl's sdist and points VERL_TESTS_DIR at its tests/ folder;
without it that test is skipped (the reason says so). Not here: the parts' behaviour (test_verl_loss.py,
test_verl_advantage.py, test_verl_agent_loop.py, test_verl_buffer_actor.py) or the recipe (test_verl_recipe.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")

TESTS = Path(__file__).resolve().parents[2]  # tests/: `helpers` is importable from it


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(TESTS), **env},
    )


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("rapo_fast") == "rapo_fast.integrations.verl.plugin", eps


def test_import_verl_registers_every_part():
    """A fresh interpreter that only imports verl (as every Ray worker does) finds rapo_fast's parts registered."""
    out = _python("from helpers.verl_plugin_check import registered_names; print(registered_names())")
    assert out.returncode == 0, out.stderr[-4000:]
    names = eval(out.stdout.strip().splitlines()[-1])  # a dict literal printed by the child
    assert names and all(names.values()), names


def test_discovery_off_registers_nothing():
    """VERL_USE_EXTERNAL_PLUGINS=none: verl does not load the plugin (so the registration above is the plugin's)."""
    out = _python(
        "from helpers.verl_plugin_check import registered_names; print(registered_names())",
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    names = eval(out.stdout.strip().splitlines()[-1])
    assert not any(names.values()), names


def test_plugin_register_is_idempotent():
    from rapo_fast.integrations.verl import plugin

    assert plugin.register() == plugin.REGISTERED  # a second registration neither raises nor changes the set


@pytest.mark.skipif(
    not os.environ.get("VERL_TESTS_DIR"), reason="VERL_TESTS_DIR (verl's sdist tests/, set by .ci/run) is not set"
)
def test_verl_own_cpu_agent_loop_tests_pass_with_plugin_loaded():
    tests_dir = Path(os.environ["VERL_TESTS_DIR"])
    files = sorted(str(p) for p in (tests_dir / "experimental" / "agent_loop").glob("test_*_on_cpu.py"))
    assert files, f"no *_on_cpu.py agent-loop tests under {tests_dir}"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "helpers.verl_plugin_check", *files],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tests_dir.parent,  # verl's tests import `tests.experimental...` from the sdist root
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert "rapo_fast verl plugin loaded:" in out.stdout, tail
