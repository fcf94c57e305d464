"""The one-pass fused hidden-state policy loss (rapo_fast/loss/fused_linear.py) against the two-pass path
(RAPO_FAST_FUSED_LINEAR_LOSS=0) and the reference: loss, metrics and the gradients of hidden / weight / bias for every
aggregation mode and option, padded and flat layouts, several token and vocabulary tiles (the tile budget shrunk
through rapo_fast.loss.tiles' module constants) under the tolerance rule of tests/helpers/__init__.py; an upstream
gradient != 1; the GEMM count (3 families fused, 4 two-pass); GSPO and no-grad calls taking the two-pass path; opcheck
of the registered op. Not here: the per-token loss semantics (test_loss_options.py), the log-prob kernels
(test_logprobs*.py), fp16 / bf16 and grad_W accumulation (test_fused_linear_accum.py), gradient accumulation
(test_loss_accumulation.py), all-masked batches (test_loss.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import AGG_MODES, FULL, check_case, make_batch

import rapo_fast
from rapo_fast.loss import fused_linear as fl
from rapo_fast.loss import policy_loss as loss_mod
from rapo_fast.loss import tiles as tiles_mod
from rapo_fast.loss.options import LossOptions
from rapo_fast.loss.policy_op import stack_token_inputs

OPTS = {
    "plain": dict(),
    "shaped-k1": dict(
        shaping_m=0.05, offpolicy_train="shaped", eps_low=0.28, eps_high=0.28, beta=0.1, kl_estimator="k1"
    ),
    "full-k3": FULL,  # truncated off-policy, tis_cap, dual_clip, k3, entropy_coef, shaping
    "k2-tis-dual": dict(tis_cap=2.0, dual_clip=2.5, beta=0.05, kl_estimator="k2", entropy_coef=-0.02),
}


@pytest.fixture
def fused_calls(monkeypatch):
    """Records, per rapo_loss call, whether it took the fused path."""
    calls = []
    real = loss_mod._use_fused

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(loss_mod, "_use_fused", spy)
    return calls


def _grads(d, opts, dtype=torch.float32, scale=1.0):
    x = {
        k: (v.detach().to(dtype).requires_grad_(True) if k in ("hidden", "weight", "bias") else v) for k, v in d.items()
    }
    loss, m = rapo_fast.rapo_loss(**x, **opts, return_metrics=True)
    (loss * scale).backward()
    return loss.detach(), m, {k: x[k].grad for k in ("hidden", "weight", "bias") if k in x}


def _two_pass(monkeypatch, d, opts, dtype=torch.float32, scale=1.0):
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", "0")
    out = _grads(d, opts, dtype, scale)
    monkeypatch.delenv("RAPO_FAST_FUSED_LINEAR_LOSS")
    return out


def _assert_same(a, b, atol=1e-5, name=""):
    assert_close_verbose(a[0], b[0], atol=atol, rtol=1e-5, name=f"{name} loss")
    ma, mb = (m if isinstance(m, dict) else m.scalars() for m in (a[1], b[1]))  # the reference's dict, or LossMetrics
    for k in ma:
        assert_close_verbose(ma[k], mb[k], atol=atol, rtol=1e-5, name=f"{name} metric {k}")
    assert set(a[2]) == set(b[2])
    for k in a[2]:
        assert a[2][k].dtype == b[2][k].dtype
        assert_close_verbose(a[2][k], b[2][k], atol=atol, rtol=1e-4, name=f"{name} grad {k}")


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("layout", ["padded", "flat"])
def test_fused_vs_reference_and_two_pass(agg, opt, layout, fused_calls, monkeypatch):
    if layout == "padded":
        d = make_batch(3, 7, 19, H=13, masked_rows=(1,), per_seq_adv=agg != "token-mean", response=True)
    else:
        d = make_batch(
            seg_lens=[5, 1, 0, 9, 3], V=23, H=9, bias=False, masked_rows=(1,), per_seq_adv=agg == "seq-mean-token-sum"
        )
    opts = dict(OPTS[opt], loss_agg=agg)
    check_case(d, opts)
    assert fused_calls and all(fused_calls)
    _assert_same(_grads(d, opts), _two_pass(monkeypatch, d, opts), name=opt)


@pytest.mark.parametrize("budget_cols", [16, 10**6], ids=["vocab-tiles", "row-tiles"])
def test_several_tiles(budget_cols, monkeypatch, fused_calls):
    """V = 37 (not a multiple of any tile). vocab-tiles: a row does not fit the budget -> 3 vocabulary tiles of 16
    and the second sweep; row-tiles: whole rows, 2 rows per token tile. fp32 here, fp16 / bf16 tiles in
    test_fused_linear_accum.py."""
    dtype = torch.float32
    v, elem = 37, torch.empty((), dtype=dtype).element_size()
    budget = (16 * elem) if budget_cols == 16 else 2 * v * elem
    monkeypatch.setitem(tiles_mod.TILE_BYTES, "cpu", budget)
    monkeypatch.setitem(tiles_mod.MAX_VOCAB_TILE, "cpu", 16)
    assert fl.tile_shape(30, v, elem, torch.device("cpu")) == ((1, 16) if budget_cols == 16 else (2, v))
    d = make_batch(3, 5, v, H=11, masked_rows=(2,), per_seq_adv=True)
    opts = dict(FULL, loss_agg="seq-mean-token-mean")
    check_case(d, opts, dtype)
    assert all(fused_calls)
    _assert_same(_grads(d, opts), _two_pass(monkeypatch, d, opts), name="tiles")


def test_upstream_gradient_scales_every_grad(monkeypatch, fused_calls):
    d = make_batch(2, 6, 17, H=7)
    opts = dict(FULL, loss_agg="token-mean")
    l1, _, g1 = _grads(d, opts)
    l37, _, g37 = _grads(d, opts, scale=3.7)
    _, _, g2p = _two_pass(monkeypatch, d, opts, scale=3.7)
    assert torch.equal(l1, l37)
    for k in g1:
        assert_close_verbose(g37[k], 3.7 * g1[k], atol=1e-6, rtol=1e-5, name=k)
        assert_close_verbose(g37[k], g2p[k], atol=1e-6, rtol=1e-4, name=k)
    assert fused_calls[:2] == [True, True]


def _count_gemms(fn) -> int:
    """aten::mm / addmm(_) / bmm calls made by fn(), custom ops' internals included (the profiler sees inside them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")
    return sum(e.count for e in prof.key_averages() if e.key in names)


def test_gemm_count_fused_3_two_pass_4(monkeypatch):
    """One token tile and one vocabulary tile: the fused path runs h W^T, gz W and gz^T h (3 GEMMs); the two-pass
    path runs h W^T, then in the backward h W^T again, gz W and gz^T h (4)."""
    d = make_batch(2, 5, 17, H=7)
    counts = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", flag)
        counts[flag] = _count_gemms(lambda: _grads(d, dict(FULL, loss_agg="token-mean")))
    assert counts == {"1": 3, "0": 4}


def test_gspo_and_no_grad_take_two_pass_path(fused_calls):
    d = make_batch(seg_lens=[3, 6], V=23, H=9, bias=False)
    check_case(d, dict(shaping_m=0.05, importance_sampling_level="sequence", loss_agg="seq-mean-token-sum"))
    assert fused_calls and not any(fused_calls)
    x = {k: (v.requires_grad_(True) if k == "hidden" else v) for k, v in make_batch(2, 4, 9, H=5).items()}
    with torch.no_grad():
        loss_ng = rapo_fast.rapo_loss(**x, **FULL)
    assert fused_calls[-1] is False
    loss_f = rapo_fast.rapo_loss(**x, **FULL)
    assert fused_calls[-1] is True
    assert_close_verbose(loss_f.detach(), loss_ng, atol=1e-6, rtol=1e-5, name="loss")


def test_opcheck_fused_op():
    d = make_batch(2, 3, 10, H=6)
    n = 6
    f = torch.float32
    code = (d["loss_mask"].reshape(n)).to(f)
    tok, present = stack_token_inputs(
        old=d["old_logp"].reshape(n),
        adv=d["advantages"].reshape(n),
        w=torch.full((n,), 1.0 / n, dtype=f),
        scale=torch.ones(n, dtype=f),
        code=code,
        behav=d["behav_logp"].reshape(n),
        ref=d["ref_logp"].reshape(n),
    )
    opts = LossOptions(
        eps_low=0.2, eps_high=0.2, dual_clip=3.0, gamma=0.1, is_cap=2.0, tis_cap=1.5, beta=0.1, entropy_coef=0.01
    )
    leaves = [t.requires_grad_(True) for t in (d["hidden"].reshape(n, 6), d["weight"], d["bias"])]
    # the bool flags after the temperature: every gradient and output asked for
    args = (*leaves, d["targets"].reshape(n), tok, present, opts.kernel_scalars(), 0.9, *[True] * 5)
    torch.library.opcheck(torch.ops.rapo_fast.fused_linear_policy_loss.default, args)


def test_frozen_weight_and_strided_hidden(monkeypatch, fused_calls):
    """Only hidden needs a gradient (a frozen lm_head), hidden a non-contiguous view: same as the two-pass path."""
    torch.manual_seed(0)
    d = make_batch(3, 5, 21, H=6, bias=False)
    base = torch.randn(6, 3, 5, dtype=torch.float32)  # hidden as a permuted view [3, 5, 6]
    opts = dict(FULL, loss_agg="seq-mean-token-mean")
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", flag)
        hidden = base.clone().requires_grad_(True)
        x = dict(d, hidden=hidden.permute(1, 2, 0))
        assert not x["hidden"].is_contiguous()
        loss = rapo_fast.rapo_loss(**x, **opts)
        loss.backward()
        out[flag] = (loss.detach(), hidden.grad)
    assert fused_calls == [True, False]
    assert_close_verbose(out["1"][0], out["0"][0], atol=1e-6, rtol=1e-5, name="loss")
    assert_close_verbose(out["1"][1], out["0"][1], atol=1e-6, rtol=1e-5, name="grad hidden")


@pytest.mark.parametrize("layout", ["padded", "flat"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_from_logp_matches_reference(layout, agg):
    """policy_loss_from_logp (rapo_loss after its log-prob call) vs rapo_loss_ref(logp=...): loss, grads, metrics."""
    from rapo_fast.loss.policy_loss import policy_loss_from_logp
    from rapo_fast.reference import rapo_loss_ref, token_logprobs_ref

    d = (
        make_batch(3, 7, 11, per_seq_adv=True, masked_rows=(1,))
        if layout == "padded"
        else make_batch(seg_lens=[4, 0, 6], V=9)
    )
    lp, ent = token_logprobs_ref(d.pop("logits"), d.pop("targets"), 1.0, True)
    out = []
    for fn in (policy_loss_from_logp, rapo_loss_ref):
        x, e = lp.detach().clone().requires_grad_(True), ent.detach().clone().requires_grad_(True)
        loss, m = fn(x, entropy=e, **d, **FULL, loss_agg=agg, return_metrics=True)
        loss.backward()
        out.append((loss.detach(), m, {"logp": x.grad, "entropy": e.grad}))
    _assert_same(out[0], out[1], atol=1e-6, name="from_logp")
    with pytest.raises(ValueError, match="entropy"):
        policy_loss_from_logp(lp, **d, **FULL)
