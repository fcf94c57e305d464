"""Memory bound of token_logprobs' hidden-state path: no allocation of N x V fp32 (or larger) in forward or backward.

Measured with torch.profiler's memory view (profile_memory=True, CPU): the largest single allocation recorded while
the fused path runs forward + backward must stay below N * V * 4 bytes, while the plain reference on the same inputs
does allocate that much (so the test can fail). Also checks the no-Triton fallback (chunked reference under
torch.utils.checkpoint). Not here: speed, or the GPU bound (test_logprobs.py::test_gpu_hidden_path_memory).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import rapo_fast
import rapo_fast.loss.logprobs as lp_mod
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
