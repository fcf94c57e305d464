"""verl_compat: every verl internal the plugin touches still exists in the installed verl, and the version gate.

With verl installed (the verl stage of .ci/run): one test per row of verl_compat.INTERNALS checks it in the installed
verl (an optional row whose module cannot be imported is skipped, with the reason). Without verl those are skipped; the
gate tests (a faked verl version outside the supported range fails the plugin's load with a message naming it and the
range; the escape hatch warns instead) and the source scans (no plugin module imports verl except through verl_compat;
every target the plugin names is a row of the table) run everywhere.
Not here: the parts' behaviour with verl (tests/integrations/verl_plugin/).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from rapo_fast.integrations.verl import verl_compat as vc

PLUGIN_DIR = Path(vc.__file__).resolve().parent
PLUGIN = "rapo_fast.integrations.verl.plugin"


@pytest.fixture(scope="module")
def installed_verl():
    pytest.importorskip("verl")
    pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")
    return vc.installed_version()


@pytest.mark.parametrize("row", vc.INTERNALS, ids=lambda r: f"{r.kind}:{r.name}")
def test_internal_exists_in_installed_verl(row, installed_verl):
    try:
        problem = vc.missing(row)
    except ImportError as e:
        if row.optional:
            pytest.skip(f"optional: {row.target} not importable here ({e!r}); the plugin skips that route")
        raise
    assert problem is None, f"verl {installed_verl}: {problem} ({row.kind}: {row.why})"


def test_missing_reports_what_is_absent(installed_verl):
    tal = "verl.experimental.agent_loop.tool_agent_loop"
    assert "no_such_name" in vc.missing(vc.Internal("import", f"{tal}:ToolAgentLoop.no_such_name", "x"))
    assert vc.missing(vc.Internal("attribute", f"{tal}:AgentData", "x", "no_such_field")) is not None
    run = "verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop"
    assert vc.missing(vc.Internal("frame-local", run, "x", "no_such_local")) is not None
    assert vc.missing(vc.Internal("field", "verl.trainer.ppo.ray_trainer:", "x", "no_such_key")) is not None
    with pytest.raises(ImportError):
        vc.missing(vc.Internal("import", "verl.no_such_module:x", "x"))


def test_table_is_well_formed():
    assert {r.kind for r in vc.INTERNALS} <= set(vc.KINDS)
    assert all(r.why and ":" in r.target for r in vc.INTERNALS)
    needs_detail = {"attribute", "field", "frame-local"}
    assert all(bool(r.detail) for r in vc.INTERNALS if r.kind in needs_detail)
    assert len({r.name + r.kind for r in vc.INTERNALS}) == len(vc.INTERNALS)


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.9.1", True),
        ("0.9.2", True),
        ("0.9.1.post1", True),
        ("0.9.99", True),
        ("0.9.0", False),
        ("0.8.0", False),
        ("0.10.0", False),
        ("0.10.0.dev0", False),
        ("1.0", False),
        ("0.9", False),
        ("", False),
        ("main", False),
    ],
)
def test_version_range(version, ok):
    assert vc.version_supported(version) is ok


@pytest.mark.parametrize("fake", ["0.10.0", "0.8.0"])
def test_plugin_load_fails_outside_the_supported_range(monkeypatch, fake):
    """A verl version outside the range (faked where the gate reads it) fails the plugin's load, before any verl
    import, with a message naming that version and the range (runs with or without verl installed)."""
    monkeypatch.delenv(vc.UNCHECKED_ENV, raising=False)
    monkeypatch.setattr(vc, "installed_version", lambda: fake)
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)  # restored afterwards when verl had loaded it
    with pytest.raises(RuntimeError) as e:
        importlib.import_module(PLUGIN)
    assert f"verl {fake} is installed" in str(e.value) and vc.SUPPORTED_RANGE in str(e.value)
    assert vc.UNCHECKED_ENV in str(e.value)  # the message names the escape hatch
    assert PLUGIN not in sys.modules


def test_escape_hatch_warns_instead(monkeypatch):
    monkeypatch.setenv(vc.UNCHECKED_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"verl 0\.10\.0 is installed"):
        assert vc.check_version("0.10.0") == "0.10.0"
    monkeypatch.setenv(vc.UNCHECKED_ENV, "0")
    with pytest.raises(RuntimeError, match=re.escape(vc.SUPPORTED_RANGE)):
        vc.check_version("0.10.0")
    assert vc.check_version("0.9.1") == "0.9.1"


def test_unlisted_target_is_refused():
    with pytest.raises(KeyError, match="not in INTERNALS"):
        vc.get("verl.trainer.ppo.core_algos:agg_loss")
    with pytest.raises(KeyError, match="not in INTERNALS"):
        vc.patch("verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop", lambda f: f)  # an import row


def _plugin_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(PLUGIN_DIR.glob("*.py")) if p.name != "verl_compat.py"}


def test_no_plugin_module_imports_verl_but_verl_compat():
    for name, text in _plugin_sources().items():
        for node in ast.walk(ast.parse(text)):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            for m in mods:
                top = m.split(".")[0]
                assert top not in ("verl", "transfer_queue"), f"{name}: imports {m} (go through verl_compat)"
        assert "importlib" not in text and "_getframe" not in text, f"{name}: reaches verl around verl_compat"


def test_every_target_the_plugin_names_is_in_the_table():
    listed = {r.target for r in vc.INTERNALS}
    found = 0
    for name, text in _plugin_sources().items():
        for target in re.findall(r'"((?:verl|transfer_queue)[\w.]*:[\w.]+)"', text):
            assert target in listed, f"{name}: {target} is not a row of verl_compat.INTERNALS"
            found += 1
    assert found >= 10
