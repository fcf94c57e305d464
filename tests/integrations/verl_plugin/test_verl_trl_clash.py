"""`rapo-fast[verl,trl]`: verl 0.9.1's FSDP actor builds with trl >= 1.16 installed (rapo_fast/integrations/verl/
trl_clash.py). Unmended, verl's `apply_monkey_patch` (run by the FSDP engine's init_model on every model) imports trl's
`AutoModelForCausalLMWithValueHead` whenever trl is importable, and trl 1.16 no longer has it.

Checked: with the plugin loaded (by verl's entry points), verl's own `apply_monkey_patch` runs on a tiny model with
the installed trl; its check is verl's meaning ("trl has the class it patches") with a trl that has the class (a
stand-in module), without one, and without trl. The whole actor building under trl 1.16 is
tests/integrations/verl_e2e (main_ppo's init_model). Skipped without verl.
"""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")

import verl  # noqa: E402, F401  (loads the plugin through the verl.plugins entry point)
from verl.models.transformers import monkey_patch  # noqa: E402

from rapo_fast.integrations.verl import trl_clash  # noqa: E402


@pytest.fixture
def fresh_check():
    trl_clash.trl_has_value_head.cache_clear()
    yield
    trl_clash.trl_has_value_head.cache_clear()


def test_verls_monkey_patch_runs_with_the_installed_trl(fresh_check):
    from transformers import LlamaConfig, LlamaForCausalLM

    assert monkey_patch.is_trl_available is trl_clash._is_trl_available_with_value_head  # installed by the plugin
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    monkey_patch.apply_monkey_patch(LlamaForCausalLM(cfg), use_remove_padding=False)  # raised ImportError unmended


def test_check_means_trl_has_the_value_head_class(fresh_check, monkeypatch):
    class ValueHead:
        pass

    fake = types.ModuleType("trl")
    monkeypatch.setitem(sys.modules, "trl", fake)
    monkeypatch.setitem(sys.modules, "trl.experimental", None)  # the newer home is missing: verl falls back to trl
    assert not trl_clash.trl_has_value_head()  # trl >= 1.16: no such class anywhere
    trl_clash.trl_has_value_head.cache_clear()
    fake.AutoModelForCausalLMWithValueHead = ValueHead
    assert trl_clash.trl_has_value_head() and monkey_patch.is_trl_available()  # verl's patch then runs as before
    trl_clash.trl_has_value_head.cache_clear()
    monkeypatch.setitem(sys.modules, "trl", None)  # no trl at all: verl's own answer
    assert not trl_clash.trl_has_value_head()


def test_registering_again_keeps_verls_function_for_restore():
    from rapo_fast.integrations.verl import verl_compat

    trl_clash.register()
    assert monkey_patch.is_trl_available is trl_clash._is_trl_available_with_value_head
    original = monkey_patch._verl_is_trl_available
    assert original.__module__ == "verl.utils.import_utils"
    verl_compat.restore(trl_clash.TARGET)
    try:
        assert monkey_patch.is_trl_available is original
    finally:
        trl_clash.register()
