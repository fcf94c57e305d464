"""Property tests of the loss entry points: `rapo_loss`, `token_logprobs`, `RAPOLoss` (hypothesis; budget in
tests/helpers/strategies.py).

Properties: finite inputs give a finite loss and finite gradients within the tolerance rule of the float64 reference
(docs/testing.md rule 1, via tests/helpers/loss_cases.check_case); masked tokens contribute exactly nothing whatever
their logits or hidden rows and per-token inputs hold; a bad option or normaliser gets a ValueError/TypeError naming
it, before any kernel runs; RAPOLoss equals rapo_loss with the same options. Not here: the hand-written argument
cases (tests/loss/test_loss_checks.py, test_logprobs_ops.py) and kernel tile coverage.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.loss_cases import AGG_MODES, check_case, make_batch
from helpers.strategies import NON_FINITE, fuzz_settings, seeds
from hypothesis import given
from hypothesis import strategies as st

import rapo_fast
from rapo_fast.loss import policy_loss as loss_mod
from rapo_fast.reference import token_logprobs_ref

# Valid values per option (rapo_fast/loss/options.py states the ranges).
OPTION_VALUES = {
    "shaping_m": st.sampled_from([0.0, 0.3, -0.5]),
    "offpolicy_train": st.sampled_from(["none", "shaped", "truncated"]),
    "gamma": st.sampled_from([0.1, 1.0]),
    "is_cap": st.sampled_from([2.0, 0.5]),
    "tis_cap": st.sampled_from([None, 2.0]),
    "eps_low": st.sampled_from([0.2, 0.0, 1.0]),
    "eps_high": st.sampled_from([0.2, 0.28, 0.0]),
    "dual_clip": st.sampled_from([None, 3.0]),
    "importance_sampling_level": st.sampled_from(["token", "sequence"]),
    "beta": st.sampled_from([0.0, 0.04]),
    "kl_estimator": st.sampled_from(["k1", "k2", "k3"]),
    "kl_clamp": st.booleans(),
    "entropy_coef": st.sampled_from([0.0, 0.01]),
    "temperature": st.sampled_from([1.0, 0.7, 1.5]),
    "loss_agg": st.sampled_from(AGG_MODES),
}
# Out-of-range values per option (each option must refuse it with its name in the message).
BAD_OPTION_VALUES = {
    "shaping_m": [-1.0, -2.0, math.nan],
    "gamma": [0.0, -1.0, math.inf],
    "is_cap": [0.0, math.nan],
    "eps_low": [-0.1, 1.5],
    "eps_high": [-0.1, math.nan],
    "dual_clip": [1.0, 0.5],
    "temperature": [0.0, -1.0, math.inf, math.nan],
    "offpolicy_train": ["", "Shaped", 3],
    "loss_agg": ["mean", None],
    "kl_estimator": ["k4"],
    "importance_sampling_level": ["seq"],
}


# Unbounded families of bad values, for the options with a numeric range.
BAD_OPTION_RANGES = {
    "shaping_m": st.floats(max_value=-1.0),
    "gamma": st.floats(max_value=0.0),
    "is_cap": st.floats(max_value=0.0),
    "eps_low": st.floats(max_value=-1e-9) | st.floats(min_value=1.0 + 1e-9),
    "temperature": st.floats(max_value=0.0),
    "offpolicy_train": st.text(max_size=6).filter(lambda t: t not in ("none", "shaped", "truncated")),
    "importance_sampling_level": st.text(max_size=8).filter(lambda t: t not in ("token", "sequence")),
    "kl_estimator": st.text(max_size=8).filter(lambda t: t not in ("k1", "k2", "k3")),
    "loss_agg": st.text(max_size=8).filter(lambda t: not t.startswith(("token-", "seq-"))),
}


@st.composite
def option_sets(draw) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), unique=True, max_size=5))
    return {n: draw(OPTION_VALUES[n]) for n in names}


@fuzz_settings(25)
@given(
    B=st.integers(1, 3),
    T=st.integers(1, 5),
    seg_lens=st.none() | st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(lambda x: sum(x) > 0),
    V=st.integers(1, 9),
    per_seq=st.booleans(),
    mask_p=st.sampled_from([0.0, 0.5, 1.0]),
    opts=option_sets(),
    seed=seeds,
)
def test_rapo_loss_matches_float64_reference(B, T, seg_lens, V, per_seq, mask_p, opts, seed):
    """Padded [B, T] or flat (seg_lens: cu_seqlens, empty segments included)."""
    d = make_batch(B, T, V, seg_lens=seg_lens, per_seq_adv=per_seq, mask_p=mask_p, seed=seed % 2**16)
    check_case(d, opts)  # finite loss, gradients within the tolerance rule of the float64 reference


@fuzz_settings(20)
@given(
    B=st.integers(1, 3),
    T=st.integers(2, 4),
    V=st.integers(2, 37),
    hidden=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    fill=st.sampled_from([-math.inf, math.nan, math.inf, 1e30]),
    opts=option_sets(),
    seed=seeds,
)
def test_masked_tokens_contribute_nothing_whatever_their_rows(B, T, V, hidden, dtype, fill, opts, seed):
    """Masked tokens holding `fill` in their logits or hidden row and NaN in their per-token inputs: the loss and
    gradients of the clean batch, exactly, the masked rows' gradient 0."""
    d = make_batch(B, T, V, H=8 if hidden else None, mask_p=1.0, seed=seed % 2**16)
    g = torch.Generator().manual_seed(seed)
    masked = torch.rand(B, T, generator=g) < 0.4
    masked[0, 0] = True  # at least one masked token; an all-masked row is a padding row
    d["loss_mask"] = d["loss_mask"] & ~masked
    row, leaves = ("hidden", ["hidden", "weight", "bias"]) if hidden else ("logits", ["logits"])
    clean = {k: v.clone() for k, v in d.items()}
    d[row][masked] = fill
    for k in ("old_logp", "advantages", "behav_logp", "ref_logp"):
        d[k][masked] = math.nan
    out = []
    for case in (d, clean):
        x = {k: case[k].to(dtype).requires_grad_(True) for k in leaves}
        loss = rapo_fast.rapo_loss(**{**case, **x}, **opts)
        out.append((loss, torch.autograd.grad(loss, list(x.values()))))
    (loss, grads), (loss0, grads0) = out
    assert torch.isfinite(loss), "masked tokens' rows made the loss non-finite"
    assert all(torch.isfinite(gr).all() for gr in grads), "masked tokens' rows produced a non-finite gradient"
    assert torch.all(grads[0][masked] == 0), "a masked token got a gradient"
    torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
    for gr, gr0 in zip(grads, grads0):
        torch.testing.assert_close(gr, gr0, rtol=0, atol=0)


@fuzz_settings(20)
@given(value=st.sampled_from([0.0, *NON_FINITE]) | st.floats(max_value=-1e-30), as_tensor=st.booleans())
def test_bad_global_num_tokens_is_refused(value, as_tensor):
    d = make_batch(2, 3, 5)
    g = torch.tensor(value) if as_tensor else value
    with pytest.raises((ValueError, TypeError), match="global_num_tokens"):
        rapo_fast.rapo_loss(**d, global_num_tokens=g)


@fuzz_settings(25)
@given(name=st.sampled_from(sorted(BAD_OPTION_VALUES)), data=st.data())
def test_bad_option_is_refused_with_its_name(name, data, monkeypatch):
    value = data.draw(st.sampled_from(BAD_OPTION_VALUES[name]) | BAD_OPTION_RANGES.get(name, st.nothing()))
    d = make_batch(2, 3, 5)
    for kernel in ("_run_logprobs", "policy_loss_op"):  # refused before any kernel runs
        monkeypatch.setattr(loss_mod, kernel, lambda *a, **k: pytest.fail("a kernel ran before validation finished"))
    exc = ValueError if isinstance(value, (str, float)) else TypeError  # a value out of range, or of the wrong type
    with pytest.raises(exc, match=name):
        rapo_fast.rapo_loss(**d, **{name: value})
    with pytest.raises(exc, match=name):
        rapo_fast.RAPOLoss(**{name: value})


@fuzz_settings(25)
@given(
    lead=st.sampled_from([(1,), (4,), (2, 3)]),
    V=st.integers(1, 17),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    temperature=st.sampled_from([1.0, 0.5, 2.0]),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
    seed=seeds,
)
def test_token_logprobs_match_float64(lead, V, dtype, temperature, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, V, generator=g) * scale).to(dtype)
    targets = torch.randint(0, V, lead, generator=g)
    logp, ent = rapo_fast.token_logprobs(logits, targets=targets, temperature=temperature, return_entropy=True)
    ref_lp, ref_ent = token_logprobs_ref(logits.double(), targets, temperature, True)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    # the logits are exact in `dtype`; the kernel computes in fp32 from them: fp32 rounding of a log-sum-exp
    torch.testing.assert_close(logp.double(), ref_lp, atol=1e-5 * (1 + scale), rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5 * (1 + scale), rtol=1e-5)


@fuzz_settings(20)
@given(
    preset=st.sampled_from([None, "RAPO", "GRPO", "ARPO"]),
    opts=option_sets(),
    seed=seeds,
)
def test_rapoloss_module_equals_function(preset, opts, seed):
    d = make_batch(2, 4, 6, seed=seed % 2**16)
    if preset is not None and preset not in dir(rapo_fast.presets):
        pytest.skip(f"no preset {preset}")
    mod = rapo_fast.RAPOLoss(preset, **opts)
    full = dict(mod.options)
    full.pop("return_metrics", None)
    want = rapo_fast.rapo_loss(**d, **full)
    got = mod(**d)
    assert torch.isfinite(got)
    assert torch.equal(got, want)
