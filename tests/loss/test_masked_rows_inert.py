"""A token out of the loss is inert whatever its hidden row, logits row or per-token inputs hold.

A masked hidden row holding NaN/inf once put NaN into the weight gradient on every path, the reference included:
grad_W = grad_z^T h sums over every row, and 0 * NaN = NaN although the row's grad_z is zero. And a NaN in a masked
token's old_logp, advantage, behav_logp or ref_logp was refused by validation although the loss never reads it.
Here (docs/loss.md section 3 states the guarantee as checked):
- rapo_loss on poisoned inputs gives exactly (bit for bit) the loss, metrics and gradients of the clean inputs, on the
  hidden path's fused op, its two-pass path, the CPU fallback, the fp64 path and the reference (rapo_loss_ref), and on
  the logits path; the poisoned rows' gradients are exactly zero;
- the kernels on poisoned inputs are within the tolerance rule of the float64 reference (tests/helpers);
- token_logprobs(hidden=...) with a NaN/inf hidden row gives NaN log-prob and entropy there and leaves grad_weight,
  grad_bias and the other rows' grad_hidden finite and equal to those without the row;
- a hypothesis property over which tokens are masked and what their rows hold.
Not here: the refusal of such rows in the loss (test_masked_rows.py, test_loss_checks.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.loss_cases import check_case, make_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rapo_fast
from rapo_fast.reference import rapo_loss_ref

OPTIONS = dict(
    entropy_coef=0.01,
    beta=0.04,
    tis_cap=2.0,
    offpolicy_train="truncated",
    shaping_m=0.05,
    loss_agg="seq-mean-token-mean",
)
POISONS = {"nan": float("nan"), "pos_inf": float("inf"), "neg_inf": float("-inf"), "one_nan": None}
PER_TOKEN = ("old_logp", "advantages", "behav_logp", "ref_logp")
# path -> environment: the fused one-pass op, the two-pass Triton path, the CPU fallback (reference math, chunked)
PATHS = {
    "fused": {},
    "two_pass": {"RAPO_FAST_FUSED_LINEAR_LOSS": "0"},
    "fallback": {"RAPO_FAST_DISABLE_TRITON": "1"},
    "fp64": {},
    "reference": {},
}


def _batch(hidden: bool, seed: int = 3, offpolicy: str = "truncated"):
    d = make_batch(3, 5, 37, H=8 if hidden else None, masked_rows=(1,), seed=seed)
    d["loss_mask"][0, 4] = False  # a masked token inside a row that has tokens in the loss
    return d


def _out_of_loss(d, offpolicy: str) -> torch.Tensor:
    out = ~d["loss_mask"]
    if offpolicy == "none":  # retrieved tokens are out of the loss too, although in loss_mask
        out = out | d["retrieved_mask"]
    return out


def _poison(d, poison: str, offpolicy: str, rows=True, per_token=True):
    """A copy of d whose tokens out of the loss hold `poison` in their hidden or logits row, and NaN in every
    per-token input (old_logp, advantages, behav_logp, ref_logp)."""
    p = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    out = _out_of_loss(d, offpolicy)
    key = "hidden" if "hidden" in p else "logits"
    if rows:
        # logits rows: refused on every token in loss_mask (docs/loss.md section 3), so poisoned only outside it
        rows_out = out if key == "hidden" else ~d["loss_mask"]
        if POISONS[poison] is None:  # one NaN entry in an otherwise finite row
            p[key][rows_out, 3] = float("nan")
        else:
            p[key][rows_out] = POISONS[poison]
    if per_token:
        for k in PER_TOKEN:
            p[k][out] = float("nan")
    return p


def _run(d, path, opts):
    dtype = torch.float64 if path == "fp64" else torch.float32
    leaves = [k for k in ("hidden", "weight", "bias", "logits") if k in d]
    x = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in d.items()}
    for k in leaves:
        x[k] = x[k].detach().requires_grad_(True)
    fn = rapo_loss_ref if path == "reference" else rapo_fast.rapo_loss
    loss, metrics = fn(**x, **opts, return_metrics=True)
    loss.backward()
    # the metrics by name: the reference's dict, or LossMetrics' 0-dim fields
    return loss.detach(), metrics if isinstance(metrics, dict) else metrics.scalars(), {k: x[k].grad for k in leaves}


def _assert_same(clean, poisoned, d, offpolicy):
    (l0, m0, g0), (l1, m1, g1) = clean, poisoned
    out = _out_of_loss(d, offpolicy)
    for k in g0:
        assert torch.isfinite(g1[k]).all(), f"grad {k}: {int((~torch.isfinite(g1[k])).sum())} non-finite entries"
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0, msg=lambda m, k=k: f"grad {k}: {m}")
    row_grad = g1["hidden"] if "hidden" in g1 else g1["logits"]
    assert bool((row_grad[out] == 0).all())
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for k in m0:
        torch.testing.assert_close(m1[k], m0[k], rtol=0, atol=0, msg=lambda m, k=k: f"metric {k}: {m}")


@pytest.mark.parametrize("offpolicy", ["truncated", "none"])
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("path", list(PATHS))
def test_hidden_path_masked_rows_inert(path, poison, offpolicy, monkeypatch):
    """NaN/inf in the masked tokens' hidden rows (and NaN in their per-token inputs): the same loss, metrics and
    gradients as the clean batch, bit for bit, grad_weight and grad_bias included."""
    for k, v in PATHS[path].items():
        monkeypatch.setenv(k, v)
    torch.manual_seed(0)
    d = _batch(hidden=True)
    opts = {**OPTIONS, "offpolicy_train": offpolicy}
    _assert_same(_run(d, path, opts), _run(_poison(d, poison, offpolicy), path, opts), d, offpolicy)


@pytest.mark.parametrize("offpolicy", ["truncated", "none"])
@pytest.mark.parametrize("path", ["fused", "fallback", "fp64", "reference"])
def test_logits_path_masked_per_token_inputs_inert(path, offpolicy, monkeypatch):
    """NaN in the masked tokens' old_logp, advantages, behav_logp and ref_logp, and NaN logits rows there: accepted,
    and the same loss, metrics and gradients as the clean batch."""
    for k, v in PATHS[path].items():
        monkeypatch.setenv(k, v)
    torch.manual_seed(0)
    d = _batch(hidden=False)
    opts = {**OPTIONS, "offpolicy_train": offpolicy}
    _assert_same(_run(d, path, opts), _run(_poison(d, "nan", offpolicy), path, opts), d, offpolicy)


def test_nan_per_token_input_in_the_loss_still_refused():
    """The other side of the rule: NaN in a token that enters the loss is refused, naming the argument."""
    d = _batch(hidden=False)
    in_loss = ~_out_of_loss(d, "truncated")
    for k in PER_TOKEN:
        p = {kk: (v.clone() if torch.is_tensor(v) else v) for kk, v in d.items()}
        p[k][in_loss.nonzero()[0].tolist()] = float("nan")
        with pytest.raises(ValueError, match=rf"{k}: expected (no NaN|finite values) at tokens in the loss"):
            rapo_fast.rapo_loss(**p, **OPTIONS)


@pytest.mark.parametrize("hidden", [True, False])
@pytest.mark.parametrize("fused", ["1", "0"])
def test_kernels_on_poisoned_batch_match_reference(hidden, fused, monkeypatch):
    """Kernel vs the fp32 and float64 references on the poisoned batch: the tolerance rule on loss, metrics and every
    gradient (the references are the spec of the guarantee too)."""
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", fused)
    torch.manual_seed(0)
    check_case(_poison(_batch(hidden=hidden), "nan", "truncated"), OPTIONS)


@pytest.mark.parametrize("poison", ["nan", "pos_inf", "neg_inf", "one_nan"])
@pytest.mark.parametrize("path", ["triton", "fallback", "reference"])
def test_token_logprobs_hidden_nonfinite_row(path, poison, monkeypatch):
    """token_logprobs(hidden=...) has no mask: a hidden row with NaN/inf gives NaN log-prob and entropy, and adds
    exactly nothing to grad_weight / grad_bias; its grad_hidden row is 0; the other rows as without it."""
    from rapo_fast.reference.logprobs import linear_token_logprobs_ref

    if path == "fallback":
        monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    torch.manual_seed(0)
    h, w, b = torch.randn(5, 8), torch.randn(37, 8) / 3, torch.randn(37) * 0.1
    y = torch.tensor([1, 5, 7, 36, 0])
    hp = h.clone()
    if POISONS[poison] is None:
        hp[2, 3] = float("nan")
    else:
        hp[2] = POISONS[poison]
    keep = [0, 1, 3, 4]
    fn = (
        (lambda *a: linear_token_logprobs_ref(*a[:4], return_entropy=True))
        if path == "reference"
        else (
            lambda hh, ww, yy, bb: rapo_fast.token_logprobs(
                hidden=hh, weight=ww, bias=bb, targets=yy, return_entropy=True
            )
        )
    )

    def run(hid, rows):
        leaves = [t.clone().requires_grad_(True) for t in (hid, w, b)]
        lp, ent = fn(leaves[0], leaves[1], y[rows], leaves[2])
        g = torch.linspace(-1, 1, 5)[rows]  # each row's upstream weight, the same with or without row 2
        (torch.where(torch.isfinite(lp), lp * g + 0.1 * ent, torch.zeros_like(lp))).sum().backward()
        return lp.detach(), ent.detach(), [t.grad for t in leaves]

    lp, ent, (gh, gw, gb) = run(hp, list(range(5)))
    assert torch.isnan(lp[2]) and torch.isnan(ent[2])
    assert torch.isfinite(gw).all() and torch.isfinite(gb).all() and torch.isfinite(gh).all()
    assert bool((gh[2] == 0).all())
    lp0, ent0, (gh0, gw0, gb0) = run(h[keep], keep)
    for a, b0, name in (
        (lp[keep], lp0, "logp"),
        (ent[keep], ent0, "entropy"),
        (gh[keep], gh0, "grad_hidden"),
        (gw, gw0, "grad_weight"),
        (gb, gb0, "grad_bias"),
    ):
        torch.testing.assert_close(a, b0, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mask_bits=st.lists(st.booleans(), min_size=12, max_size=12),
    values=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30]), min_size=12, max_size=12),
    hidden=st.booleans(),
)
def test_property_masked_tokens_are_inert(mask_bits, values, hidden):
    """Any set of masked tokens (each holding NaN, +inf, -inf or a huge value in its row and NaN in its per-token
    inputs) leaves the fused / Triton loss and gradients exactly those of the clean batch."""
    torch.manual_seed(0)
    d = make_batch(2, 6, 23, H=8 if hidden else None, mask_p=1.0, seed=11)
    lm = torch.tensor(mask_bits).view(2, 6)
    d["loss_mask"] = lm
    p = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in d.items()}
    key = "hidden" if hidden else "logits"
    for i in (~lm).view(-1).nonzero().view(-1).tolist():
        p[key].view(12, -1)[i] = values[i]
        for k in PER_TOKEN:
            p[k].view(-1)[i] = float("nan")
    _assert_same(_run(d, "fused", OPTIONS), _run(p, "fused", OPTIONS), d, "truncated")
