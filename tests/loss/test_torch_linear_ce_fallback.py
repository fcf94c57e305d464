"""The CPU fallback of token_logprobs(hidden=...) through torch's chunked F.linear_cross_entropy
(rapo_fast/loss/torch_linear_ce.py): equal to the float64 reference in value and gradient, taken exactly when it
applies, and handing every case it cannot serve exactly (entropy, a non-finite row, tracing) to the chunked reference.

Tolerances (docs/testing.md): fp32 1e-5 absolute on log-probs, 1e-4 relative on gradients; fp16/bf16 inputs are upcast
to fp32 inside, so their log-probs meet 1e-4 and their gradients (rounded once to the input dtype) 1e-2 relative.
Not here: the Triton kernels (test_logprobs*.py), the chunked reference fallback's own tests (test_loss.py).
"""

from __future__ import annotations

import pytest
import torch

import rapo_fast
from rapo_fast.loss import logprobs as logprobs_mod
from rapo_fast.loss import torch_linear_ce
from rapo_fast.reference.logprobs import linear_token_logprobs_ref

pytestmark = pytest.mark.skipif(
    not torch_linear_ce.torch_linear_ce_available(), reason="torch has no chunked F.linear_cross_entropy"
)

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-4, 1e-2), torch.bfloat16: (1e-4, 1e-2)}


@pytest.fixture
def no_triton(monkeypatch):
    """The dispatch as on a CPU without the Triton interpreter (CI runs the suite under TRITON_INTERPRET=1)."""
    monkeypatch.setattr(logprobs_mod, "use_triton", lambda device: False)


@pytest.fixture
def lce_calls(monkeypatch):
    """The calls of torch's op made by the fallback: each call's chunk rows (None: unchunked)."""
    calls = []
    real = torch_linear_ce._LCE

    def spy(*args, **kwargs):
        calls.append(None if kwargs["options"] is None else kwargs["options"].batch_chunk_size)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_linear_ce, "_LCE", spy)
    return calls


def _case(n, h, v, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) / h**0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(v, generator=g) * 0.3).to(dtype).requires_grad_(True) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    return hid, w, b, y


def _grads(lp, leaves, seed=1):
    up = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((lp.float() * up).sum(), [t for t in leaves if t is not None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "h", "v"), [(1, 3, 5), (37, 16, 1001), (300, 24, 257), (700, 16, 401)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_fp64_reference(no_triton, lce_calls, dtype, n, h, v, bias, temperature):
    hid, w, b, y = _case(n, h, v, dtype, bias)
    lp = rapo_fast.token_logprobs(hidden=hid, weight=w, bias=b, targets=y, temperature=temperature)
    assert len(lce_calls) == 1, "the fallback did not take torch's op"
    assert (lce_calls[0] is None) == (4 * n * v <= torch_linear_ce.SMALL_BYTES)  # small logits: the unchunked op
    assert lp.dtype == torch.float32 and lp.shape == y.shape
    leaves64 = [t.detach().double().requires_grad_(True) if t is not None else None for t in (hid, w, b)]
    ref = linear_token_logprobs_ref(leaves64[0], leaves64[1], y, leaves64[2], temperature)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(lp.double(), ref, atol=atol, rtol=0)
    for got, exp in zip(_grads(lp, (hid, w, b)), _grads(ref, leaves64)):
        assert got.dtype == dtype
        err = (got.double() - exp).norm() / exp.norm().clamp_min(1e-12)
        assert err <= rtol, f"relative gradient error {err:.2e} > {rtol}"


def test_batched_shape_and_int32_targets(no_triton, lce_calls):
    hid, w, _, y = _case(2 * 9, 8, 50, torch.float32, False)
    lp = rapo_fast.token_logprobs(hidden=hid.view(2, 9, 8), weight=w, targets=y.view(2, 9).int())
    assert lp.shape == (2, 9) and len(lce_calls) == 1
    torch.testing.assert_close(lp.reshape(-1), linear_token_logprobs_ref(hid, w, y), atol=1e-5, rtol=0)


def test_chunk_rows_bound_the_logits_chunk():
    assert torch_linear_ce.chunk_rows(2048, 32768) == 256  # the anchor of the CPU benches
    assert torch_linear_ce.chunk_rows(10, 32768) == 32  # never fewer than 32 rows ...
    assert torch_linear_ce.chunk_rows(100, 50) == 100  # ... nor more than N
    for n, v in [(4096, 152064), (7, 3), (100000, 1000)]:
        r = torch_linear_ce.chunk_rows(n, v)
        assert 1 <= r <= max(n, 32) and (r * v * 4 <= torch_linear_ce.CHUNK_BYTES or r == 32)


def test_entropy_takes_the_reference_path(no_triton, lce_calls):
    hid, w, _, y = _case(20, 8, 40, torch.float32, False)
    lp, ent = rapo_fast.token_logprobs(hidden=hid, weight=w, targets=y, return_entropy=True)
    assert lce_calls == []
    ref_lp, ref_ent = linear_token_logprobs_ref(hid, w, y, None, 1.0, True)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("poison", ["overflow", "nan_hidden"])
def test_non_finite_row_gives_what_the_reference_path_gives(no_triton, lce_calls, monkeypatch, poison):
    """A row whose log-sum-exp is not finite: NaN log-prob and an exactly-zero gradient for its logits (docs/loss.md
    section 2), exactly as the chunked reference path; torch's op alone would put NaN into every gradient. Overflow
    (finite hidden, h W^T = +-inf in fp32) leaves grad_W finite; a NaN in hidden reaches grad_W through the GEMM in
    any implementation, so there the two paths are compared as they are."""
    hid, w, _, y = _case(6, 4, 30, torch.float32, False)
    with torch.no_grad():
        if poison == "overflow":
            hid[2] = 1e38 * torch.sign(hid[2])
            w.mul_(100.0)  # |h W^T| of row 2 well past the fp32 range, both signs
        else:
            hid[2, 1] = float("nan")
    lp = rapo_fast.token_logprobs(hidden=hid, weight=w, targets=y)
    assert len(lce_calls) == 1  # tried, then handed to the reference
    assert torch.isnan(lp[2]) and torch.isfinite(lp[[0, 1, 3, 4, 5]]).all()
    keep = torch.ones(6, dtype=torch.bool)
    keep[2] = False
    gh, gw = torch.autograd.grad(torch.where(keep, lp, 0.0).sum(), [hid, w])
    monkeypatch.setattr(torch_linear_ce, "_LCE", None)  # the reference path alone
    lp_ref = rapo_fast.token_logprobs(hidden=hid, weight=w, targets=y)
    ref_gh, ref_gw = torch.autograd.grad(torch.where(keep, lp_ref, 0.0).sum(), [hid, w])
    torch.testing.assert_close(lp, lp_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(gh, ref_gh, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(gw, ref_gw, atol=0, rtol=0, equal_nan=True)
    assert (gh[2] == 0).all()
    if poison == "overflow":
        assert torch.isfinite(gw).all()


def test_masked_out_target_by_bias_gives_minus_inf(no_triton):
    """A target the bias forbids (-inf) has log-prob -inf with a finite log-sum-exp: not a NaN row."""
    hid, w, _, y = _case(5, 4, 12, torch.float32, False)
    b = torch.zeros(12)
    b[y[3]] = float("-inf")
    lp = rapo_fast.token_logprobs(hidden=hid, weight=w, bias=b, targets=y)
    ref = linear_token_logprobs_ref(hid, w, y, b)
    assert lp[3] == float("-inf")
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_compiled_call_does_not_break_the_graph(no_triton, lce_calls):
    hid, w, _, y = _case(12, 6, 33, torch.float32, False)
    f = torch.compile(lambda a, b: rapo_fast.token_logprobs(hidden=a, weight=b, targets=y), fullgraph=True)
    lp = f(hid, w)
    assert lce_calls == []  # tracing takes the reference path, which has no data-dependent branch
    torch.testing.assert_close(lp, linear_token_logprobs_ref(hid, w, y), atol=1e-5, rtol=0)
