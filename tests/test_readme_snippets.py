"""The README's "Use" snippets run as written: the loss by hand and the step buffer are executed on a tiny Llama built
from a config (the names they leave undefined are given by a preamble); the TRL snippet is parsed and its names
checked (training a TRL run is tests/integrations/test_integration_trl.py's job).

Not here: the numbers of the loss (tests/loss/) or of the search (tests/retrieval/).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _snippets() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    use = readme.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", use, flags=re.S)


def _preamble() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    input_ids = torch.randint(0, 101, (2, 9))
    gen_mask = torch.zeros(2, 9, dtype=torch.long)
    gen_mask[:, 4:] = 1
    ret_mask = torch.zeros(2, 9, dtype=torch.long)
    ret_mask[0, 5:7] = 1
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1].float()
    old_logp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    adv = torch.tensor([1.0, -1.0])
    return dict(model=model, input_ids=input_ids, gen_mask=gen_mask, ret_mask=ret_mask, old_logp=old_logp, adv=adv)


def test_there_are_three_snippets():
    snippets = _snippets()
    assert len(snippets) == 3
    assert "RAPOGRPOTrainer" in snippets[0] and "rapo_loss" in snippets[1] and "StepBuffer" in snippets[2]


def test_trl_snippet_parses_and_names_exist():
    pytest.importorskip("trl")
    import inspect

    from rapo_fast.integrations.trl import RAPOGRPOTrainer

    tree = ast.parse(_snippets()[0])
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "RAPOGRPOTrainer")
    params = inspect.signature(RAPOGRPOTrainer.__init__).parameters
    assert "rapo_options" in params
    assert {k.arg for k in call.keywords} >= {"model", "reward_funcs", "args", "rapo_options", "rollout_func"}
    import rapo_fast.integrations.trl as trl_path

    imported = [
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == trl_path.__name__
        for a in n.names
    ]
    assert "add_rapo_tags" in imported and all(name in trl_path.__all__ for name in imported), imported


def test_loss_snippet_runs_and_trains_only_generated_own_tokens():
    ns = _preamble()
    exec(_snippets()[1], ns)
    model = ns["model"]
    assert torch.isfinite(ns["loss"]) and model.lm_head.weight.grad is not None
    assert model.lm_head.weight.grad.dtype == torch.float32 and model.lm_head.weight.grad.abs().sum() > 0


def test_buffer_snippet_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(_snippets()[2], ns)
    assert ns["ids"].shape == (5,) and ns["scores"].shape == (5,)
    import rapo_fast

    assert len(rapo_fast.StepBuffer.load("step_buffer")) == 1000
