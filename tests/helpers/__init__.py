"""Cross-op test helpers: the tolerance rule (docs/testing.md rule 1) and a mismatch report: where and how much.

Not a place for op-specific fixtures.
"""

from __future__ import annotations

import torch

# Floors of the tolerance rule |kernel - ref64| <= 2 |ref_dtype - ref64| + atol[dtype] (docs/testing.md rule 1).
ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float64: 1e-8}


def assert_close_verbose(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0, name=""):
    """allclose with NaN/inf parity, printing the worst offenders (Liger's assert_verbose_allclose)."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN mismatch at {torch.nonzero(nan_a ^ nan_e)[:10].tolist()}"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), f"{name}: inf mismatch"
    fin = torch.isfinite(e)
    diff = (a - e).abs().where(fin, torch.zeros_like(a))
    bound = atol + rtol * e.abs().where(fin, torch.zeros_like(e))
    bad = diff > bound
    if bad.any():
        idx = torch.nonzero(bad)[:10]
        rows = [f"  at {tuple(i.tolist())}: got {a[tuple(i)].item():.6g} want {e[tuple(i)].item():.6g}" for i in idx]
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements off (max |diff| {diff.max().item():.3g}, "
            f"atol {atol}, rtol {rtol})\n" + "\n".join(rows)
        )


def assert_within_ref_error(kernel: torch.Tensor, ref_dtype: torch.Tensor, ref64: torch.Tensor, dtype, name=""):
    """docs/testing.md rule 1: the kernel's error is at most twice the reference's error in that dtype, plus a floor."""
    k = kernel.detach().to(torch.float64).cpu()
    r = ref_dtype.detach().to(torch.float64).cpu()
    e = ref64.detach().to(torch.float64).cpu()
    fin = torch.isfinite(e)
    ref_err = (r - e).abs().where(fin, torch.zeros_like(e))
    assert torch.equal(torch.isnan(k), torch.isnan(e)), f"{name}: NaN mismatch"
    diff = (k - e).abs().where(fin, torch.zeros_like(e))
    bound = 2 * ref_err + ATOL[dtype]
    bad = diff > bound
    if bad.any():
        idx = torch.nonzero(bad)[:10]
        rows = [
            f"  at {tuple(i.tolist())}: kernel {k[tuple(i)].item():.6g} ref64 {e[tuple(i)].item():.6g} "
            f"ref_{dtype} {r[tuple(i)].item():.6g}"
            for i in idx
        ]
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements beyond 2*ref_err+{ATOL[dtype]} "
            f"(max |diff| {diff.max().item():.3g})\n" + "\n".join(rows)
        )
