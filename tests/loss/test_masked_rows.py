"""Masked tokens contribute exactly zero to the loss and to every gradient, whatever their logits hold.

A padding row of only -inf logits, or a row of NaN or +inf, on a token out of the loss once gave NaN in every entry of
its logits gradient (0 * NaN in the log-prob backward), and one NaN poisons the optimiser step. Each test computes the
loss twice, on clean inputs and on the same inputs with the masked tokens' rows poisoned, and requires the same loss,
metrics and gradients (the poisoned rows' gradient exactly zero), on every path: Triton (the interpreter here), the
CPU fallback, fp64 (reference math), the reference itself, the hidden-state two-pass and fused paths, and
token_logprobs with a zero upstream gradient. Not here: the refusal of such rows in the loss (test_loss_checks.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.loss_cases import make_batch

import rapo_fast
from rapo_fast.loss.policy_loss import policy_loss_from_logp
from rapo_fast.reference import rapo_loss_ref

OPTIONS = dict(
    entropy_coef=0.01,
    beta=0.04,
    tis_cap=2.0,
    offpolicy_train="truncated",
    shaping_m=0.05,
    loss_agg="seq-mean-token-mean",
    return_metrics=True,
)
POISONS = {"neg_inf": float("-inf"), "nan": float("nan"), "pos_inf": float("inf")}


def _batch():
    d = make_batch(3, 5, 37, masked_rows=(1,), seed=3)
    d["loss_mask"][0, 4] = False  # a masked token inside a row that has tokens in the loss
    return d


def _poison(d, value):
    """A copy of d whose masked tokens hold `value` in their whole logits row (and -inf in their old/behav/ref logp)."""
    p = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    masked = ~p["loss_mask"]
    p["logits"][masked] = value
    for k in ("old_logp", "behav_logp", "ref_logp"):
        p[k][masked] = float("-inf")
    return p


def _run(d, path, dtype=torch.float32):
    logits = d["logits"].detach().to(dtype).requires_grad_(True)
    args = {k: v for k, v in d.items() if k != "logits"}
    if dtype == torch.float64:
        args = {
            k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in args.items()
        }
    fn = rapo_loss_ref if path == "reference" else rapo_fast.rapo_loss
    loss, metrics = fn(logits=logits, **args, **OPTIONS)
    loss.backward()
    # the metrics by name: the reference's dict, or LossMetrics' 0-dim fields
    return loss.detach(), metrics if isinstance(metrics, dict) else metrics.scalars(), logits.grad


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("path", ["triton", "fallback", "fp64", "reference"])
def test_masked_rows_contribute_exactly_zero(path, poison, monkeypatch):
    if path == "fallback":
        monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    dtype = torch.float64 if path == "fp64" else torch.float32
    d = _batch()
    loss0, m0, g0 = _run(d, path, dtype)
    loss1, m1, g1 = _run(_poison(d, POISONS[poison]), path, dtype)
    assert torch.isfinite(g1).all(), f"non-finite gradient entries: {int((~torch.isfinite(g1)).sum())}"
    masked = ~d["loss_mask"]
    assert bool((g1[masked] == 0).all()) and bool((g0[masked] == 0).all())
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    torch.testing.assert_close(g1, g0, rtol=0, atol=0)
    for k in m0:
        torch.testing.assert_close(m1[k], m0[k], rtol=0, atol=0, msg=f"metric {k}")


@pytest.mark.parametrize("fused", ["1", "0"])
def test_hidden_path_masked_overflow_rows(fused, monkeypatch):
    """Hidden path: a masked token whose logits overflow to +-inf (NaN lse) leaves every gradient finite and equal to
    the clean one, in the fused one-pass op and in the two-pass path."""
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", fused)
    d = make_batch(2, 4, 29, H=8, masked_rows=(1,), seed=5)
    opts = {k: v for k, v in OPTIONS.items() if k != "return_metrics"}

    def run(hidden):
        leaves = {k: d[k].clone().requires_grad_(True) for k in ("weight", "bias")}
        h = hidden.clone().requires_grad_(True)
        args = {k: v for k, v in d.items() if k not in ("hidden", "weight", "bias")}
        loss = rapo_fast.rapo_loss(hidden=h, **leaves, **args, **opts)
        loss.backward()
        return loss.detach(), h.grad, leaves["weight"].grad, leaves["bias"].grad

    clean = run(d["hidden"])
    h = d["hidden"].clone()
    h[1] = 1e38 * torch.sign(h[1])  # h W^T overflows fp32 to +-inf: the row's lse is NaN
    poisoned = run(h)
    for a, b in zip(poisoned, clean):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert bool((poisoned[1][1] == 0).all())


@pytest.mark.parametrize("poison", ["overflow", "nan_hidden", "nan_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fused", ["1", "0"])
def test_hidden_path_refuses_undefined_logp_in_loss(fused, dtype, poison, monkeypatch):
    """Hidden path: a token IN the loss whose logits row has no finite log-sum-exp (h W^T overflows, or NaN in hidden
    or weight) is refused with a ValueError naming hidden and the first token, in the fused one-pass op, the two-pass
    path and the fp64 reference path, instead of a finite but wrong loss. The same poison in a masked row is fine
    (test above). fp64 does not overflow at 1e38, so the overflow case there is checked to give the finite answer."""
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", fused)
    d = make_batch(2, 4, 29, H=8, masked_rows=(), seed=6)
    d = {
        k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k in ("hidden", "weight", "bias") else v)
        for k, v in d.items()
    }
    opts = {k: v for k, v in OPTIONS.items() if k != "return_metrics"}
    h, wt = d["hidden"].clone(), d["weight"].clone()
    in_loss = d["loss_mask"].reshape(-1) != 0
    if d.get("retrieved_mask") is not None and OPTIONS.get("offpolicy_train", "none") == "none":
        in_loss &= d["retrieved_mask"].reshape(-1) == 0
    flat = int(torch.nonzero(in_loss)[-1])  # a token that enters the loss
    if poison == "overflow":
        h.view(-1, h.shape[-1])[flat] = 1e38 * torch.sign(h.view(-1, h.shape[-1])[flat])
    elif poison == "nan_hidden":
        h.view(-1, h.shape[-1])[flat, 3] = float("nan")
    else:
        wt[7, 2] = float("nan")  # every row's lse is NaN: every token in the loss is undefined
    h.requires_grad_(True)
    args = {k: v for k, v in d.items() if k not in ("hidden", "weight")}
    if poison == "overflow" and dtype == torch.float64:
        loss = rapo_fast.rapo_loss(hidden=h, weight=wt, **args, **opts)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(h.grad).all()
        return
    with pytest.raises(ValueError, match=r"hidden: \d+ token\(s\) in the loss .*log-sum-exp is not finite"):
        rapo_fast.rapo_loss(hidden=h, weight=wt, **args, **opts)
    assert h.grad is None


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("path", ["triton", "fallback"])
def test_token_logprobs_nonfinite_row(path, poison, monkeypatch):
    """token_logprobs has no mask: a row whose lse is not finite gives NaN log-prob and entropy, and a gradient of
    exactly zero (the other rows unchanged), so a zero upstream gradient never turns into NaN."""
    if path == "fallback":
        monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    z = torch.randn(4, 37)
    z[2] = POISONS[poison]
    if poison != "neg_inf":
        z[2, :5] = 0.3  # NaN / +inf among finite entries
    y = torch.tensor([1, 5, 7, 36])
    x = z.clone().requires_grad_(True)
    lp, ent = rapo_fast.token_logprobs(x, targets=y, return_entropy=True)
    assert torch.isnan(lp[2]) and torch.isnan(ent[2])
    assert torch.isfinite(lp[[0, 1, 3]]).all() and torch.isfinite(ent[[0, 1, 3]]).all()
    w = torch.tensor([1.0, -0.5, 0.0, 2.0])
    (torch.where(w != 0, lp * w + 0.1 * ent, torch.zeros_like(lp))).sum().backward()
    assert torch.isfinite(x.grad).all() and bool((x.grad[2] == 0).all())
    x2 = z[[0, 1, 3]].clone().requires_grad_(True)
    lp2, ent2 = rapo_fast.token_logprobs(x2, targets=y[[0, 1, 3]], return_entropy=True)
    (lp2 * w[[0, 1, 3]] + 0.1 * ent2).sum().backward()
    torch.testing.assert_close(x.grad[[0, 1, 3]], x2.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("path", ["triton", "fallback"])
def test_policy_loss_from_logp_masked_nan(path, monkeypatch):
    """policy_loss_from_logp: NaN log-prob and entropy (and -inf old/behav/ref) on masked tokens leave the loss, the
    metrics and the logp / entropy gradients exactly as with finite values there; those tokens' gradients are 0."""
    if path == "fallback":
        monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    d = _batch()
    base_lp = torch.log_softmax(d.pop("logits"), -1).gather(-1, d.pop("targets")[..., None])[..., 0]
    base_ent = torch.rand(base_lp.shape)
    masked = ~d["loss_mask"]

    def run(poison):
        lp, ent = base_lp.clone(), base_ent.clone()
        args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
        if poison:
            lp[masked], ent[masked] = float("nan"), float("nan")
            for k in ("old_logp", "behav_logp", "ref_logp"):
                args[k][masked] = float("-inf")
        lp.requires_grad_(True)
        ent.requires_grad_(True)
        loss, metrics = policy_loss_from_logp(lp, entropy=ent, **args, **OPTIONS)
        loss.backward()
        return loss.detach(), metrics, lp.grad, ent.grad

    clean, poisoned = run(False), run(True)
    for a, b in zip((poisoned[0], poisoned[2], poisoned[3]), (clean[0], clean[2], clean[3])):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert bool((poisoned[2][masked] == 0).all()) and bool((poisoned[3][masked] == 0).all())
    for k, v in clean[1].scalars().items():
        torch.testing.assert_close(getattr(poisoned[1], k), v, rtol=0, atol=0, msg=f"metric {k}")
