"""Memory bounds of the hidden-state path, token_logprobs(hidden=...) and rapo_loss(hidden=...): no allocation of
N x V fp32 in forward or backward.

Measured with torch.profiler's memory view (profile_memory=True, CPU): the largest single allocation recorded while
the path runs forward + backward. token_logprobs: below N * V * 4 bytes, while the plain reference on the same inputs
does allocate that much (so the test can fail), and the no-Triton fallback (chunked reference under
torch.utils.checkpoint) too. rapo_loss's fused op: at most the logits tile or grad_W; with one token tile in bf16, no
fp32 [V, H] grad_W accumulator. Not here: speed, or the GPU bound (test_logprobs.py::test_gpu_hidden_path_memory).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import rapo_fast
import rapo_fast.loss.logprobs as lp_mod
from rapo_fast.loss import tiles
from rapo_fast.reference import linear_token_logprobs_ref

# N x V fp32 = 8 MiB, while a logits tile of the CPU defaults is [32, 16384] fp32 = 2 MiB, and grad_W [V, H] fp32 is
# 2 MiB (H << N keeps the parameters themselves below the threshold).
N, H, V = 32, 8, 65536


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The memory view attributes each allocation to the op that made it: an op's self memory is what it allocated
    # itself (its children's allocations are theirs). Allocating ops are leaves (aten::empty, aten::mm, ...), so the
    # largest self figure bounds the largest single allocation; cpu_memory_usage would add up a whole subtree.
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert sizes, "the profiler recorded no allocation"
    return max(sizes)


def _inputs():
    h = torch.randn(N, H, requires_grad=True)
    w = (torch.randn(V, H) * 0.3).requires_grad_()
    b = torch.zeros(V, requires_grad=True)
    y = torch.randint(0, V, (N,))
    return h, w, b, y


def _fused(h, w, b, y):
    def run():
        logp, ent = rapo_fast.token_logprobs(hidden=h, weight=w, bias=b, targets=y, return_entropy=True)
        (logp.sum() + 0.1 * ent.sum()).backward()

    return run


def test_hidden_path_never_allocates_n_by_v():
    h, w, b, y = _inputs()
    threshold = N * V * 4
    fused = _largest_allocation(_fused(h, w, b, y))
    grads = [t.grad.clone() for t in (h, w, b)]

    def ref():
        logp, ent = linear_token_logprobs_ref(h, w, y, b, 1.0, True)
        (logp.sum() + 0.1 * ent.sum()).backward()

    for t in (h, w, b):
        t.grad = None
    reference = _largest_allocation(ref)
    assert reference >= threshold, f"the reference allocated at most {reference} B; the test could not fail"
    assert fused < threshold // 2, f"fused hidden path allocated {fused} B in one piece (N*V*4 = {threshold})"
    for g, t in zip(grads, (h, w, b)):  # and the bounded path computed the same gradients
        torch.testing.assert_close(g, t.grad, atol=1e-4, rtol=1e-4)


def test_fallback_without_triton_is_chunked(monkeypatch):
    # The CPU path without Triton: reference over row chunks under checkpoint, bounded in backward too.
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    monkeypatch.setattr(lp_mod, "_FALLBACK_BYTES", N * V * 4 // 4)
    h, w, b, y = _inputs()
    largest = _largest_allocation(_fused(h, w, b, y))
    assert largest < N * V * 4 // 2, f"fallback allocated {largest} B in one piece (N*V*4 = {N * V * 4})"


def _fused_loss(n, h, v, dtype, **opts):
    """A call of rapo_loss(hidden=...) forward + backward (the fused path) on inputs made outside it, and its weight."""
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_()
    kw = dict(old_logp=torch.full((n,), -11.0), advantages=torch.randn(n, generator=g), loss_mask=torch.ones(n) > 0)
    kw.update(hidden=hid, weight=w, targets=torch.randint(0, v, (n,), generator=g), **opts)
    return lambda: rapo_fast.rapo_loss(**kw).backward(), w


def test_fused_loss_bounded_by_the_tile():
    """The largest allocation is the logits tile (at most TILE_BYTES) or the fp32 grad_W accumulator [V, H]."""
    n, h, v = 128, 8, 65536
    run, w = _fused_loss(n, h, v, torch.float32, entropy_coef=0.01)
    largest = _largest_allocation(run)
    bound = max(tiles.TILE_BYTES["cpu"], v * h * 4)
    assert largest <= bound < n * v * 4, f"largest allocation {largest} B, tile/grad bound {bound}, N*V*4 {n * v * 4}"
    assert w.grad is not None


def test_one_token_tile_allocates_no_fp32_grad_w():
    """bf16, one token tile: grad_W is written directly (the largest allocation is grad_W itself, in bf16)."""
    n, h, v = 4, 64, 4096
    run, w = _fused_loss(n, h, v, torch.bfloat16)
    largest = _largest_allocation(run)
    assert largest < v * h * 4, f"largest allocation {largest} B: an fp32 [V, H] ({v * h * 4} B) was made"
    assert w.grad is not None and w.grad.dtype == torch.bfloat16 and torch.count_nonzero(w.grad) > 0
