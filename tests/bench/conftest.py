"""The bench tests' loader of a bench/ script as a fresh module (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def load_bench(monkeypatch):
    """load_bench("bench_x.py", NAME=value, ...): the script's module, with those attributes patched for the test."""

    def load(script: str, **patch):
        monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their sibling modules
        spec = importlib.util.spec_from_file_location(f"bench_test_{script[:-3]}", BENCH / script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for name, value in patch.items():
            monkeypatch.setattr(mod, name, value)
        return mod

    return load
