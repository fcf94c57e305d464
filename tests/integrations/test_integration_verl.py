"""Tests of rapo_fast.integrations.verl without verl installed (it is heavy; not a dependency).

The expected values come from a re-statement of verl's own code, written below from the source read at
github.com/verl-project/verl, verl/trainer/ppo/core_algos.py (commit 018f23b5f83a13340421349e40ec42530739b23a):
`agg_loss` (with dp_size, batch_num_tokens, global_batch_size, loss_scale_factor), `compute_policy_loss_vanilla`
(clip_ratio_low/high, dual clip clip_ratio_c, log-ratio clamped to +-20, rollout_is_weights) and
`register_policy_loss`; and the truncated-IS branch of the older vanilla loss
(`if config.tis_imp_ratio_cap > 0 and rollout_log_probs is not None: pg_losses *= clamp(exp(old - rollout), max=cap)`),
as found in verl forks of the 0.5 era. verl_F.masked_sum / masked_mean are restated as (x * mask).sum() and
(x * mask).sum() / mask.sum().

Also tested: the adapter against rapo_fast.rapo_loss itself (RAPO extras on), registration into a stand-in
`verl.trainer.ppo.core_algos` module, and the fused log-prob helpers against plain torch.
Not tested: a real verl actor run (verl is not installed here).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from helpers import assert_close_verbose

import rapo_fast
from rapo_fast.integrations import verl as rv
from rapo_fast.integrations.verl.policy_loss import VERL_LOSS_AGG_MODES


# ------------------------------------------------------------------------- verl, restated (see module docstring)
def _masked_sum(x, m):
    return (x * m).sum()


def _masked_mean(x, m):
    return (x * m).sum() / m.sum()


def verl_agg_loss(
    loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = _masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = _masked_sum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = _masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = _masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    else:
        raise ValueError(loss_agg_mode)
    return loss


def verl_vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    rollout_log_probs=None,
):
    clip_ratio = config["clip_ratio"]
    low = config.get("clip_ratio_low") or clip_ratio
    high = config.get("clip_ratio_high") or clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = _masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    if config.get("tis_imp_ratio_cap", 0) > 0 and rollout_log_probs is not None:  # older verl
        tis = torch.clamp(torch.exp(old_log_prob - rollout_log_probs), max=config["tis_imp_ratio_cap"])
        pg_losses = pg_losses * tis
    loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode, **config.get("global_batch_info", {}))
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.item(),
    }
    return loss, metrics


# ------------------------------------------------------------------------------------------------------ inputs
class _ActorConfig:
    """Stand-in for verl's ActorConfig: attribute access plus `.get`, as compute_policy_loss_vanilla uses both."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def get(self, key, default=None):
        return self.__dict__.get(key, default)


def _batch(b=6, t=11, seed=0, dtype=torch.float32, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    if empty_row:
        lengths[-1] = 0
    mask = (torch.arange(t)[None] < lengths[:, None]).to(dtype)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    # spread log-ratios over [-1.5, 1.5] so that both clip bounds and the dual clip (c=3: log-ratio > 1.1) are hit
    logp = (old + (torch.rand(b, t, generator=g, dtype=dtype) - 0.5) * 3.0).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=dtype)
    # make sure every branch is present whatever the seed: row 0 (A < 0) has a token past the dual clip (ratio 4 > 3),
    # row 1 (A > 0) one past the upper clip bound
    adv[0], adv[1] = -abs(adv[0]) - 0.1, abs(adv[1]) + 0.1
    with torch.no_grad():
        logp[0, 0] = old[0, 0] + 1.4
        logp[1, 0] = old[1, 0] + 0.6
    adv = adv[:, None].expand(b, t) * mask
    return old, logp, adv.contiguous(), mask


MODES = list(VERL_LOSS_AGG_MODES)
INFOS = {
    "local": {},
    "dp2-global": {"dp_size": 2, "batch_num_tokens": 70, "global_batch_size": 13},
    "scale-factor": {"loss_scale_factor": 32},
}


def _check(got, want, lp_got, lp_want, name):
    assert_close_verbose(got, want, atol=1e-6, rtol=1e-5, name=f"{name} loss")
    (g_got,) = torch.autograd.grad(got, lp_got)
    (g_want,) = torch.autograd.grad(want, lp_want)
    scale = max(g_want.abs().max().item(), 1e-30)
    assert g_want.abs().max() > 0
    assert_close_verbose(g_got, g_want, atol=1e-6 * scale, rtol=1e-5, name=f"{name} grad")


@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weights", [False, True])
def test_matches_verl_vanilla(mode, info, weights):
    torch.manual_seed(0)
    old, logp, adv, mask = _batch(seed=100 * MODES.index(mode) + 10 * list(INFOS).index(info) + int(weights))
    cfg = dict(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info=dict(INFOS[info])
    )
    w = torch.rand(mask.shape) * 2 if weights else None
    lp2 = logp.detach().clone().requires_grad_(True)
    want, want_m = verl_vanilla(old, lp2, adv, mask, mode, cfg, rollout_is_weights=w)
    got, got_m = rv.rapo_policy_loss(old, logp, adv, mask, mode, _ActorConfig(**cfg), w)
    _check(got, want, logp, lp2, f"{mode}/{info}")
    # the inputs reach both clip bounds and the dual clip, or the comparison would not cover them
    assert want_m["actor/pg_clipfrac"] > 0 and want_m["actor/pg_clipfrac_lower"] > 0
    if not weights:  # verl computes its metrics before the rollout weights; so do we, but w = 0 tokens differ
        for key, value in want_m.items():
            assert got_m[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.parametrize("mode", MODES)
def test_matches_older_verl_truncated_is(mode):
    old, logp, adv, mask = _batch(seed=11)
    rollout = old + 0.4 * torch.randn(old.shape)
    cfg = dict(clip_ratio=0.2, clip_ratio_c=3.0, tis_imp_ratio_cap=1.5, global_batch_info={})
    lp2 = logp.detach().clone().requires_grad_(True)
    want, _ = verl_vanilla(old, lp2, adv, mask, mode, cfg, rollout_log_probs=rollout)
    got, _ = rv.rapo_policy_loss(old, logp, adv, mask, mode, cfg, rollout_log_probs=rollout)
    _check(got, want, logp, lp2, f"tis/{mode}")


def test_float64_exact():
    old, logp, adv, mask = _batch(seed=5, dtype=torch.float64)
    cfg = dict(clip_ratio=0.2, global_batch_info={})
    lp2 = logp.detach().clone().requires_grad_(True)
    want, _ = verl_vanilla(old, lp2, adv, mask, "seq-mean-token-mean", cfg)
    got, _ = rv.rapo_policy_loss(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    assert got.dtype == torch.float64
    assert_close_verbose(got, want, atol=1e-12, rtol=1e-7, name="fp64 loss")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_rapo_extras_equal_rapo_loss(mode):
    """With retrieval and shaping on, the adapter (given log-probs) equals rapo_fast.rapo_loss (given logits)."""
    torch.manual_seed(3)
    b, t, v = 4, 9, 53
    logits = torch.randn(b, t, v, requires_grad=True)
    targets = torch.randint(0, v, (b, t))
    mask = torch.ones(b, t)
    mask[1, 6:] = 0
    retrieved = torch.zeros(b, t, dtype=torch.bool)
    retrieved[0, 2:5] = True
    retrieved[2, :3] = True
    adv = torch.randn(b)[:, None].expand(b, t).contiguous()
    with torch.no_grad():
        old = rapo_fast.token_logprobs(logits, targets=targets) + 0.3 * torch.randn(b, t)
    opts = dict(shaping_m=0.5, offpolicy_train="shaped", gamma=0.1)
    logp = rapo_fast.token_logprobs(logits, targets=targets)
    got, _ = rv.rapo_policy_loss(
        old, logp, adv, mask, mode, dict(clip_ratio=0.2, clip_ratio_c=3.0), retrieved_mask=retrieved, **opts
    )
    (g_got,) = torch.autograd.grad(got, logits)
    agg, norm, _ = rv.verl_normaliser(mask, mode)
    want = rapo_fast.rapo_loss(
        logits,
        targets=targets,
        old_logp=old,
        advantages=adv,
        loss_mask=mask.bool(),
        retrieved_mask=retrieved,
        response_mask=mask.bool(),
        eps_low=0.2,
        eps_high=0.2,
        dual_clip=3.0,
        loss_agg=agg,
        global_num_tokens=norm,
        **opts,
    )
    (g_want,) = torch.autograd.grad(want, logits)
    assert_close_verbose(got, want, atol=1e-6, rtol=1e-5, name="loss")
    assert_close_verbose(g_got, g_want, atol=1e-6, rtol=1e-4, name="grad logits")
    # shaping really acts: without it the loss moves
    plain, _ = rv.rapo_policy_loss(
        old, logp.detach(), adv, mask, mode, {"clip_ratio": 0.2}, retrieved_mask=retrieved, offpolicy_train="shaped"
    )
    assert (plain - got.detach()).abs() > 1e-6


def test_bad_arguments_raise():
    old, logp, adv, mask = _batch(seed=2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        rv.rapo_policy_loss(old, logp, adv, mask, "seq-sum", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match="batch_num_tokens"):
        rv.rapo_policy_loss(
            old, logp, adv, mask, "token-mean", {"clip_ratio": 0.2, "global_batch_info": {"dp_size": 2}}
        )
    with pytest.raises(ValueError, match="global_batch_size"):
        rv.rapo_policy_loss(
            old, logp, adv, mask, "seq-mean-token-mean", {"clip_ratio": 0.2, "global_batch_info": {"dp_size": 2}}
        )
    with pytest.raises(ValueError, match="clip_ratio_c"):
        rv.rapo_policy_loss(old, logp, adv, mask, "token-mean", {"clip_ratio": 0.2, "clip_ratio_c": 1.0})
    with pytest.raises(TypeError, match="unknown option"):
        rv.rapo_policy_loss(old, logp, adv, mask, "token-mean", {"clip_ratio": 0.2}, shaping=0.1)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        rv.rapo_policy_loss(old, logp, adv, mask, "token-mean", {"clip_ratio": 0.2}, tis_cap=2.0)


def test_registers_into_verl_registry(monkeypatch):
    """With a module at verl.trainer.ppo.core_algos (restated register_policy_loss), register_rapo_policy_loss
    registers the loss under the given name."""
    registry = {}

    def register_policy_loss(name):
        def decorator(func):
            registry[name] = func
            return func

        return decorator

    names = ["verl", "verl.trainer", "verl.trainer.ppo", "verl.trainer.ppo.core_algos"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    core = sys.modules["verl.trainer.ppo.core_algos"]
    core.register_policy_loss, core.POLICY_LOSS_REGISTRY = register_policy_loss, registry
    for parent, child in zip(names[:-1], names[1:]):
        setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
    try:
        rv.register_rapo_policy_loss("rapo")
        assert "rapo" in registry
        rv.register_rapo_policy_loss("rapo_shaped", shaping_m=0.05)
        old, logp, adv, mask = _batch(seed=4)
        cfg = {"clip_ratio": 0.2, "global_batch_info": {}}
        # verl's actor calls it positionally, with rollout_is_weights as the 7th argument
        got, metrics = registry["rapo"](old, logp, adv, mask, "token-mean", cfg, None)
        want, _ = verl_vanilla(old, logp, adv, mask, "token-mean", cfg)
        assert_close_verbose(got, want, atol=1e-6, rtol=1e-5, name="registered loss")
        assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
        got2, _ = registry["rapo_shaped"](old, logp, adv, mask, "token-mean", cfg, None)
        assert_close_verbose(got2, want, atol=1e-6, rtol=1e-5, name="no retrieval: shaping is a no-op")
    finally:
        monkeypatch.undo()


# ------------------------------------------------------------------------------------------ fused log-prob helpers
def _naive(hidden, weight, labels, temperature):
    logits = (hidden.float() @ weight.float().T) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


@pytest.mark.parametrize("shape", [(2, 5), (1, 9), (1, 1)])
def test_fused_logprobs_from_hidden_matches_torch(shape):
    torch.manual_seed(0)
    h_dim, v = 37, 131  # H odd, V not a multiple of any block
    hidden = torch.randn(*shape, h_dim, requires_grad=True)
    weight = (torch.randn(v, h_dim) * 0.3).requires_grad_(True)
    labels = torch.randint(0, v, shape)
    logp, ent = rv.fused_logprobs_from_hidden(hidden, weight, labels, temperature=0.7)
    assert logp.shape == labels.shape and logp.dtype == torch.float32
    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    want_lp, want_ent = _naive(h2, w2, labels, 0.7)
    assert_close_verbose(logp, want_lp, atol=1e-5, rtol=1e-5, name="logp")
    assert_close_verbose(ent, want_ent, atol=1e-5, rtol=1e-5, name="entropy")
    up = torch.randn(shape)  # a non-uniform upstream gradient (docs/pitfalls.md #7)
    (logp * up).sum().backward()
    (want_lp * up).sum().backward()
    assert_close_verbose(hidden.grad, h2.grad, atol=1e-5, rtol=1e-4, name="grad hidden")
    assert_close_verbose(weight.grad, w2.grad, atol=1e-5, rtol=1e-4, name="grad weight")
    # the module form has verl's FusedLinearForPPO.forward signature and returns the same
    m_lp, m_ent = rv.RAPOFusedLinearForPPO()(hidden.detach(), weight.detach(), labels, 0.7)
    assert_close_verbose(m_lp, logp, atol=1e-6, name="module logp")
    assert_close_verbose(m_ent, ent, atol=1e-6, name="module entropy")


def test_logprobs_from_logits_matches_torch():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 67, requires_grad=True)
    labels = torch.randint(0, 67, (3, 4))
    logp, ent = rv.logprobs_from_logits(logits, labels, temperature=1.3, return_entropy=True)
    want = torch.log_softmax(logits.detach() / 1.3, -1)
    assert_close_verbose(logp, want.gather(-1, labels[..., None])[..., 0], atol=1e-5, name="logp")
    assert_close_verbose(ent, -(want.exp() * want).sum(-1), atol=1e-5, name="entropy")
    only = rv.logprobs_from_logits(logits, labels)
    assert only.shape == labels.shape


def test_fused_logprobs_shape_mismatch_raises():
    with pytest.raises(ValueError, match="input_ids"):
        rv.fused_logprobs_from_hidden(torch.randn(2, 5, 8), torch.randn(11, 8), torch.zeros(2, 4, dtype=torch.long))
