"""rapo_loss argument checks: every kind of bad input raises ValueError/TypeError naming the argument, before any
log-prob or loss kernel runs (both are replaced by a tripwire here), except a bad logits row on a token in the loss,
which is refused from the log-prob pass's output (test_logits_row_check.py); hypothesis fuzzes single corruptions of
a valid call.
Not here: numerical behaviour (test_loss*.py); the shared helpers in rapo_fast/_checks.py are exercised through here.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.loss_cases import make_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rapo_fast
from rapo_fast.loss import policy_loss as loss_mod


@pytest.fixture
def tripwire(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel ran before validation finished")

    monkeypatch.setattr(loss_mod, "_run_logprobs", boom)
    monkeypatch.setattr(loss_mod, "policy_loss_op", boom)


def _valid(flat=False, hidden=False):
    d = (
        make_batch(seg_lens=[3, 2], V=5, H=4 if hidden else None)
        if flat
        else make_batch(2, 3, 5, H=4 if hidden else None)
    )
    d.pop("ref_logp")
    d.pop("behav_logp")
    return d


def _set_in_loss(d, pos, name, value):
    """Set token `pos` of tensor `name` (its whole logits row for logits) to `value` and put the token in the loss."""
    d[name][pos] = value
    d["loss_mask"][pos] = 1
    if d.get("retrieved_mask") is not None:
        d["retrieved_mask"][pos] = 0  # a retrieved token is out of the loss by default (offpolicy_train="none")


NAN_IN_LOSS = "%s: expected (no NaN|finite values) at tokens in the loss"
BAD_CASES = [
    # (name, mutation of the valid padded call, exception type, text the message must contain)
    (
        "both logits and hidden",
        lambda d: d.update(hidden=torch.randn(2, 3, 4), weight=torch.randn(5, 4)),
        ValueError,
        "logits/hidden",
    ),
    ("neither", lambda d: d.pop("logits"), ValueError, "logits/hidden"),
    ("weight with logits", lambda d: d.update(weight=torch.randn(5, 4)), ValueError, "weight"),
    ("logits shape", lambda d: d.update(logits=torch.randn(2, 4, 5)), ValueError, "logits"),
    ("logits dtype", lambda d: d.update(logits=d["logits"].long()), TypeError, "logits"),
    ("targets dtype", lambda d: d.update(targets=d["targets"].float()), TypeError, "targets"),
    ("targets 3-d", lambda d: d.update(targets=d["targets"][None]), ValueError, "targets"),
    ("targets >= V", lambda d: d["targets"].__setitem__((0, 0), 5), ValueError, "targets"),
    ("targets < 0", lambda d: d["targets"].__setitem__((1, 2), -1), ValueError, "targets"),
    # -100 (the ignore index) is accepted where loss_mask is 0 only (test_ignore_index_targets_outside_the_loss)
    (
        "targets -100 in the loss",
        lambda d: _set_in_loss(d, (1, 2), "targets", -100),
        ValueError,
        "targets: expected ids .* got -100",
    ),
    # probabilities passed as old_logp (a log-prob is <= 0): test_old_logp_above_zero
    ("old_logp shape", lambda d: d.update(old_logp=torch.zeros(2, 4)), ValueError, "old_logp"),
    ("old_logp dtype", lambda d: d.update(old_logp=d["old_logp"].long()), TypeError, "old_logp"),
    ("old_logp nan", lambda d: _set_in_loss(d, (0, 1), "old_logp", float("nan")), ValueError, NAN_IN_LOSS % "old_logp"),
    ("advantages shape", lambda d: d.update(advantages=torch.zeros(3)), ValueError, "advantages"),
    (
        "advantages nan",
        lambda d: _set_in_loss(d, (1, 1), "advantages", float("nan")),
        ValueError,
        NAN_IN_LOSS % "advantages",
    ),
    # behav_logp / ref_logp, given with the option that reads them
    (
        "behav_logp nan",
        lambda d: (
            d.update(behav_logp=-torch.ones(2, 3), tis_cap=2.0) or _set_in_loss(d, (0, 2), "behav_logp", math.nan)
        ),
        ValueError,
        NAN_IN_LOSS % "behav_logp",
    ),
    (
        "ref_logp nan",
        lambda d: d.update(ref_logp=-torch.ones(2, 3), beta=0.1) or _set_in_loss(d, (1, 0), "ref_logp", math.nan),
        ValueError,
        NAN_IN_LOSS % "ref_logp",
    ),
    ("advantages inf", lambda d: _set_in_loss(d, (1, 1), "advantages", float("inf")), ValueError, "advantages"),
    ("loss_mask shape", lambda d: d.update(loss_mask=torch.ones(3, 2, dtype=torch.bool)), ValueError, "loss_mask"),
    ("loss_mask type", lambda d: d.update(loss_mask=[[1, 1, 1], [1, 1, 1]]), TypeError, "loss_mask"),
    ("retrieved_mask shape", lambda d: d.update(retrieved_mask=torch.ones(2, 2)), ValueError, "retrieved_mask"),
    ("response_mask shape", lambda d: d.update(response_mask=torch.ones(2)), ValueError, "response_mask"),
    ("mixed devices", lambda d: d.update(old_logp=torch.zeros(2, 3, device="meta")), ValueError, "old_logp"),
    # the out-of-range values of each option: tests/fuzz/test_fuzz_loss.py::test_bad_option_is_refused_with_its_name
    ("loss_agg type", lambda d: d.update(loss_agg=1), TypeError, "loss_agg"),
    ("truncated without behav", lambda d: d.update(offpolicy_train="truncated"), ValueError, "behav_logp"),
    ("tis without behav", lambda d: d.update(tis_cap=2.0), ValueError, "behav_logp"),
    ("beta without ref", lambda d: d.update(beta=0.1), ValueError, "ref_logp"),
    ("ref_logp shape", lambda d: d.update(ref_logp=torch.zeros(3, 2)), ValueError, "ref_logp"),
    ("cu_seqlens with padded", lambda d: d.update(cu_seqlens=torch.tensor([0, 3, 6])), ValueError, "cu_seqlens"),
    ("eps string", lambda d: d.update(eps_high="0.2"), TypeError, "eps_high"),
    ("beta nan", lambda d: d.update(beta=float("nan")), ValueError, "beta"),
    ("shaping_m bool", lambda d: d.update(shaping_m=True), TypeError, "shaping_m"),
    ("global_num_tokens 0", lambda d: d.update(global_num_tokens=0), ValueError, "global_num_tokens"),
    ("global_num_tokens shape", lambda d: d.update(global_num_tokens=torch.ones(2)), ValueError, "global_num_tokens"),
    ("return_metrics", lambda d: d.update(return_metrics=1), TypeError, "return_metrics"),
    # one check for the number and the tensor form of global_num_tokens: a count, finite and > 0
    ("global_num_tokens -5", lambda d: d.update(global_num_tokens=-5), ValueError, "global_num_tokens"),
    ("global_num_tokens t(-5)", lambda d: d.update(global_num_tokens=torch.tensor(-5)), ValueError, "global_num"),
    ("global_num_tokens t(0.)", lambda d: d.update(global_num_tokens=torch.tensor(0.0)), ValueError, "global_num"),
    (
        "global_num_tokens t(nan)",
        lambda d: d.update(global_num_tokens=torch.tensor(float("nan"))),
        ValueError,
        "global",
    ),
    (
        "global_num_tokens t(inf)",
        lambda d: d.update(global_num_tokens=torch.tensor(float("inf"))),
        ValueError,
        "global",
    ),
    ("global_num_tokens [[-1]]", lambda d: d.update(global_num_tokens=torch.tensor([[-1.0]])), ValueError, "global"),
    # the integer dtypes of targets: one rule (rapo_fast.loss.options.TARGET_DTYPES) for rapo_loss and token_logprobs
    ("targets int8", lambda d: d.update(targets=d["targets"].to(torch.int8)), TypeError, "targets"),
    ("targets int16", lambda d: d.update(targets=d["targets"].to(torch.int16)), TypeError, "targets"),
    ("targets uint8", lambda d: d.update(targets=d["targets"].to(torch.uint8)), TypeError, "targets"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_padded(case, tripwire):
    _, mutate, exc, text = case
    d = _valid()
    mutate(d)
    with pytest.raises(exc, match=text):
        rapo_fast.rapo_loss(**d)


FLAT_CASES = [
    ("cu not starting at 0", lambda d: d.update(cu_seqlens=torch.tensor([1, 3, 5]))),
    ("cu decreasing", lambda d: d.update(cu_seqlens=torch.tensor([0, 4, 3, 5]))),
    ("cu last != N", lambda d: d.update(cu_seqlens=torch.tensor([0, 3, 4]))),
    ("cu float", lambda d: d.update(cu_seqlens=torch.tensor([0.0, 3.0, 5.0]))),
    ("cu 2-d", lambda d: d.update(cu_seqlens=torch.tensor([[0, 3, 5]]))),
    ("cu too short", lambda d: d.update(cu_seqlens=torch.tensor([0]))),
]


@pytest.mark.parametrize("case", FLAT_CASES, ids=[c[0] for c in FLAT_CASES])
def test_bad_cu_seqlens(case, tripwire):
    d = _valid(flat=True)
    case[1](d)
    with pytest.raises((ValueError, TypeError), match="cu_seqlens"):
        rapo_fast.rapo_loss(**d)


def test_flat_advantage_per_segment_shape(tripwire):
    d = _valid(flat=True)
    d["advantages"] = torch.zeros(3)  # 2 segments, 5 tokens
    with pytest.raises(ValueError, match=r"advantages.*\(2,\)"):
        rapo_fast.rapo_loss(**d)


@pytest.mark.parametrize(
    "mutation,text",
    [
        (lambda d: d.update(weight=torch.randn(5, 3)), "weight"),
        (lambda d: d.update(weight=d["weight"].half()), "weight"),
        (lambda d: d.pop("weight"), "weight"),
        (lambda d: d.update(bias=torch.randn(4)), "bias"),
        (lambda d: d.update(hidden=torch.randn(2, 4, 4)), "hidden"),
        (lambda d: d["targets"].__setitem__((0, 0), 7), "targets"),
    ],
)
def test_bad_hidden_path(mutation, text, tripwire):
    d = _valid(hidden=True)
    mutation(d)
    with pytest.raises((ValueError, TypeError), match=text):
        rapo_fast.rapo_loss(**d)


_FIELDS = ["logits", "targets", "old_logp", "advantages", "loss_mask", "retrieved_mask"]


# the string options' random values: tests/fuzz/test_fuzz_loss.py::test_bad_option_is_refused_with_its_name
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(_FIELDS), how=st.sampled_from(["shape", "dtype", "drop_dim"]), extra=st.integers(1, 3))
def test_fuzz_single_corruption(tripwire, field, how, extra):
    d = _valid()
    t = d[field]
    if how == "shape":
        d[field] = torch.cat([t, t[:, :1].expand(-1, extra, *t.shape[2:])], dim=1)
    elif how == "dtype":
        d[field] = t.to(torch.complex64) if t.is_floating_point() else t.to(torch.float32) + 0.5
        if field in ("loss_mask", "retrieved_mask"):
            d[field] = t.to(torch.complex64)
    else:
        d[field] = t[0]
    with pytest.raises((ValueError, TypeError), match=field if field != "logits" else "logits|targets"):
        rapo_fast.rapo_loss(**d)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.int32, torch.int64])
def test_targets_dtype_rule_is_one_rule(dtype):
    """rapo_loss accepts exactly the integer target dtypes that token_logprobs accepts (once a dtype passed the loss's
    check and then failed inside token_logprobs)."""
    d = _valid()
    d["targets"] = d["targets"].to(dtype)
    accepted = dtype in rapo_fast.loss.options.TARGET_DTYPES
    for call in (
        lambda: rapo_fast.rapo_loss(**d),
        lambda: rapo_fast.token_logprobs(d["logits"], targets=d["targets"]),
    ):
        if accepted:
            assert torch.isfinite(torch.as_tensor(call())).all()
        else:
            with pytest.raises(TypeError, match="targets"):
                call()


@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_ignore_index_targets_outside_the_loss(hidden):
    """Hugging Face's label padding (-100) where loss_mask is 0 is accepted, and the loss and its gradients are those
    of any valid id there (the token never enters the loss); -100 where loss_mask is set is refused by name (BAD_CASES).
    """
    d = _valid(hidden=hidden)
    d["loss_mask"][0, 2] = 0
    d["loss_mask"][1, 0] = 0
    x = "hidden" if hidden else "logits"
    ignored = dict(d, targets=d["targets"].clone())
    ignored["targets"][0, 2] = ignored["targets"][1, 0] = -100
    leaves = [{**c, x: c[x].clone().requires_grad_()} for c in (d, ignored)]
    for c in leaves:
        c["loss"] = rapo_fast.rapo_loss(**{k: v for k, v in c.items() if k != "loss"})
        c["loss"].backward()
    assert torch.equal(leaves[0]["loss"], leaves[1]["loss"])
    assert torch.equal(leaves[0][x].grad, leaves[1][x].grad)
    # policy_loss_from_logp has no targets; token_logprobs has no mask: -100 stays out of range there
    with pytest.raises(ValueError, match="targets"):
        rapo_fast.token_logprobs(
            ignored.get("logits"),
            targets=ignored["targets"],
            **({"hidden": ignored["hidden"], "weight": ignored["weight"]} if hidden else {}),
        )


def test_old_logp_above_zero(tripwire):
    """old_logp > OLD_LOGP_MAX (1e-4) at a token in the loss is refused naming old_logp and the likely mistake;
    rounding just above 0 is tolerated, and a masked token may hold anything."""
    from rapo_fast.loss.options import OLD_LOGP_MAX

    d = _valid()
    d["retrieved_mask"].zero_()
    d["loss_mask"][0, 0] = 0
    d["old_logp"][0, 0] = 0.9  # masked: never read
    d["old_logp"][1, 1] = 1e-6  # rounding of a log-prob near 0
    d["loss_mask"][1, 1] = 1
    with pytest.raises(AssertionError, match="a kernel ran"):  # validation passed, the (tripwired) kernel was next
        rapo_fast.rapo_loss(**d)
    d["old_logp"][1, 1] = 2 * OLD_LOGP_MAX
    with pytest.raises(
        ValueError, match=r"old_logp: expected log-probabilities .*\(first at index \(1, 1\).*torch\.log"
    ):
        rapo_fast.rapo_loss(**d)
    logp = torch.log_softmax(d["logits"], -1).gather(-1, d["targets"][..., None])[..., 0]
    kw = {k: d[k] for k in ("old_logp", "advantages", "loss_mask")}
    with pytest.raises(ValueError, match="old_logp"):  # the same check on the log-prob entry point
        loss_mod.policy_loss_from_logp(logp, **kw)
