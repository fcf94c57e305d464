"""rapo_loss's metrics.token_logp: the per-token log-probs the loss used, on every path that returns metrics, equal to
the reference log-probs (and, for policy_loss_from_logp, to the log-probs given); detached, the targets' shape, not
among the metric keys. What this is not: the paths' choice (tests/loss/test_path_plan.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import inputs_for, make_batch

import rapo_fast
from rapo_fast import _dispatch
from rapo_fast.loss.policy_loss import policy_loss_from_logp
from rapo_fast.reference import linear_token_logprobs_ref, token_logprobs_ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batch(hidden: bool, dtype=torch.float32):
    torch.manual_seed(0)
    d = {k: v.to(DEV) for k, v in make_batch(3, 5, 11, H=7 if hidden else None, response=True).items()}
    return inputs_for(d, dtype)[0]


def _want(d, temperature):
    if "hidden" in d:
        return linear_token_logprobs_ref(d["hidden"], d["weight"], d["targets"], d["bias"], temperature)
    return token_logprobs_ref(d["logits"], d["targets"], temperature)


CASES = {
    # (hidden, dtype, options, needs Triton) -> the path each takes under backend="auto" (test_path_plan.py)
    "logits": (False, torch.float32, {}, False),
    "logits-gspo": (False, torch.float32, dict(importance_sampling_level="sequence"), False),
    "hidden-fused": (True, torch.float32, {}, True),
    "hidden-two-pass": (True, torch.float32, dict(importance_sampling_level="sequence"), False),
    "logits-fp64": (False, torch.float64, {}, False),
    "hidden-fp64": (True, torch.float64, {}, False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logp_is_the_loss_logprobs(name, temperature):
    hidden, dtype, opts, triton = CASES[name]
    if triton and not _dispatch.use_triton(DEV):
        pytest.skip("the fused path needs Triton (CUDA or TRITON_INTERPRET=1)")
    d = _batch(hidden, dtype)
    loss, m = rapo_fast.rapo_loss(**d, temperature=temperature, return_metrics=True, **opts)
    lp = m.token_logp
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in m.scalars().values())
    assert lp.shape == d["targets"].shape and not lp.requires_grad
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert_close_verbose(lp.to(dtype), _want(d, temperature).detach(), atol=tol, rtol=tol, name=f"{name} ({m.path})")
    loss.backward()  # the metrics' tensor does not hold the graph up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logp_from_given_logprobs(dtype):
    d = _batch(False, dtype)
    logp = token_logprobs_ref(d["logits"].detach(), d["targets"]).requires_grad_(True)
    keys = ("old_logp", "advantages", "loss_mask", "retrieved_mask", "response_mask")
    _, m = policy_loss_from_logp(logp, **{k: d[k] for k in keys}, return_metrics=True)
    assert torch.equal(m.token_logp.to(dtype), logp.detach()) and not m.token_logp.requires_grad
