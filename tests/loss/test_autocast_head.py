"""The hidden-state path under torch.autocast: `rapo_loss(hidden=h, weight=model.lm_head.weight)`
with bf16 hidden and the fp32 lm_head weight that autocast leaves in fp32. Under autocast the weight (and bias) are
cast to hidden's dtype inside, differentiably: the loss equals that of the explicit cast, is within bf16 error of the
float64 reference on the bf16-rounded inputs, and the gradient reaches the fp32 weight as an fp32 tensor of its
shape. Outside autocast the mismatch is a TypeError naming weight and both fixes. Both hidden-state paths (the fused
one-pass op and the two-pass path) and token_logprobs.

Not here: autocast's effect on a model's backbone (the TRL adapter's bf16 tests), other argument checks
(test_loss_checks.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import make_batch

import rapo_fast
from rapo_fast.reference import rapo_loss_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case():
    d = make_batch(3, 6, 13, H=16, seed=4)
    d.pop("behav_logp")
    d.pop("ref_logp")
    d = {k: v.to(DEV) for k, v in d.items()}
    d["hidden"] = d["hidden"].to(torch.bfloat16)
    return d


def _leaves(d, head_dtype):
    """Leaf copies: hidden in bf16, weight and bias in head_dtype, all with grad."""
    out = dict(d)
    out["hidden"] = d["hidden"].detach().clone().requires_grad_(True)
    for k in ("weight", "bias"):
        out[k] = d[k].detach().to(head_dtype).requires_grad_(True)
    return out


@pytest.fixture(params=["fused", "two-pass"])
def path(request, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", "1" if request.param == "fused" else "0")
    return request.param


def test_fp32_weight_with_bf16_hidden_under_autocast(path):
    d = _case()
    auto = _leaves(d, torch.float32)  # what a user holds: the fp32 lm_head weight
    with torch.autocast(DEV, dtype=torch.bfloat16):
        loss = rapo_fast.rapo_loss(**auto)
    loss.backward()
    # the same call with the cast written out, outside autocast
    cast = _leaves(d, torch.bfloat16)
    want = rapo_fast.rapo_loss(**cast)
    want.backward()
    assert_close_verbose(loss, want, atol=1e-6, name="loss vs explicit cast")
    # the spec, in float64, on the inputs rounded to bf16 (what the kernels multiply)
    ref = rapo_loss_ref(**{k: (v.detach().double() if v.is_floating_point() else v) for k, v in cast.items()})
    assert_close_verbose(loss, ref, atol=2e-2, name="loss vs float64 reference")
    for k in ("weight", "bias"):
        g = auto[k].grad
        assert g is not None and g.dtype == torch.float32 and g.shape == auto[k].shape, (k, g)
        assert_close_verbose(g, cast[k].grad.float(), atol=1e-6, name=f"grad {k}")
    assert auto["hidden"].grad.dtype == torch.bfloat16
    assert_close_verbose(auto["hidden"].grad, cast["hidden"].grad, atol=1e-6, name="grad hidden")


def test_token_logprobs_casts_the_head_under_autocast():
    d = _case()
    auto, cast = _leaves(d, torch.float32), _leaves(d, torch.bfloat16)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        lp = rapo_fast.token_logprobs(hidden=auto["hidden"], weight=auto["weight"], targets=d["targets"])
    want = rapo_fast.token_logprobs(hidden=cast["hidden"], weight=cast["weight"], targets=d["targets"])
    assert_close_verbose(lp, want, atol=1e-6, name="logp")
    lp.sum().backward()
    assert auto["weight"].grad.dtype == torch.float32 and auto["weight"].grad.shape == auto["weight"].shape


def test_dtype_mismatch_outside_autocast_names_the_fix():
    d = _leaves(_case(), torch.float32)
    with pytest.raises(TypeError, match=r"weight: expected hidden's dtype bfloat16, got float32.*autocast"):
        rapo_fast.rapo_loss(**d)
    with pytest.raises(TypeError, match=r"weight must have hidden's dtype.*autocast"):
        rapo_fast.token_logprobs(hidden=d["hidden"], weight=d["weight"], targets=d["targets"])
    d["weight"] = d["weight"].detach().to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"bias: expected hidden's dtype bfloat16, got float32"):
        rapo_fast.rapo_loss(**d)
