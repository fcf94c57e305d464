"""rapo_fast.rapo_loss, kernel path vs reference vs float64: loss, gradients and metrics over every aggregation mode,
padded and flat (cu_seqlens) layouts, fp32/fp16/bf16 logits; the registered ops (opcheck, non-uniform upstream
gradients); the CPU fallback path; all-masked rows. The hidden-state path: test_fused_linear_loss.py (fp32, against the
two-pass path) and test_fused_linear_accum.py (fp16 / bf16).

Tolerance (docs/testing.md rule 1, tests/helpers/__init__.py): |kernel - ref64| <= 2 |ref_dtype - ref64| + atol[dtype],
atol 1e-4 fp32, 1e-2 fp16, 5e-2 bf16, for the loss and every gradient. Metrics (detached) are compared with the
reference in the same dtype (atol 1e-5, counts exactly). `make_batch`, `check_case`: tests/helpers/loss_cases.py.
Not here: option-by-option semantics and hand-computed values (test_loss_options.py), accumulation
(test_loss_accumulation.py), argument checks (test_loss_checks.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import AGG_MODES, FULL, check_case, inputs_for, make_batch

import rapo_fast
from rapo_fast.loss import policy_loss as loss_mod
from rapo_fast.loss import policy_op as op_mod
from rapo_fast.loss.options import LossOptions
from rapo_fast.loss.policy_op import stack_token_inputs
from rapo_fast.reference import policy_token_loss_ref, rapo_loss_ref, token_logprobs_ref


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(shaping_m=0.05, offpolicy_train="shaped", eps_low=0.28, eps_high=0.28),
        FULL,
        dict(
            importance_sampling_level="sequence",
            eps_low=3e-4,
            eps_high=4e-4,
            offpolicy_train="shaped",
            beta=0.05,
            kl_estimator="k2",
            ref_logp=None,
        ),
    ],
    ids=["plain", "rapo-shaped", "full", "gspo"],
)
@pytest.mark.parametrize("layout", ["padded", "flat"])
def test_kernel_vs_reference_every_agg(agg, opts, layout):
    opts = {k: v for k, v in opts.items() if k != "ref_logp"}
    if layout == "padded":
        d = make_batch(3, 7, 11, masked_rows=(1,), per_seq_adv=agg != "token-mean", response=True)
    else:
        d = make_batch(seg_lens=[5, 1, 0, 9, 3], V=13, masked_rows=(1,), per_seq_adv=agg == "seq-mean-token-sum")
    check_case(d, dict(opts, loss_agg=agg))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["padded", "flat"])
def test_low_precision_logits(dtype, layout):
    d = make_batch(2, 9, 37) if layout == "padded" else make_batch(seg_lens=[4, 7, 2], V=37)
    check_case(d, dict(FULL, loss_agg="seq-mean-token-mean"), dtype)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 5), (2, 3, 1), (1, 33, 7)])
def test_tiny_shapes(shape):
    check_case(make_batch(*shape), dict(FULL, loss_agg="seq-mean-token-mean"))


def test_larger_vocab_not_multiple_of_block():
    d = make_batch(2, 3, 5003, spread=1.0)
    check_case(d, dict(FULL, loss_agg="token-mean"))


@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden-fused"])
def test_all_masked_batch_gives_zero_and_no_nan(hidden):
    d = make_batch(3, 4, 6, H=5 if hidden else None, mask_p=0.0)
    for agg in AGG_MODES:
        loss, grads, metrics = check_case(d, dict(FULL, loss_agg=agg))
        assert loss.item() == 0.0
        assert all(torch.count_nonzero(g) == 0 for g in grads.values())
        assert all(torch.isfinite(v) for k, v in metrics.items() if k != "entropy") and metrics["num_tokens"] == 0


def test_empty_offpolicy_mask():
    d = make_batch(3, 6, 8, ret_p=0.0)
    for mode in ("shaped", "truncated"):
        _, _, m = check_case(d, dict(offpolicy_train=mode, shaping_m=0.05))
        assert m["num_offpolicy_tokens"] == 0 and m["offpolicy_weight_mean"] == 0
    # and with nothing retrieved, the off-policy modes equal "none"
    x = {k: v for k, v in d.items()}
    assert torch.equal(rapo_fast.rapo_loss(**x, offpolicy_train="shaped"), rapo_fast.rapo_loss(**x))


def test_fallback_path_matches_reference(monkeypatch):
    """The non-Triton path of rapo_loss (policy_token_loss_ref + loss.py's weights) vs the reference."""
    monkeypatch.setattr(loss_mod, "use_triton", lambda device: False)
    for agg in AGG_MODES:
        check_case(make_batch(seg_lens=[3, 0, 5, 2], V=7, masked_rows=(2,)), dict(FULL, loss_agg=agg))
    check_case(make_batch(2, 5, 7), dict(FULL, loss_agg="token-mean", importance_sampling_level="sequence"))


def test_float64_inputs_match_reference_exactly_enough():
    d = {k: (v.double() if v.is_floating_point() else v) for k, v in make_batch(2, 4, 5).items()}
    x, _ = inputs_for(d, torch.float64)
    loss = rapo_fast.rapo_loss(**x, **FULL)
    ref = rapo_loss_ref(**x, **FULL)
    assert loss.dtype == torch.float64
    assert_close_verbose(loss, ref, atol=1e-12)


def test_gradcheck_float64():
    d = {k: (v.double() if v.is_floating_point() else v) for k, v in make_batch(2, 3, 4, spread=0.05).items()}
    logits = d.pop("logits").requires_grad_(True)
    opts = dict(FULL, loss_agg="seq-mean-token-mean", dual_clip=None, tis_cap=None, offpolicy_train="shaped")
    assert torch.autograd.gradcheck(lambda z: rapo_fast.rapo_loss(z, **d, **opts), (logits,))


# the registered op is called directly here: on a GPU machine (no interpreter) its Triton path needs CUDA tensors
OP_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the options of the op tests: the op takes them as LossOptions.kernel_scalars(), the reference as keywords
_OP_OPTIONS = dict(
    eps_low=0.2,
    eps_high=0.28,
    dual_clip=3.0,
    gamma=0.1,
    is_cap=2.0,
    tis_cap=1.5,
    beta=0.1,
    entropy_coef=0.01,
    offpolicy_train="truncated",
    kl_estimator="k3",
)


def _op_args(n=37, seq=True, with_ent=True, seed=0, device=OP_DEVICE):
    """(args of rapo_fast::policy_loss, the per-token inputs by name) on `device`; logp and entropy need grad."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g) * 3
    p = dict(logp=lp, old=lp + 0.3 * torch.randn(n, generator=g), adv=torch.randn(n, generator=g))
    p.update(w=torch.rand(n, generator=g) / n, scale=1 + 0.05 * torch.rand(n, generator=g))
    p.update(code=torch.randint(0, 3, (n,), generator=g, dtype=torch.int8))
    p.update(
        seqlr=0.2 * torch.randn(n, generator=g) if seq else None, behav=p["old"] + 0.1 * torch.randn(n, generator=g)
    )
    p.update(ref=lp + 0.2 * torch.randn(n, generator=g), ent=torch.rand(n, generator=g) * 2 if with_ent else None)
    p = {k: None if v is None else v.to(device).requires_grad_(k in ("logp", "ent")) for k, v in p.items()}
    rows = {k: p[k] for k in ("old", "adv", "w", "scale", "seqlr", "behav", "ref")}
    tok, present = stack_token_inputs(code=p["code"].to(p["old"].dtype), **rows)
    return (p["logp"], p["ent"], tok, present, LossOptions(**_OP_OPTIONS).kernel_scalars()), p


@pytest.mark.parametrize("seq,with_ent,triton", [(True, True, True), (False, False, True), (True, True, False)])
def test_opcheck_policy_loss_op(seq, with_ent, triton, monkeypatch):
    if not triton:  # the op's torch implementation, used on devices without Triton
        monkeypatch.setattr(op_mod, "use_triton", lambda device: False)
    args, _ = _op_args(seq=seq, with_ent=with_ent)
    torch.library.opcheck(torch.ops.rapo_fast.policy_loss.default, args)


def _check_op_against_reference(op_args):
    args, p = op_args
    lp, ent, code = p["logp"], p["ent"], p["code"]
    tok, sums = loss_mod.policy_loss_op(*args)
    up = torch.randn_like(tok)
    g_lp, g_ent = torch.autograd.grad(tok, (lp, ent), up)
    # the same per-token loss from the reference, weighted the same way
    lp2 = lp.detach().requires_grad_(True)
    ent2 = ent.detach().requires_grad_(True)
    ref_tok, _ = policy_token_loss_ref(
        lp2,
        p["old"],
        p["adv"],
        on_mask=code == 1,
        off_mask=code == 2,
        ratio_scale=p["scale"],
        seq_log_ratio=p["seqlr"],
        behav_logp=p["behav"],
        ref_logp=p["ref"],
        entropy=ent2,
        **_OP_OPTIONS,
    )
    assert_close_verbose(tok, ref_tok * p["w"], atol=1e-6, name="token loss")
    r_lp, r_ent = torch.autograd.grad(ref_tok * p["w"], (lp2, ent2), up)
    assert_close_verbose(g_lp, r_lp, atol=1e-6, name="dlogp")
    assert_close_verbose(g_ent, r_ent, atol=1e-6, name="dH")
    # metric partial sums over all blocks: counts of each token class
    assert sums[0] == (code == 1).sum() and sums[1] == (code == 2).sum() and sums[2] == (code != 0).sum()


@pytest.mark.parametrize("n, triton", [(50, True), (2600, True), (300, False)])
def test_op_honours_nonuniform_upstream_gradient(n, triton, monkeypatch):
    """docs/pitfalls.md #7: the backward multiplies by the per-token upstream gradient, not by an assumed scalar 1.
    n = 2600 spans several kernel blocks (partial sums of several programs); triton=False: the op's torch
    implementation (devices without Triton), against the same reference."""
    if not triton:
        monkeypatch.setattr(op_mod, "use_triton", lambda device: False)
    _check_op_against_reference(_op_args(n=n))


def test_temperature_applies_to_policy_logprob():
    """docs/pitfalls.md #9: logp is taken at the temperature (old_logp given at the same temperature)."""
    d = make_batch(2, 4, 9)
    t = 0.6
    logp_t = token_logprobs_ref(d["logits"], d["targets"], t)
    d["old_logp"] = logp_t.detach()
    _, m = rapo_fast.rapo_loss(**d, temperature=t, return_metrics=True)
    assert_close_verbose(m.ratio_mean, torch.tensor(1.0), atol=1e-5)
    check_case(d, dict(temperature=t, entropy_coef=0.1))


def test_strided_inputs():
    """Non-contiguous per-token tensors and logits rows with a stride larger than V (a slice of a wider vocab)."""
    d = make_batch(3, 6, 8)
    wide = torch.randn(3, 6, 13)
    wide[..., :8] = d["logits"]
    d["logits"] = wide[..., :8]
    for k in ("old_logp", "advantages", "loss_mask", "retrieved_mask", "ref_logp", "behav_logp"):
        d[k] = d[k].t().contiguous().t()
        assert not d[k].is_contiguous()
    x = dict(d)
    loss = rapo_fast.rapo_loss(**x, **FULL)
    ref = rapo_loss_ref(**{k: v.contiguous() for k, v in d.items()}, **FULL)
    assert_close_verbose(loss, ref, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_cuda_kernel_vs_reference(dtype, agg):
    d = make_batch(seg_lens=[700, 1, 0, 1500, 333], V=1031, masked_rows=(1,), per_seq_adv=True)
    check_case(d, dict(FULL, loss_agg=agg, importance_sampling_level="sequence"), dtype, device="cuda")
    h = make_batch(4, 257, 999, H=129, per_seq_adv=True)
    check_case(h, dict(FULL, loss_agg=agg), dtype, device="cuda")


@pytest.mark.gpu
def test_cuda_op_large_n():
    _check_op_against_reference(_op_args(n=300_001, device="cuda"))


@pytest.mark.parametrize("shape,cu", [((2, 0), None), ((0,), [0, 0]), ((0, 3), None)])
def test_empty_inputs_give_zero_loss_and_empty_grad(shape, cu):
    logits = torch.randn(*shape, 5, requires_grad=True)
    loss, m = rapo_fast.rapo_loss(
        logits,
        targets=torch.zeros(shape, dtype=torch.long),
        old_logp=torch.zeros(shape),
        advantages=torch.zeros(shape),
        loss_mask=torch.ones(shape, dtype=torch.bool),
        cu_seqlens=None if cu is None else torch.tensor(cu),
        return_metrics=True,
        loss_agg="seq-mean-token-mean",
        importance_sampling_level="sequence",
        entropy_coef=0.1,
    )
    (g,) = torch.autograd.grad(loss, logits)
    assert loss.item() == 0.0 and g.shape == logits.shape and m.num_tokens == 0


_COMPILE_SCRIPT = r"""
import itertools, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rapo_fast.kernels.loss import policy_loss as K
from rapo_fast.kernels.loss.policy_layout import TokenInput
from rapo_fast.loss.options import LossOptions
from rapo_fast.loss.policy_op import KernelOptions
full = sum(1 << int(m) for m in TokenInput)
# (PRESENT, offpolicy_train, kl_estimator, kl_clamp, HAS_ENT): every optional row absent / present, each mode
variants = [(31, "none", "k1", True, 0), (full, "truncated", "k3", True, 1),
            (full & ~(1 << int(TokenInput.REF)), "shaped", "k1", True, 1), (full, "truncated", "k3", False, 0),
            (full, "none", "k2", True, 1)]
for (present, off, kl, clamp, ent), kern in itertools.product(variants, (K.policy_loss_fwd_kernel,
                                                               K.policy_loss_bwd_kernel)):
    const = dict(PRESENT=present, HAS_ENT=bool(ent), BLOCK=1024)
    sig = {n: "constexpr" if n in const else "*fp32" if n.endswith("_ptr") else "i32" if n in ("N", "tok_stride")
           else "fp32" for n in kern.arg_names}
    # opts: the reals runtime fp32, the choices and flags constexpr fields (as policy_op.kernel_options passes them)
    opts = LossOptions(offpolicy_train=off, kl_estimator=kl, kl_clamp=clamp).to_kernel()
    i = kern.arg_names.index("opts")
    sig["opts"] = KernelOptions(*("fp32" if isinstance(v, float) else "constexpr" for v in opts.values()))
    const.update({(i, j): v for j, v in enumerate(opts.values()) if not isinstance(v, float)})
    triton.compile(ASTSource(fn=kern, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
print("ok")
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The interpreter is laxer than the compiler: compile the policy-loss kernels to a cubin for sm_90 (Triton's
    bundled ptxas; no GPU needed). Compiling is not running: GPU execution is tested by the gpu-marked tests."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas on this machine")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
