"""A token out of the loss is inert whatever its logits row, hidden row or per-token inputs hold.

A row of only -inf, NaN or +inf on a masked token once gave NaN in every entry of its logits gradient (0 * NaN in the
log-prob backward); a masked hidden row holding NaN/inf put NaN into grad_W (which sums over every row); a NaN in a
masked token's old_logp, advantage, behav_logp or ref_logp was refused although the loss never reads it.
Checked (docs/loss.md section 3 states the guarantee): rapo_loss on poisoned inputs gives bit for bit the loss, metrics
and gradients of the clean inputs, the poisoned rows' gradients exactly zero, on every path (Triton in the interpreter
here, the hidden path's fused op and two-pass path, the CPU fallback, fp64, the reference, inplace_backward); the
kernels on poisoned inputs are within the tolerance rule of the float64 reference; the hidden path refuses such rows
in the loss; token_logprobs (no mask) gives NaN log-prob and entropy on such a row and a zero gradient there;
policy_loss_from_logp with NaN on masked tokens. The property over random masks, fills and options:
tests/fuzz/test_fuzz_loss.py.
Not here: the refusal of such logits rows in the loss (test_logits_row_check.py) or of NaN per-token inputs in the
loss (test_loss_checks.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.loss_cases import check_case, make_batch

import rapo_fast
from rapo_fast._dispatch import use_triton
from rapo_fast.loss.policy_loss import policy_loss_from_logp
from rapo_fast.reference import rapo_loss_ref
from rapo_fast.reference.logprobs import linear_token_logprobs_ref

OPTIONS = dict(
    entropy_coef=0.01,
    beta=0.04,
    tis_cap=2.0,
    offpolicy_train="truncated",
    shaping_m=0.05,
    loss_agg="seq-mean-token-mean",
)
# name -> (value, one entry of an otherwise finite row rather than the whole row)
POISONS = {
    "nan": (float("nan"), False),
    "pos_inf": (float("inf"), False),
    "neg_inf": (float("-inf"), False),
    "one_nan": (float("nan"), True),
    "one_pos_inf": (float("inf"), True),
}
HIDDEN_POISONS = ["nan", "pos_inf", "neg_inf", "one_nan"]
PER_TOKEN = ("old_logp", "advantages", "behav_logp", "ref_logp")
# path -> environment. "triton" is the default path: on the hidden path the fused one-pass op
PATHS = {
    "triton": {},
    "two_pass": {"RAPO_FAST_FUSED_LINEAR_LOSS": "0"},
    "fallback": {"RAPO_FAST_DISABLE_TRITON": "1"},
    "fp64": {},
    "reference": {},
    "inplace": {},
}


def _set_path(path, monkeypatch):
    for k, v in PATHS[path].items():
        monkeypatch.setenv(k, v)
    if path == "inplace" and not use_triton(torch.device("cpu")):
        pytest.skip("inplace_backward is the Triton path's")


def _batch(hidden: bool, seed: int = 3):
    d = make_batch(3, 5, 37, H=8 if hidden else None, masked_rows=(1,), seed=seed)
    d["loss_mask"][0, 4] = False  # a masked token inside a row that has tokens in the loss
    return d


def _out_of_loss(d, offpolicy: str) -> torch.Tensor:
    out = ~d["loss_mask"]
    if offpolicy == "none":  # retrieved tokens are out of the loss too, although in loss_mask
        out = out | d["retrieved_mask"]
    return out


def _poison(d, poison: str, offpolicy: str):
    """A copy of d whose tokens out of the loss hold `poison` in their hidden or logits row, and in their per-token
    inputs NaN (-inf in the log-probs for the neg_inf poison: a log-prob may be -inf)."""
    p = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    out = _out_of_loss(d, offpolicy)
    key = "hidden" if "hidden" in p else "logits"
    # logits rows: refused on every token in loss_mask (docs/loss.md section 3), so poisoned only outside it
    rows_out = out if key == "hidden" else ~d["loss_mask"]
    value, entry = POISONS[poison]
    if entry:
        p[key][rows_out, 3] = value
    else:
        p[key][rows_out] = value
    for k in PER_TOKEN:
        p[k][out] = float("-inf") if poison == "neg_inf" and k != "advantages" else float("nan")
    return p


def _run(d, path, opts):
    dtype = torch.float64 if path == "fp64" else torch.float32
    x = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in d.items()}
    leaves = {k: x[k].detach().requires_grad_(True) for k in ("hidden", "weight", "bias", "logits") if k in x}
    x.update(leaves)
    if path == "inplace":  # a non-leaf copy, so that the option takes effect: the leaf's .grad is its gradient
        x["logits"], opts = leaves["logits"] * 1.0, dict(opts, inplace_backward=True)
    fn = rapo_loss_ref if path == "reference" else rapo_fast.rapo_loss
    loss, metrics = fn(**x, **opts, return_metrics=True)
    loss.backward()
    # the metrics by name: the reference's dict, or LossMetrics' 0-dim fields
    return (
        loss.detach(),
        metrics if isinstance(metrics, dict) else metrics.scalars(),
        {k: t.grad for k, t in leaves.items()},
    )


def _assert_same(clean, poisoned, d, offpolicy):
    (l0, m0, g0), (l1, m1, g1) = clean, poisoned
    out = _out_of_loss(d, offpolicy)
    for k in g0:
        assert torch.isfinite(g1[k]).all(), f"grad {k}: {int((~torch.isfinite(g1[k])).sum())} non-finite entries"
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0, msg=lambda m, k=k: f"grad {k}: {m}")
    row_grad = next(iter(g1.values()))  # the first leaf holds one row per token: hidden, logits or logp
    assert bool((row_grad[out] == 0).all())
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for k in m0:
        torch.testing.assert_close(m1[k], m0[k], rtol=0, atol=0, msg=lambda m, k=k: f"metric {k}: {m}")


@pytest.mark.parametrize("offpolicy", ["truncated", "none"])
@pytest.mark.parametrize("poison", HIDDEN_POISONS)
@pytest.mark.parametrize("path", [p for p in PATHS if p != "inplace"])
def test_hidden_path_masked_rows_inert(path, poison, offpolicy, monkeypatch):
    """grad_weight and grad_bias included."""
    _set_path(path, monkeypatch)
    d = _batch(hidden=True)
    opts = {**OPTIONS, "offpolicy_train": offpolicy}
    _assert_same(_run(d, path, opts), _run(_poison(d, poison, offpolicy), path, opts), d, offpolicy)


@pytest.mark.parametrize("poison, offpolicy", [(p, "truncated") for p in POISONS] + [("nan", "none")])
@pytest.mark.parametrize("path", [p for p in PATHS if p != "two_pass"])
def test_logits_path_masked_rows_inert(path, poison, offpolicy, monkeypatch):
    _set_path(path, monkeypatch)
    d = _batch(hidden=False)
    opts = {**OPTIONS, "offpolicy_train": offpolicy}
    _assert_same(_run(d, path, opts), _run(_poison(d, poison, offpolicy), path, opts), d, offpolicy)


@pytest.mark.parametrize("path", ["triton", "two_pass"])
def test_hidden_path_masked_overflow_rows(path, monkeypatch):
    """A masked token whose logits overflow to +-inf (NaN lse) from a finite hidden row: the clean gradients."""
    _set_path(path, monkeypatch)
    d = make_batch(2, 4, 29, H=8, masked_rows=(1,), seed=5)
    p = dict(d, hidden=d["hidden"].clone())
    p["hidden"][1] = 1e38 * torch.sign(p["hidden"][1])  # h W^T overflows fp32 to +-inf: the row's lse is NaN
    (l0, _, g0), (l1, _, g1) = _run(d, path, OPTIONS), _run(p, path, OPTIONS)
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-7)
    for k in g0:
        assert torch.isfinite(g1[k]).all()
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-6, atol=1e-7)
    assert bool((g1["hidden"][1] == 0).all())


@pytest.mark.parametrize("poison", ["overflow", "nan_hidden", "nan_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fused", ["1", "0"])
def test_hidden_path_refuses_undefined_logp_in_loss(fused, dtype, poison, monkeypatch):
    """The same rows IN the loss (h W^T overflows, or NaN in hidden or weight): a ValueError naming hidden, in the
    fused op, the two-pass path and the fp64 path, instead of a finite but wrong loss. fp64 does not overflow at 1e38:
    there the overflow case gives the finite answer."""
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", fused)
    d = make_batch(2, 4, 29, H=8, seed=6)
    d.update({k: d[k].to(dtype) for k in ("hidden", "weight", "bias")})
    h, wt = d.pop("hidden").clone(), d.pop("weight").clone()
    flat = int(torch.nonzero(d["loss_mask"].reshape(-1))[-1])  # a token that enters the loss (truncated off-policy)
    rows = h.view(-1, h.shape[-1])
    if poison == "overflow":
        rows[flat] = 1e38 * torch.sign(rows[flat])
    elif poison == "nan_hidden":
        rows[flat, 3] = float("nan")
    else:
        wt[7, 2] = float("nan")  # every row's lse is NaN: every token in the loss is undefined
    h.requires_grad_(True)
    if poison == "overflow" and dtype == torch.float64:
        loss = rapo_fast.rapo_loss(hidden=h, weight=wt, **d, **OPTIONS)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(h.grad).all()
        return
    with pytest.raises(
        ValueError,
        match=r"hidden: expected logits .* finite log-sum-exp .*, got \d+ token\(s\) whose log-sum-exp is not finite",
    ):
        rapo_fast.rapo_loss(hidden=h, weight=wt, **d, **OPTIONS)
    assert h.grad is None


@pytest.mark.parametrize("hidden, fused", [(True, "1"), (True, "0"), (False, "1")])  # the switch is the hidden path's
def test_kernels_on_poisoned_batch_match_reference(hidden, fused, monkeypatch):
    """The tolerance rule on loss, metrics and every gradient: the references are the spec of the guarantee too."""
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", fused)
    check_case(_poison(_batch(hidden=hidden), "nan", "truncated"), OPTIONS)


def _token_logprobs_case(kind, path):
    """(leaves, targets, fn(leaves, targets, rows) -> (logp, entropy)) of token_logprobs on `kind` inputs."""
    g = torch.Generator().manual_seed(0)
    y = torch.tensor([1, 5, 7, 36, 0])
    if kind == "logits":
        return (
            [torch.randn(5, 37, generator=g)],
            y,
            lambda z, t: rapo_fast.token_logprobs(z, targets=t, return_entropy=True),
        )
    leaves = [torch.randn(5, 8, generator=g), torch.randn(37, 8, generator=g) / 3, torch.randn(37, generator=g) * 0.1]
    if path == "reference":
        return leaves, y, lambda h, w, b, t: linear_token_logprobs_ref(h, w, t, b, return_entropy=True)
    return (
        leaves,
        y,
        lambda h, w, b, t: rapo_fast.token_logprobs(hidden=h, weight=w, bias=b, targets=t, return_entropy=True),
    )


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize(
    "kind, path",
    [("logits", "triton"), ("logits", "fallback")] + [("hidden", p) for p in ("triton", "fallback", "reference")],
)
def test_token_logprobs_nonfinite_row(kind, path, poison, monkeypatch):
    """token_logprobs has no mask: a logits / hidden row with NaN or inf gives NaN log-prob and entropy there, and
    exactly nothing to any gradient (its own row's 0, grad_weight / grad_bias finite): the other rows as without it."""
    _set_path(path, monkeypatch)
    leaves, y, fn = _token_logprobs_case(kind, path)
    value, entry = POISONS[poison]
    poisoned = leaves[0].clone()
    if entry:
        poisoned[2, 3] = value
    else:
        poisoned[2] = value
    keep = [0, 1, 3, 4]

    def run(first, rows):
        xs = [t.clone().requires_grad_(True) for t in (first, *leaves[1:])]
        lp, ent = fn(*xs, y[rows])
        g = torch.linspace(-1, 1, 5)[rows]  # each row's upstream weight, the same with or without row 2
        torch.where(torch.isfinite(lp), lp * g + 0.1 * ent, torch.zeros_like(lp)).sum().backward()
        return [lp.detach(), ent.detach()], [t.grad for t in xs]

    (lp, ent), grads = run(poisoned, list(range(5)))
    assert torch.isnan(lp[2]) and torch.isnan(ent[2])
    assert all(torch.isfinite(t).all() for t in grads) and bool((grads[0][2] == 0).all())
    (lp0, ent0), grads0 = run(leaves[0][keep], keep)
    for a, b in zip([lp[keep], ent[keep], grads[0][keep], *grads[1:]], [lp0, ent0, *grads0]):
        torch.testing.assert_close(
            a, b, rtol=1e-6 if kind == "logits" else 1e-5, atol=1e-7 if kind == "logits" else 1e-6
        )


@pytest.mark.parametrize("path", ["triton", "fallback"])
def test_policy_loss_from_logp_masked_nan(path, monkeypatch):
    """NaN log-prob and entropy (and -inf old/behav/ref) on masked tokens: the loss, the metrics and the logp /
    entropy gradients exactly as with finite values there; those tokens' gradients are 0."""
    _set_path(path, monkeypatch)
    d = _batch(hidden=False)
    base_lp = torch.log_softmax(d.pop("logits"), -1).gather(-1, d.pop("targets")[..., None])[..., 0]
    base_ent = torch.rand(base_lp.shape)
    masked = ~d["loss_mask"]

    def run(poison):
        lp, ent = base_lp.clone(), base_ent.clone()
        args = {k: v.clone() for k, v in d.items()}
        if poison:
            lp[masked], ent[masked] = float("nan"), float("nan")
            for k in ("old_logp", "behav_logp", "ref_logp"):
                args[k][masked] = float("-inf")
        lp.requires_grad_(True)
        ent.requires_grad_(True)
        loss, metrics = policy_loss_from_logp(lp, entropy=ent, **args, **OPTIONS, return_metrics=True)
        loss.backward()
        return loss.detach(), metrics.scalars(), {"logp": lp.grad, "entropy": ent.grad}

    clean, poisoned = run(False), run(True)
    for k in ("logp", "entropy"):
        assert bool((poisoned[2][k][masked] == 0).all())
    _assert_same(clean, poisoned, d, "truncated")
