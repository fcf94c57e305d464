"""rapo_loss option semantics against values computed by hand in the test (from log_softmax of the logits), every
preset (kernel vs reference vs fp64), RAPOLoss and preset plumbing, and the metrics on hand-computable cases.

Each hand check builds a situation whose answer follows from the formulas in a line or two (ratio 1, ratio 2, only
retrieved tokens in the loss, zero advantages, ...). Not here: the broad kernel-vs-reference matrix (test_loss.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import check_case, make_batch

import rapo_fast
from rapo_fast.loss import presets

B, T, V = 3, 5, 7


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 2).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits.detach().double(), -1).gather(-1, targets[..., None])[..., 0]
    adv = torch.randn(B, T, generator=g)
    lm = torch.ones(B, T, dtype=torch.bool)
    return logits, targets, logp, adv, lm


def _loss(logits, targets, old, adv, lm, **kw):
    return rapo_fast.rapo_loss(logits, targets=targets, old_logp=old.float(), advantages=adv, loss_mask=lm, **kw)


def test_ratio_one_is_minus_mean_advantage_and_metrics():
    logits, targets, logp, adv, lm = _setup()
    loss, m = _loss(logits, targets, logp, adv, lm, return_metrics=True)
    assert_close_verbose(loss, -adv.double().mean(), atol=1e-6)
    assert_close_verbose(m.ratio_mean, torch.tensor(1.0), atol=1e-6)
    for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "kl", "retrieved_frac", "num_offpolicy_tokens"):
        assert getattr(m, k) == 0, k
    assert_close_verbose(m.approx_kl, torch.tensor(0.0), atol=1e-6)
    assert m.num_tokens == B * T and m.tis_weight_mean == 1
    p = torch.softmax(logits.detach().double(), -1)
    assert_close_verbose(m.entropy, -(p * p.log()).sum(-1).mean(), atol=1e-5)
    # gradient: d(-A r)/dlogits = -A/N (onehot - softmax) at ratio 1
    (g,) = torch.autograd.grad(loss, logits)
    onehot = torch.nn.functional.one_hot(targets, V).double()
    assert_close_verbose(g, -adv.double()[..., None] / (B * T) * (onehot - p), atol=1e-6)


def test_ratio_two_clip_high_pessimistic_low_and_dual_clip():
    logits, targets, logp, adv, lm = _setup()
    old = logp - math.log(2.0)  # r = 2 everywhere
    a = adv.double()
    loss, m = _loss(logits, targets, old, adv, lm, eps_low=0.2, eps_high=0.28, return_metrics=True)
    want = torch.where(a > 0, -1.28 * a, -2.0 * a).mean()
    assert_close_verbose(loss, want, atol=1e-5)
    assert_close_verbose(m.clip_frac_high, (a > 0).double().mean(), atol=1e-6)
    assert m.clip_frac_low == 0 and m.dual_clip_frac == 0
    assert_close_verbose(m.ratio_mean, torch.tensor(2.0), atol=1e-5)
    assert_close_verbose(m.approx_kl, torch.tensor(-math.log(2.0)), atol=1e-5)  # mean(old - logp)
    loss, m = _loss(logits, targets, old, adv, lm, eps_low=0.2, eps_high=0.28, dual_clip=1.5, return_metrics=True)
    assert_close_verbose(loss, torch.where(a > 0, -1.28 * a, -1.5 * a).mean(), atol=1e-5)
    assert_close_verbose(m.dual_clip_frac, (a < 0).double().mean(), atol=1e-6)
    # ratio 1/2: A < 0 tokens clip at 1 - eps_low. old_logp = logp + log 2 is a log-prob (<= 0, as rapo_loss
    # requires) only where p <= 1/2: those tokens form the loss
    old, ok = logp + math.log(2.0), logp + math.log(2.0) <= 0
    loss, m = _loss(logits, targets, old, adv, ok, eps_low=0.2, return_metrics=True)
    assert_close_verbose(loss, torch.where(a > 0, -0.5 * a, -0.8 * a)[ok].mean(), atol=1e-5)
    assert_close_verbose(m.clip_frac_low, (a < 0)[ok].double().mean(), atol=1e-6)


def test_rapo_shaping_scales_ratio_by_retrieved_fraction():
    logits, targets, logp, adv, lm = _setup()
    ret = torch.zeros(B, T, dtype=torch.bool)
    ret[0, :2] = True  # F = 2/5 in row 0, 0 elsewhere
    ret[2, 4] = True  # F = 1/5
    F = ret.double().sum(1, keepdim=True) / T
    on = ~ret
    kw = dict(retrieved_mask=ret, shaping_m=0.5, eps_low=0.9, eps_high=9.0)
    loss, m = _loss(logits, targets, logp, adv, lm, **kw, return_metrics=True)
    want = (-(adv.double() * (1 + 0.5 * F))[on]).sum() / on.sum()
    assert_close_verbose(loss, want, atol=1e-6)
    assert_close_verbose(m.retrieved_frac, torch.tensor(3 / (B * T)), atol=1e-7)
    # response_mask changes F's denominator only
    resp = torch.ones(B, T, dtype=torch.bool)
    resp[0, 3:] = False  # row 0: F = 2/3
    F2 = F.clone()
    F2[0] = 2 / 3
    loss2 = _loss(logits, targets, logp, adv, lm, **kw, response_mask=resp)
    assert_close_verbose(loss2, (-(adv.double() * (1 + 0.5 * F2))[on]).sum() / on.sum(), atol=1e-6)


def test_retrieved_tokens_get_no_gradient_by_default():
    logits, targets, logp, adv, lm = _setup()
    ret = torch.rand(B, T) < 0.4
    kw = dict(retrieved_mask=ret, shaping_m=0.05, beta=0.1, ref_logp=logp.float() + 0.2, entropy_coef=0.01)
    loss = _loss(logits, targets, logp - 0.3, adv, lm, **kw)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.count_nonzero(g[ret]) == 0 and torch.count_nonzero(g[~ret]) > 0


@pytest.mark.parametrize("mode", ["shaped", "truncated"])
def test_offpolicy_modes_by_hand(mode):
    logits, targets, logp, adv, _ = _setup()
    ret = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) < 0.5
    behav = logp - 0.5 + torch.rand(B, T, dtype=torch.float64)
    a, p = adv.double(), logp.exp()
    kw = dict(retrieved_mask=ret, offpolicy_train=mode, gamma=0.1, is_cap=1.3, behav_logp=behav.float())
    loss, m = _loss(logits, targets, logp, adv, ret, **kw, return_metrics=True)
    n = ret.sum()
    if mode == "shaped":
        wgt = p / (p + 0.1)
        want = (-a * wgt)[ret].sum() / n
        dlogp = -a * 0.1 * p / (p + 0.1) ** 2 / n
    else:
        wgt = torch.exp(logp - behav).clamp(max=1.3)
        want = (-a * wgt * logp)[ret].sum() / n
        dlogp = -a * wgt / n  # the weight is detached
    assert_close_verbose(loss, want, atol=1e-5)
    assert_close_verbose(m.offpolicy_weight_mean, wgt[ret].mean(), atol=1e-5)
    assert m.num_offpolicy_tokens == n and m.num_tokens == n
    (g,) = torch.autograd.grad(loss, logits)
    sm = torch.softmax(logits.detach().double(), -1)
    onehot = torch.nn.functional.one_hot(targets, V).double()
    want_g = torch.where(ret[..., None], dlogp[..., None] * (onehot - sm), torch.zeros_like(sm))
    assert_close_verbose(g, want_g, atol=1e-6)


def test_tis_weight_multiplies_policy_term():
    logits, targets, logp, adv, lm = _setup()
    behav = logp + 0.6 * torch.randn(B, T, dtype=torch.float64)
    w = torch.exp(logp - behav).clamp(max=1.2)
    loss, m = _loss(logits, targets, logp, adv, lm, tis_cap=1.2, behav_logp=behav.float(), return_metrics=True)
    assert_close_verbose(loss, (-adv.double() * w).mean(), atol=1e-5)
    assert_close_verbose(m.tis_weight_mean, w.mean(), atol=1e-5)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_by_hand(est):
    logits, targets, logp, _, lm = _setup()
    ref = logp + 0.5 * torch.randn(B, T, dtype=torch.float64)
    d = logp - ref
    kl = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[est]
    zero = torch.zeros(B, T)
    loss, m = _loss(
        logits, targets, logp, zero, lm, beta=0.3, kl_estimator=est, ref_logp=ref.float(), return_metrics=True
    )
    assert_close_verbose(loss, 0.3 * kl.mean(), atol=1e-5)
    assert_close_verbose(m.kl, kl.mean(), atol=1e-5)


def test_k3_is_clamped_and_log_ratios_are_clamped():
    logits, targets, logp, adv, lm = _setup()
    far = logp + 50.0  # exp(50) would overflow fp32 without verl's +-20 clamps
    # old_logp 50 below logp (a log-prob must be <= 0): log-ratio +50 for the ratio, -50 for the KL's ref - logp
    loss, m = _loss(logits, targets, logp - 50.0, adv, lm, beta=1.0, ref_logp=far.float(), return_metrics=True)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.scalars().values())
    assert_close_verbose(m.kl, torch.tensor(10.0), atol=0)  # k3 clamped at 10
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(g).all()
    check_case(make_batch(2, 4, 5, spread=40.0), dict(beta=0.2, kl_estimator="k3", tis_cap=3.0))


def test_k3_unclamped_is_trls_k3():
    """kl_clamp=False: k3 = e^x - x - 1 past 10 (TRL's), with its gradient; kernels and torch path agree."""
    logits, targets, logp, _, lm = _setup()
    ref = logp + 3.0 + 0.1 * torch.randn(B, T, dtype=torch.float64)  # k3 ~ e^3 - 4 = 16.1 > verl's clamp
    x = ref - logp
    zero = torch.zeros(B, T)
    for clamp, kl in ((False, torch.exp(x) - x - 1), (True, torch.full_like(x, 10.0))):
        lg = logits.clone().requires_grad_(True)
        loss, m = _loss(
            lg, targets, logp, zero, lm, beta=0.3, ref_logp=ref.float(), kl_clamp=clamp, return_metrics=True
        )
        assert_close_verbose(m.kl, kl.mean(), atol=1e-4, rtol=1e-5, name=f"kl clamp={clamp}")
        (g,) = torch.autograd.grad(loss, lg)
        assert (g.abs().max() > 0) != clamp  # clamped: no gradient through the KL past 10
    for est in ("k3", "k1"):  # k1 / k2 ignore kl_clamp
        check_case(make_batch(2, 4, 5, spread=6.0), dict(beta=0.2, kl_estimator=est, kl_clamp=False))


def test_entropy_bonus_by_hand():
    logits, targets, logp, _, lm = _setup()
    lm[1, 2:] = False
    loss, m = _loss(logits, targets, logp, torch.zeros(B, T), lm, entropy_coef=0.05, return_metrics=True)
    p = torch.softmax(logits.detach().double(), -1)
    H = -(p * p.log()).sum(-1)
    assert_close_verbose(loss, -0.05 * H[lm].mean(), atol=1e-6)
    assert_close_verbose(m.entropy, H[lm].mean(), atol=1e-5)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.count_nonzero(g[~lm]) == 0


def test_gspo_sequence_ratio_by_hand():
    logits, targets, logp, adv, lm = _setup()
    shift = torch.randn(B, T, dtype=torch.float64) * 0.01
    a = adv[:, 0].double()
    agg = dict(loss_agg="seq-mean-token-mean")
    clip = dict(eps_low=0.5, eps_high=0.5)
    seq = _loss(logits, targets, logp - shift, adv[:, 0], lm, importance_sampling_level="sequence", **clip, **agg)
    s = torch.exp(shift.mean(1))
    assert_close_verbose(seq, (-a * s).mean(), atol=1e-6)
    # rows whose log-ratio is constant: the sequence ratio equals the token ratio, values and gradients
    const = (torch.randn(B, 1, dtype=torch.float64) * 0.05).expand(B, T)
    l_seq, l_tok = (
        _loss(logits, targets, logp - const, adv[:, 0], lm, importance_sampling_level=level, **agg)
        for level in ("sequence", "token")
    )
    assert_close_verbose(l_seq, l_tok, atol=1e-6)
    g_seq, g_tok = (torch.autograd.grad(x, logits)[0] for x in (l_seq, l_tok))
    assert_close_verbose(g_seq, g_tok, atol=1e-6)


def test_aggregation_modes_by_hand():
    logits, targets, logp, adv, lm = _setup()
    lm[0, 3:] = False
    lm[2] = False  # an all-masked row: excluded from the sequence count
    a = adv.double() * lm
    n = lm.sum(1).double()
    seq_means = (a.sum(1)[n > 0] / n[n > 0]).sum()
    # (the loss, the loss with global_num_tokens=4) of each mode; 2 sequences with tokens
    want = {
        "token-mean": (-a.sum() / lm.sum(), -a.sum() / 4),
        "seq-mean-token-mean": (-seq_means / 2, -seq_means / 4),
        "seq-mean-token-sum": (-a.sum() / 2, -a.sum() / 4),
        "seq-mean-token-sum-norm": (-a.sum() / T, -a.sum() / 4),
    }
    for agg, (w, w_global) in want.items():
        assert_close_verbose(_loss(logits, targets, logp, adv, lm, loss_agg=agg), w, atol=1e-6, name=agg)
        g = _loss(logits, targets, logp, adv, lm, loss_agg=agg, global_num_tokens=4)
        assert_close_verbose(g, w_global, atol=1e-6, name=f"{agg} global")
    # flat input: the sum-norm constant is the longest segment
    flat = [x.reshape(B * T, -1).squeeze(-1) for x in (logits, targets, logp, adv, lm)]
    loss = _loss(*flat, cu_seqlens=torch.tensor([0, 4, 5, 15]), loss_agg="seq-mean-token-sum-norm")
    assert_close_verbose(loss, -a.sum() / 10, atol=1e-6)


@pytest.mark.parametrize("name", ["GRPO", "DAPO", "DR_GRPO", "GSPO", "RAPO", "ARPO"])
@pytest.mark.parametrize("layout", ["padded", "flat"])
def test_every_preset_kernel_vs_reference(name, layout):
    d = make_batch(3, 6, 9, per_seq_adv=True) if layout == "padded" else make_batch(seg_lens=[6, 2, 5], V=9)
    opts = presets.get(name)
    if opts.get("beta", 0) == 0:
        d.pop("ref_logp")
    d.pop("behav_logp")
    check_case(d, opts)


def test_preset_contents():
    assert isinstance(presets.RAPO, dict)
    assert presets.RAPO["shaping_m"] == 0.05 and presets.RAPO["eps_low"] == presets.RAPO["eps_high"] == 0.28
    assert presets.RAPO["beta"] == 0 and presets.RAPO["loss_agg"] == "seq-mean-token-mean"
    assert presets.RAPO["offpolicy_train"] == "none"
    assert presets.GSPO["importance_sampling_level"] == "sequence"
    assert presets.DAPO["eps_high"] > presets.DAPO["eps_low"] and presets.DAPO["loss_agg"] == "token-mean"
    assert presets.DR_GRPO["loss_agg"] == "seq-mean-token-sum-norm"
    from rapo_fast.loss.policy_loss import OPTION_DEFAULTS

    for name, p in presets.PRESETS.items():
        assert set(p) <= set(OPTION_DEFAULTS), name
    assert rapo_fast.loss.presets is presets
    assert presets.get("dr.grpo") == presets.DR_GRPO and presets.get("rapo") is not presets.RAPO
    with pytest.raises(ValueError, match="preset"):
        presets.get("PPO2")
    with pytest.raises(TypeError, match="preset"):
        presets.get(3)


def test_module_equals_functional_and_overrides():
    d = make_batch(2, 5, 7, per_seq_adv=True)
    d.pop("ref_logp")
    mod = rapo_fast.RAPOLoss(preset="RAPO", eps_high=0.3)
    assert mod.options["eps_high"] == 0.3 and mod.options["shaping_m"] == 0.05
    assert "shaping_m=0.05" in repr(mod)
    want = rapo_fast.rapo_loss(**d, **dict(presets.RAPO, eps_high=0.3))
    assert torch.equal(mod(**d), want)
    loss, metrics = mod(**d, return_metrics=True)
    assert torch.equal(loss, want) and "clip_frac_high" in metrics.scalars()
    mod2 = rapo_fast.RAPOLoss(preset=dict(presets.GSPO), return_metrics=True)
    assert isinstance(mod2(**d), tuple)
    with pytest.raises(TypeError, match="unknown option"):
        rapo_fast.RAPOLoss(eps=0.2)
    with pytest.raises(TypeError, match="constructor options"):
        mod(**d, eps_low=0.1)
    with pytest.raises(ValueError, match="preset"):
        rapo_fast.RAPOLoss(preset="nope")
