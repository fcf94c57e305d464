"""One front desk per public loss call: a spy on one rapo_loss call (logits and hidden-state paths) and one
token_logprobs call (both paths) counts exactly one head cast, one validation (and one model-input check, one
targets range check) and one path plan. rapo_loss runs the log-probs through token_logprobs' private runner, never
through the public function, so nothing is cast, checked or planned twice.
Not here: the values (tests/loss/test_loss.py, test_logprobs.py) or timing (bench/bench_token_logprobs.py --parity,
smoke-run in tests/bench/test_bench_quick.py).
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers.loss_cases import make_batch

import rapo_fast
from rapo_fast import _checks as C
from rapo_fast.loss import logprobs as lp_mod
from rapo_fast.loss import options as options_mod
from rapo_fast.loss import policy_loss as loss_mod


@pytest.fixture
def spies(monkeypatch):
    """Counting wrappers around the cast, the validations, the range checks and the plan, wherever they are bound."""
    counts = collections.Counter()

    def spy(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for mod in (lp_mod, loss_mod):
        spy(mod, "head_in_hidden_dtype", "cast")
        spy(mod, "plan_path", "plan")
    spy(lp_mod, "_validate", "validate")  # token_logprobs' checks
    spy(options_mod, "check_inputs", "validate")  # rapo_loss's checks (LossInputs.checked)
    spy(C, "check_model_inputs", "model_inputs")
    spy(C, "check_index_range", "range")  # the targets range check (its one host sync)
    spy(loss_mod, "_run_logprobs", "run")
    spy(lp_mod, "token_logprobs", "public_token_logprobs")
    return counts


def _batch(hidden: bool):
    d = make_batch(2, 5, 11, H=6 if hidden else None)
    for k in ("logits", "hidden", "weight", "bias"):
        if d.get(k) is not None:
            d[k] = d[k].requires_grad_(True)
    return d


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_rapo_loss_one_cast_one_check_one_plan(spies, hidden, backend):
    d = _batch(hidden)
    loss, m = rapo_fast.rapo_loss(**d, backend=backend, return_metrics=True)
    loss.backward()
    assert torch.isfinite(loss)
    assert spies["cast"] == 1 and spies["validate"] == 1 and spies["plan"] == 1, dict(spies)
    assert spies["model_inputs"] == 1 and spies["range"] == 1, dict(spies)
    # the log-prob runner once, except on the fused hidden-state path (log-probs formed inside the fused op)
    assert spies["run"] == (0 if m.path == "triton_fused_linear" else 1), (m.path, dict(spies))
    assert spies["public_token_logprobs"] == 0, dict(spies)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_token_logprobs_one_cast_one_check_one_plan(spies, hidden, backend):
    d = _batch(hidden)
    kw = {"hidden": d["hidden"], "weight": d["weight"], "bias": d.get("bias")} if hidden else {"logits": d["logits"]}
    targets = d["targets"].masked_fill(d["targets"] < 0, 0)
    logp = rapo_fast.token_logprobs(**kw, targets=targets, backend=backend)
    logp.sum().backward()
    assert spies["cast"] == 1 and spies["validate"] == 1 and spies["plan"] == 1, dict(spies)
    assert spies["model_inputs"] == 1 and spies["range"] == 1, dict(spies)
