"""How a loss option reaches the policy-loss kernels: LossOptions is the kernels' spec (to_kernel(), kernel_scalars())
and nothing between them names an option, so adding one touches LossOptions, the kernels and the reference only.

What this is: the structural checks of that pipeline (docs/architecture.md, "How an option reaches the kernel") and
the round trip of the options' kernel encoding. What this is not: the loss's values (tests/loss/test_loss.py).
"""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rapo_fast.kernels.loss.policy_layout import NUM_INPUTS, TokenInput
from rapo_fast.loss import fused_linear, policy_op
from rapo_fast.loss.options import KL_ESTIMATORS, OFFPOLICY_MODES, LossOptions
from rapo_fast.reference import policy_loss as ref_mod

ROOT = Path(__file__).resolve().parents[2]
# the parameters of a policy-loss kernel that are not options: pointers, sizes, and the launch's own constexprs
_NOT_OPTIONS = {"N", "tok_stride", "PRESENT", "HAS_ENT", "BLOCK"}


def _kernels():
    pytest.importorskip("triton")
    from rapo_fast.kernels.loss import policy_loss as K

    return K


@pytest.mark.parametrize("name", ["policy_loss_fwd_kernel", "policy_loss_bwd_kernel"])
def test_kernels_take_the_options_as_one_argument_with_their_own_names(name):
    """The kernels take the options as one argument `opts` whose fields are the kernel options under their own names
    (no renames), every other parameter a pointer or one of the launch's own; and the kernel file reads every field
    (no option the kernels silently drop)."""
    K = _kernels()
    kernel = getattr(K, name)
    assert [p for p in kernel.arg_names if not p.endswith("_ptr") and p not in _NOT_OPTIONS] == ["opts"]
    assert policy_op.KernelOptions._fields == LossOptions.kernel_names()
    tree = ast.parse(inspect.getsource(K))
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "opts"}
    assert read == set(LossOptions.kernel_names())


def test_kernel_options_are_constexpr_choices_and_runtime_reals():
    """A choice or flag reaches the kernels as a constexpr (compile-time branches), a real as a float (no recompile
    per value); the values are the options' encoding (to_kernel)."""
    pytest.importorskip("triton")
    import triton.language as tl

    opts = LossOptions(offpolicy_train="truncated", kl_estimator="k2", kl_clamp=False, tis_cap=2.5, eps_high=0.28)
    got = policy_op.kernel_options(opts.kernel_scalars())
    for name, want in opts.to_kernel().items():
        value = getattr(got, name)
        if isinstance(want, float):
            assert type(value) is float and value == want, name
        else:
            assert isinstance(value, tl.constexpr) and value.value == want, name


def test_option_names_appear_nowhere_between_the_options_and_the_kernels():
    """The launchers (policy_op.py) and the fused op (fused_linear.py) pass the options through as one tensor and as
    one named tuple built from LossOptions: no kernel option's name occurs in their code (identifiers, attributes,
    strings).
    (temperature, a logits option, is an argument of the fused op: its tiles scale the logits.)"""
    names = set(LossOptions.kernel_names())
    for mod in (policy_op, fused_linear):
        tree = ast.parse(inspect.getsource(mod))
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.add(node.value)
            elif isinstance(node, ast.keyword) and node.arg:
                used.add(node.arg)
            elif isinstance(node, ast.arg):
                used.add(node.arg)
        assert not used & names, f"{mod.__name__} names option(s) {sorted(used & names)}"


def test_the_reference_takes_the_kernel_options_and_only_those():
    """policy_token_loss_ref's per-token options are exactly LossOptions' kernel options (the row options act
    elsewhere), so what the kernels take the reference takes."""
    assert set(ref_mod._ROW_OPTIONS) == set(LossOptions.names()) - set(LossOptions.kernel_names())
    with pytest.raises(TypeError, match="shaping_m"):
        ref_mod.policy_token_loss_ref(
            torch.zeros(2), torch.zeros(2), torch.zeros(2), on_mask=torch.ones(2, dtype=bool), shaping_m=0.1
        )


_options = st.builds(
    LossOptions,
    offpolicy_train=st.sampled_from(OFFPOLICY_MODES),
    gamma=st.floats(1e-6, 10),
    is_cap=st.floats(1e-6, 10),
    tis_cap=st.none() | st.floats(1e-6, 10),
    eps_low=st.floats(0, 1),
    eps_high=st.floats(0, 10),
    dual_clip=st.none() | st.floats(1.0001, 10),
    beta=st.floats(-1, 1),
    kl_estimator=st.sampled_from(KL_ESTIMATORS),
    kl_clamp=st.booleans(),
    entropy_coef=st.floats(-1, 1),
)


@settings(max_examples=200, deadline=None)
@given(_options)
def test_kernel_encoding_round_trips(opts):
    """kernel_scalars() holds to_kernel() exactly (float64), with each argument's type (float runtime scalar, int / bool
    constexpr), and decodes back to the options' values."""
    kw = opts.to_kernel()
    assert list(kw) == list(LossOptions.kernel_names())
    back = LossOptions.kernel_kwargs(opts.kernel_scalars())
    assert back == kw and [type(v) for v in back.values()] == [type(v) for v in kw.values()]
    decoded = LossOptions.kernel_options(opts.kernel_scalars())
    assert decoded == {n: getattr(opts, n) for n in LossOptions.kernel_names()}
    assert all(math.isfinite(float(v)) for v in kw.values())


def test_stacked_inputs_and_presence_mask():
    n = 5
    rows = {m.name.lower(): torch.full((n,), float(m)) for m in TokenInput}
    tok, present = policy_op.stack_token_inputs(**{**rows, "seqlr": None})
    assert tok.shape == (NUM_INPUTS, n) and present == sum(1 << int(m) for m in TokenInput if m != TokenInput.SEQLR)
    for m in TokenInput:
        if m != TokenInput.SEQLR:
            assert torch.equal(tok[m], rows[m.name.lower()])
    with pytest.raises(ValueError, match="adv: expected a tensor"):
        policy_op.stack_token_inputs(**{**rows, "adv": None})
    with pytest.raises(TypeError, match="expected rows among"):
        policy_op.stack_token_inputs(**rows, bogus=rows["old"])


def test_the_ops_take_a_fixed_number_of_inputs():
    """The registered ops' inputs: log-probs, entropy, the stacked per-token inputs, the presence mask, the options
    tensor (policy_loss); no argument per option or per per-token input."""
    schema = torch.ops.rapo_fast.policy_loss.default._schema
    assert [a.name for a in schema.arguments] == ["logp", "ent", "tok", "present", "scalars"], str(schema)
    fused = [a.name for a in torch.ops.rapo_fast.fused_linear_policy_loss.default._schema.arguments]
    assert fused[:7] == ["hidden", "weight", "bias", "targets", "tok", "present", "scalars"], fused
