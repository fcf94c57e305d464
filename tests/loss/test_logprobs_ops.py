"""token_logprobs plumbing: torch.library registration (opcheck, torch.compile), argument checks (hypothesis-fuzzed,
raised before any kernel runs), backend dispatch, and the chunked reference fallback used without Triton.

Not here: numerical agreement of the kernels on many shapes (test_logprobs.py) or memory (test_logprobs_memory.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_close_verbose
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rapo_fast
import rapo_fast.loss.logprobs as lp_mod
import rapo_fast.loss.tiles as tiles_mod
from rapo_fast.kernels.triton_helpers import dot_operand, interpreter_upcast
from rapo_fast.reference import linear_token_logprobs_ref, token_logprobs_ref

# ------------------------------------------------------------------------------------------------------------------
# registered ops
# ------------------------------------------------------------------------------------------------------------------


def _ops():
    rapo_fast.token_logprobs  # noqa: B018  (imports rapo_fast.loss.logprobs, which registers the ops)
    return torch.ops.rapo_fast


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_logits_ops(with_entropy, dtype):
    ops = _ops()
    z = torch.randn(2, 3, 37).to(dtype).requires_grad_()
    y = torch.randint(0, 37, (2, 3))
    torch.library.opcheck(ops.token_logprobs_fwd, (z, y, 0.7, with_entropy))
    logp, lse, ent = ops.token_logprobs_fwd(z.detach(), y, 0.7, with_entropy)
    g = torch.randn_like(logp)
    g_ent = torch.randn_like(logp) if with_entropy else g
    torch.library.opcheck(ops.token_logprobs_bwd, (z.detach(), y, lse, ent, g, g_ent, 0.7, with_entropy))


@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_linear_ops(with_bias, monkeypatch):
    monkeypatch.setitem(tiles_mod.MAX_VOCAB_TILE, "cpu", 32)  # several vocabulary tiles
    ops = _ops()
    h = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(70, 7, requires_grad=True)
    b = torch.randn(70, requires_grad=True) if with_bias else None
    y = torch.randint(0, 70, (5,))
    torch.library.opcheck(ops.linear_token_logprobs_fwd, (h, w, b, y, 1.3, True))
    logp, lse, ent = ops.linear_token_logprobs_fwd(
        h.detach(), w.detach(), None if b is None else b.detach(), y, 1.3, True
    )
    g, g_ent = torch.randn_like(logp), torch.randn_like(logp)
    args = (h.detach(), w.detach(), None if b is None else b.detach(), y, lse, ent, g, g_ent, 1.3, True)
    torch.library.opcheck(ops.linear_token_logprobs_bwd, (*args, True, True, with_bias))
    torch.library.opcheck(ops.linear_token_logprobs_bwd, (*args, False, True, False))


def test_torch_compile_logits_and_hidden():
    z = torch.randn(3, 5, 41, requires_grad=True)
    y = torch.randint(0, 41, (3, 5))
    h = torch.randn(6, 9, requires_grad=True)
    w = torch.randn(41, 9, requires_grad=True)
    yh = torch.randint(0, 41, (6,))

    def f(z, y, h, w, yh):
        lp, ent = rapo_fast.token_logprobs(z, targets=y, temperature=0.7, return_entropy=True)
        lph = rapo_fast.token_logprobs(hidden=h, weight=w, targets=yh, temperature=0.7)
        return (lp * 2).sum() + ent.mean() + lph.sum()

    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    out = compiled(z, y, h, w, yh)
    out.backward()
    grads = [t.grad.clone() for t in (z, h, w)]
    for t in (z, h, w):
        t.grad = None
    expect = f(z, y, h, w, yh)
    expect.backward()
    assert_close_verbose(out, expect, atol=1e-5, rtol=1e-6, name="compiled value")
    for g, t in zip(grads, (z, h, w)):
        assert_close_verbose(g, t.grad, atol=1e-6, rtol=1e-6, name="compiled grad")


# ------------------------------------------------------------------------------------------------------------------
# dispatch and the no-Triton fallback
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_chunked_matches_reference(dtype, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    monkeypatch.setattr(lp_mod, "_FALLBACK_BYTES", 3 * 4 * 50)  # 3 rows per chunk: chunks straddle batch rows
    base = torch.randn(2, 8, 50).to(dtype)
    y = torch.randint(0, 50, (2, 7))
    g1, g2 = torch.randn(2, 7), torch.randn(2, 7)
    outs = []
    for fn in (
        lambda x: rapo_fast.token_logprobs(x[:, :-1], targets=y, temperature=1.7, return_entropy=True),
        lambda x: token_logprobs_ref(x[:, :-1], y, 1.7, True),
    ):
        x = base.clone().requires_grad_()
        lp, ent = fn(x)
        ((lp * g1).sum() + (ent * g2).sum()).backward()
        outs.append((lp, ent, x.grad))
    for a, b in zip(*outs):
        assert_close_verbose(a, b, atol=1e-6, rtol=1e-6, name="logits fallback")
    assert outs[0][2].dtype == dtype

    h, w, b = torch.randn(3, 4, 9).to(dtype), torch.randn(50, 9).to(dtype), torch.randn(50).to(dtype)
    yh = torch.randint(0, 50, (3, 4))
    outs = []
    for fn in (
        lambda hh, ww, bb: rapo_fast.token_logprobs(hidden=hh, weight=ww, bias=bb, targets=yh, return_entropy=True),
        lambda hh, ww, bb: linear_token_logprobs_ref(hh, ww, yh, bb, 1.0, True),
    ):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        lp, ent = fn(*leaves)
        (lp.sum() + (ent * 0.3).sum()).backward()
        outs.append((lp, ent, *[t.grad for t in leaves]))
    rtol = 1e-5 if dtype == torch.float32 else 2**-7  # one ulp of a gradient rounded to bf16
    for a, c in zip(*outs):
        assert_close_verbose(a, c, atol=1e-5, rtol=rtol, name="hidden fallback")


# ------------------------------------------------------------------------------------------------------------------
# argument checks: each bad argument raises ValueError/TypeError naming it, before any kernel runs
# ------------------------------------------------------------------------------------------------------------------

_V, _H = 11, 6


def _valid(path, lead, dtype):
    if path == "logits":
        return {"logits": torch.randn(*lead, _V).to(dtype), "targets": torch.randint(0, _V, lead)}
    return {
        "hidden": torch.randn(*lead, _H).to(dtype),
        "weight": torch.randn(_V, _H).to(dtype),
        "bias": torch.randn(_V).to(dtype),
        "targets": torch.randint(0, _V, lead),
    }


def _other_float(t):
    return t.to(torch.bfloat16 if t.dtype == torch.float32 else torch.float32)


# each mutation: (applies to path, name the message must contain, expected exception, function kwargs -> kwargs)
_MUTATIONS = {
    "both": ("logits", "hidden", ValueError, lambda k: {**k, "hidden": torch.randn(2, _H)}),
    "neither": ("logits", "logits", ValueError, lambda k: {"targets": k["targets"]}),
    "logits_dtype": ("logits", "logits", TypeError, lambda k: {**k, "logits": k["logits"].double()}),
    "logits_int": ("logits", "logits", TypeError, lambda k: {**k, "logits": k["logits"].long()}),
    "logits_1d": ("logits", "logits", ValueError, lambda k: {**k, "logits": k["logits"].reshape(-1)}),
    "logits_list": ("logits", "logits", TypeError, lambda k: {**k, "logits": k["logits"].tolist()}),
    "weight_with_logits": ("logits", "weight", ValueError, lambda k: {**k, "weight": torch.randn(_V, _H)}),
    "targets_float": ("both", "targets", TypeError, lambda k: {**k, "targets": k["targets"].float()}),
    "targets_int16": ("both", "targets", TypeError, lambda k: {**k, "targets": k["targets"].short()}),
    "targets_shape": ("both", "targets", ValueError, lambda k: {**k, "targets": k["targets"][..., None]}),
    "targets_negative": ("both", "targets", ValueError, lambda k: {**k, "targets": k["targets"] * 0 - 1}),
    "targets_too_big": ("both", "targets", ValueError, lambda k: {**k, "targets": k["targets"] * 0 + _V}),
    "targets_array": ("both", "targets", TypeError, lambda k: {**k, "targets": k["targets"].numpy()}),
    "temperature_zero": ("both", "temperature", ValueError, lambda k: {**k, "temperature": 0.0}),
    "temperature_negative": ("both", "temperature", ValueError, lambda k: {**k, "temperature": -1.0}),
    "temperature_nan": ("both", "temperature", ValueError, lambda k: {**k, "temperature": math.nan}),
    "temperature_inf": ("both", "temperature", ValueError, lambda k: {**k, "temperature": math.inf}),
    "temperature_str": ("both", "temperature", TypeError, lambda k: {**k, "temperature": "1.0"}),
    "temperature_bool": ("both", "temperature", TypeError, lambda k: {**k, "temperature": True}),
    "temperature_tensor": ("both", "temperature", TypeError, lambda k: {**k, "temperature": torch.tensor(1.0)}),
    "temperature_none": ("both", "temperature", TypeError, lambda k: {**k, "temperature": None}),
    "return_entropy_int": ("both", "return_entropy", TypeError, lambda k: {**k, "return_entropy": 1}),
    "no_weight": ("hidden", "weight", ValueError, lambda k: {**k, "weight": None}),
    "weight_shape": ("hidden", "weight", ValueError, lambda k: {**k, "weight": k["weight"][:, :-1]}),
    "weight_3d": ("hidden", "weight", ValueError, lambda k: {**k, "weight": k["weight"][None]}),
    "weight_dtype": ("hidden", "weight", TypeError, lambda k: {**k, "weight": _other_float(k["weight"])}),
    "bias_shape": ("hidden", "bias", ValueError, lambda k: {**k, "bias": k["bias"][:-1]}),
    "bias_dtype": ("hidden", "bias", TypeError, lambda k: {**k, "bias": k["bias"].double()}),
    "hidden_dtype": ("hidden", "hidden", TypeError, lambda k: {**k, "hidden": k["hidden"].int()}),
    "hidden_4d": ("hidden", "hidden", ValueError, lambda k: {**k, "hidden": k["hidden"][None, None]}),
    "device": ("both", "meta", ValueError, lambda k: {**k, "targets": k["targets"].to("meta")}),
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(["logits", "hidden"]),
    lead=st.sampled_from([(1,), (3,), (2, 3)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    mutation=st.sampled_from(sorted(_MUTATIONS) + [None]),
)
def test_argument_checks_fuzz(path, lead, dtype, mutation):
    kwargs = _valid(path, lead, dtype)
    names = ("_token_logprobs_fwd", "linear_token_logprobs_fwd", "_reference_chunked")
    with contextlib.ExitStack() as stack:
        # Spies that still run the real launch, so a valid call completes and a rejected one shows zero launches.
        spies = {n: stack.enter_context(mock.patch.object(lp_mod, n, wraps=getattr(lp_mod, n))) for n in names}
        if mutation is None:
            rapo_fast.token_logprobs(**kwargs)
            assert sum(s.call_count for s in spies.values()) == 1
            return
        applies, name, exc, mutate = _MUTATIONS[mutation]
        if applies not in (path, "both"):
            return
        with pytest.raises(exc) as info:
            rapo_fast.token_logprobs(**mutate(kwargs))
        assert all(s.call_count == 0 for s in spies.values()), "a kernel ran before the argument check"
    assert name in str(info.value), f"{mutation}: message does not name {name!r}: {info.value}"
    if "shape" in mutation:
        assert "expected shape" in str(info.value) and "got (" in str(info.value), "shape errors give both shapes"


# ------------------------------------------------------------------------------------------------------------------
# the kernels compile for the GPUs (sm_80, sm_90) even on a machine without one
# ------------------------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rapo_fast.kernels.loss import token_logprobs as K

def build(fn, types, consts, cap):
    names = list(fn.arg_names)
    sig = dict(zip(names, types + ["constexpr"] * len(consts)))
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 8})

ints = ["i32", "i64", "i64"]
for cap, zt, tgt in [(90, "*bf16", "*i64"), (80, "*fp16", "*i32")]:
    for init, final, hb, we in [(True, True, False, True), (True, False, True, False), (False, True, True, True)]:
        consts = dict(INIT=init, FINAL=final, HAS_BIAS=hb, WITH_ENTROPY=we, BLOCK_V=4096)
        build(K.token_logprobs_fwd_kernel, [zt, tgt, zt] + ["*fp32"] * 8 + ints + ["i32", "i32", "fp32"], consts, cap)
    consts = dict(HAS_BIAS=True, WITH_ENTROPY=True, BLOCK_V=4096)
    types = [zt, zt, tgt, zt] + ["*fp32"] * 5 + ints + ["i64", "i32", "i32", "fp32"]
    build(K.token_logprobs_bwd_kernel, types, consts, cap)
print("compiled")
"""


def test_kernels_compile_for_sm80_and_sm90(tmp_path):
    # The interpreter accepts code the GPU compiler rejects (loop-carried types, scalar masks); compile the real thing
    # to cubin with Triton's bundled ptxas, in a fresh process without TRITON_INTERPRET.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, UPCAST: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = dot_operand(tl.load(a_ptr + rm[:, None] * K + rk[None, :]), UPCAST)
    b = dot_operand(tl.load(b_ptr + rk[:, None] * N + rn[None, :]), UPCAST)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b, out_dtype=tl.float32))


def test_dot_operand_switch_gives_right_bf16_dot():
    # rapo_fast/kernels/triton_helpers.py's interpreter switch: bf16 tl.dot operands are upcast under the interpreter
    # (where bf16 tl.dot is wrong, docs/interpreter.md) and left alone on a GPU.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(16, 32, device=dev).bfloat16()
    b = torch.randn(32, 16, device=dev).bfloat16()
    c = torch.empty(16, 16, device=dev)
    _dot_kernel[(1,)](a, b, c, M=16, K=32, N=16, UPCAST=interpreter_upcast())
    assert_close_verbose(c, a.float() @ b.float(), atol=1e-3, rtol=1e-3, name="bf16 dot")
