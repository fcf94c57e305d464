"""Shift invariance of the log-prob and the entropy: logits offset by a constant c (softmax does not see c) give the
float64 log-prob and entropy on every path, at any c a dtype holds, up to the same small error.

Paths: the reference in its own dtype (token_logprobs_ref), the chunked reference (backend="torch": the CPU path
without Triton, hence the trainer's step entropies), and the Triton kernels (backend="triton", in the interpreter on
the CPU), on the logits and hidden-state paths. The float64 answer is computed from the dtype-rounded logits shifted
by their row max (exact in float64). Before every formula was taken relative to the row max, logp = z_y - lse and
H = lse - E_p[z] rounded lse ~ c first: errors of ulp(c) (1e-3 at c = 1e4), and logp 0.0 instead of -log V for an
all-equal row at bf16's max. Gradients at offsets 20, 1e4 and the dtype's max against float64, within 4e-6 plus
the dtype's eps times the largest entry: the reference's autograd, and the Triton backward on the logits and hidden
paths, which forms p = exp((z - m) - log s) from the saved (m, log s); from the saved fp32 lse = m + log s, as it
once did, its gradient was off by 2.5e-5 at c = 1e4 in fp32 and by O(1) for an all-equal row near the float range's
end (docs/loss.md section 2).
Not here: the kernels against the reference at ordinary logits (test_logprobs.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.strategies import fuzz_settings
from hypothesis import example, given
from hypothesis import strategies as st

import rapo_fast
from rapo_fast._dispatch import use_triton
from rapo_fast.reference import token_logprobs_ref

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ["reference", "torch"] + (["triton"] if use_triton(torch.device("cpu")) else [])
# |error| <= ATOL (1 + |exact|): a few fp32 ulp of log-probs / entropies of a few units, whatever the offset
ATOL = 2e-6


def _exact(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (logp, entropy) of the logits as given (already rounded to their dtype), shifted by the row max."""
    zs = z.double() - z.double().amax(-1, keepdim=True)
    logq = zs - torch.logsumexp(zs, -1, keepdim=True)
    return logq.gather(-1, y[:, None])[:, 0], -(logq.exp() * logq).sum(-1)


def _run(backend: str, z: torch.Tensor, y: torch.Tensor):
    if backend == "reference":
        return token_logprobs_ref(z, y, return_entropy=True)
    return rapo_fast.token_logprobs(z, targets=y, return_entropy=True, backend=backend)


def _logits(dtype: torch.dtype, offset: float, spread: float, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = offset + spread * torch.randn(3, v, generator=g, dtype=torch.float64)
    fmax = torch.finfo(dtype).max
    return z.clamp(-fmax, fmax).to(dtype)


def _assert_exact(got, want, what):
    err = ((got.double() - want).abs() / (1 + want.abs())).max()
    assert err <= ATOL, f"{what}: relative error {float(err):.3g} > {ATOL} (got {got.tolist()}, want {want.tolist()})"


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(12)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    exponent=st.floats(0.0, 38.5),
    sign=st.sampled_from([1.0, -1.0]),
    spread=st.sampled_from([0.0, 1.0, 4.0]),
    seed=st.integers(0, 2**16),
)
@example(dtype="fp32", exponent=4.0, sign=1.0, spread=1.0, seed=0)  # c = 1e4: ulp(c) = 1e-3 broke z_y - lse
@example(dtype="bf16", exponent=38.5, sign=1.0, spread=0.0, seed=0)  # all-equal rows at bf16's max
@example(dtype="fp16", exponent=4.9, sign=1.0, spread=4.0, seed=0)  # fp16's max: the entropy came out negative
def test_logp_and_entropy_are_shift_invariant(backend, dtype, exponent, sign, spread, seed):
    dt = DTYPES[dtype]
    z = _logits(dt, sign * 10.0**exponent, spread, 257, seed)
    y = torch.randint(0, 257, (3,), generator=torch.Generator().manual_seed(seed))
    logp, ent = _run(backend, z, y)
    want_lp, want_ent = _exact(z, y)
    _assert_exact(logp, want_lp, f"{backend} {dtype} logp")
    _assert_exact(ent, want_ent, f"{backend} {dtype} entropy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_equal_rows_at_bf16_max_over_a_large_vocabulary(backend):
    """V = 50000 equal logits at bf16's largest value: logp = -log V = -10.82 and H = log V on every path."""
    v = 50000
    z = torch.full((2, v), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    y = torch.tensor([0, v - 1])
    logp, ent = _run(backend, z, y)
    want = torch.full((2,), float(torch.tensor(float(v), dtype=torch.float64).log()), dtype=torch.float64)
    _assert_exact(logp, -want, f"{backend} logp")
    _assert_exact(ent, want, f"{backend} entropy")


def _offset_rows(dt: torch.dtype, offset: float) -> torch.Tensor:
    """Three rows of 257 logits at `offset` (capped at the dtype's max): two spread by 2, one of equal logits."""
    offset = min(offset, torch.finfo(dt).max)
    z = _logits(torch.float64, offset, 2.0, 257, 1)
    z[2] = offset
    fmax = torch.finfo(dt).max
    return z.clamp(-fmax, fmax).to(dt)


GRAD_PATHS = ["reference", "torch"] + (["triton-logits", "triton-hidden"] if "triton" in BACKENDS else [])


@pytest.mark.parametrize("path", GRAD_PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("offset", [20.0, 1e4, 3e38])
def test_gradient_at_large_offsets(path, dtype, offset):
    """d(logp + H)/dz equals float64's (of the shifted logits) at any offset: the reference's autograd, the chunked
    reference, and the Triton backward on the logits path and on the hidden path (hidden = the logits, weight = the
    identity: z = h W^T = h exactly, and grad_h = grad_z W = grad_z, so grad_h is the kernel's logits gradient)."""
    dt = DTYPES[dtype]
    z = _offset_rows(dt, offset)
    y = torch.tensor([0, 5, 256])
    leaf = z.clone().requires_grad_(True)
    if path == "triton-hidden":
        eye = torch.eye(z.shape[-1], dtype=dt)
        logp, ent = rapo_fast.token_logprobs(hidden=leaf, weight=eye, targets=y, return_entropy=True, backend="triton")
    else:
        logp, ent = _run(path.removesuffix("-logits"), leaf, y)
    (g,) = torch.autograd.grad((logp + ent).sum(), [leaf])
    z64 = (z.double() - z.double().amax(-1, keepdim=True)).requires_grad_(True)
    (g64,) = torch.autograd.grad(sum(_exact(z64, y)).sum(), [z64])
    err = float((g.double() - g64).abs().max())
    # the gradient comes back in the logits' dtype: its rounding, relative to the largest entry, on top of fp32's
    tol = 4e-6 + torch.finfo(dt).eps * float(g64.abs().max())
    assert err <= tol, f"{path} {dtype} offset {offset}: gradient error {err:.3g} > {tol:.3g}"
