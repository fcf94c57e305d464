"""token_logprobs(logits, ..., inplace_backward=True) and rapo_loss(logits=..., inplace_backward=True): the logits
gradient written over the logits (rapo_fast/loss/logprobs.py `_lp_backward`).

Checked: the gradients reaching the parameters equal the default path's (every dtype, 2-D and 3-D, entropy and
temperature) and the logits storage then holds the logits gradient; the memory saving, measured with torch.profiler's
memory view as the peak of forward + backward (about one N x V buffer less); autograd safety (another term that saved
the logits and runs its backward later gets torch's "modified by an inplace operation" error, never a wrong gradient;
one that ran before is unaffected; a second backward through the call raises); the cases where the option has no
effect (a leaf, a view whose rows are not evenly spaced, no Triton); argument checks; opcheck of the in-place op.
Not here: the log-prob kernels' values (test_logprobs.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import FULL, make_batch
from torch.profiler import ProfilerActivity, profile

import rapo_fast
from rapo_fast._dispatch import use_triton

pytestmark = pytest.mark.skipif(
    not use_triton(torch.device("cpu")), reason="the in-place backward is the Triton path's (TRITON_INTERPRET=1)"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _lm_head(lead, hd, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hd, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, hd, generator=g) * 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, v, lead, generator=g)
    return h, w, y


def _run(lead, hd, v, dtype, inplace, *, entropy=True, temperature=1.0):
    """logits = h @ w^T (not a leaf, as from an lm_head) -> token_logprobs -> backward. Returns (h.grad, w.grad, the
    logits tensor after backward, the gradient of the loss w.r.t. the logits computed on the side)."""
    h, w, y = _lm_head(lead, hd, v, dtype)
    z = h @ w.T
    out = rapo_fast.token_logprobs(
        z, targets=y, temperature=temperature, return_entropy=entropy, inplace_backward=inplace
    )
    lp, ent = out if entropy else (out, None)
    coef = torch.linspace(-1.0, 1.0, lp.numel()).view(lp.shape)
    loss = (coef * lp).sum() + (0.3 * ent.sum() if entropy else 0.0)
    zc = z.detach().clone().requires_grad_()  # the logits gradient, through the default path on a copy
    out_c = rapo_fast.token_logprobs(zc, targets=y, temperature=temperature, return_entropy=entropy)
    lp_c, ent_c = out_c if entropy else (out_c, None)
    ((coef * lp_c).sum() + (0.3 * ent_c.sum() if entropy else 0.0)).backward()
    loss.backward()
    return h.grad, w.grad, z.detach(), zc.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead, v, entropy, temperature", [((13,), 37, True, 1.0), ((2, 5), 300, False, 0.7)])
def test_inplace_gradients_equal_the_default(dtype, lead, v, entropy, temperature):
    gh0, gw0, z0, gz = _run(lead, 11, v, dtype, False, entropy=entropy, temperature=temperature)
    gh1, gw1, z1, _ = _run(lead, 11, v, dtype, True, entropy=entropy, temperature=temperature)
    assert torch.equal(gh0, gh1) and torch.equal(gw0, gw1)  # the same kernel, the same values: bitwise
    assert torch.equal(z1, gz), "the logits do not hold their gradient: the backward did not write in place"
    assert not torch.equal(z0, gz)  # the default leaves the logits alone


def _peak_bytes(fn) -> int:
    """Peak of the running sum of the allocations and frees recorded by torch.profiler's memory view while fn runs
    (each op's self memory at its start: allocating ops are leaves, so that is their own allocation or free)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    assert events, "the profiler recorded no allocation"
    cur = peak = 0
    for e in events:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_saves_one_n_by_v_buffer(dtype):
    """Peak extra memory of lm_head GEMM + token_logprobs forward + backward: the default allocates the logits and
    then their gradient; in place, only the logits."""
    n, hd, v = 64, 16, 4096
    nv = n * v * dtype.itemsize

    def step(inplace):
        h, w, y = _lm_head((n,), hd, v, dtype)

        def fn():
            z = h @ w.T
            lp, ent = rapo_fast.token_logprobs(z, targets=y, return_entropy=True, inplace_backward=inplace)
            (lp.sum() + 0.1 * ent.sum()).backward()

        return _peak_bytes(fn)

    default, inplace = step(False), step(True)
    assert default >= 2 * nv, f"default peak {default} B < 2 N x V ({2 * nv} B): the test could not fail"
    saved = default - inplace
    assert 0.9 * nv <= saved <= 1.1 * nv, f"saved {saved} B, one N x V buffer is {nv} B"


def _other_term_case(other_first: bool, inplace: bool):
    h, w, y = _lm_head((6,), 5, 37, torch.float32)
    z = h @ w.T
    if other_first:  # created first -> its backward runs after token_logprobs'
        other = z.pow(2).mean()  # saves z for its backward
        lp = rapo_fast.token_logprobs(z, targets=y, inplace_backward=inplace)
    else:
        lp = rapo_fast.token_logprobs(z, targets=y, inplace_backward=inplace)
        other = z.pow(2).mean()
    (lp.sum() + other).backward()
    return h.grad, w.grad


def test_logits_saved_by_a_later_backward_raise():
    """Another loss term on the same logits whose backward runs after ours: torch's version counter refuses it."""
    _other_term_case(True, False)  # fine by default
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _other_term_case(True, True)


def test_logits_saved_by_an_earlier_backward_are_unaffected():
    ref = _other_term_case(False, False)
    got = _other_term_case(False, True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_second_backward_through_the_call_raises():
    h, w, y = _lm_head((6,), 5, 37, torch.float32)
    lp = rapo_fast.token_logprobs(h @ w.T, targets=y, inplace_backward=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_no_effect_on_a_leaf_or_an_uneven_view():
    y = torch.randint(0, 37, (3, 4))
    # a leaf: its .grad must be a tensor of its own
    z = torch.randn(3, 4, 37, requires_grad=True)
    before = z.detach().clone()
    rapo_fast.token_logprobs(z, targets=y, inplace_backward=True).sum().backward()
    assert torch.equal(z.detach(), before) and z.grad is not None
    ref = before.clone().requires_grad_()
    rapo_fast.token_logprobs(ref, targets=y).sum().backward()
    assert torch.equal(z.grad, ref.grad)
    # logits[:, :-1] of a non-leaf [B, T + 1, V]: rows not evenly spaced, a fresh gradient
    base = torch.randn(3, 5, 37, requires_grad=True) * 1.0
    kept = base.detach().clone()
    rapo_fast.token_logprobs(base[:, :-1], targets=y, inplace_backward=True).sum().backward()
    assert torch.equal(base.detach(), kept)


def test_no_effect_without_triton(monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    h, w, y = _lm_head((5,), 4, 29, torch.float32)
    z = h @ w.T
    before = z.detach().clone()
    rapo_fast.token_logprobs(z, targets=y, inplace_backward=True).sum().backward()
    assert torch.equal(z.detach(), before) and h.grad is not None


def test_argument_checks():
    h, w, y = _lm_head((5,), 4, 29, torch.float32)
    with pytest.raises(ValueError, match="inplace_backward"):
        rapo_fast.token_logprobs(hidden=h, weight=w, targets=y, inplace_backward=True)
    with pytest.raises(TypeError, match="inplace_backward: expected a bool"):
        rapo_fast.token_logprobs(h @ w.T, targets=y, inplace_backward=1)
    d = make_batch(2, 4, 29, H=4)
    d.pop("logits", None)
    with pytest.raises(ValueError, match="inplace_backward"):
        rapo_fast.rapo_loss(**d, inplace_backward=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rapo_loss_threads_the_option(dtype):
    """rapo_loss(logits=..., inplace_backward=True): same loss and parameter gradients, the logits overwritten."""
    d = make_batch(3, 5, 37, H=11, masked_rows=(1,), per_seq_adv=True)
    for k in ("hidden", "weight", "bias"):
        d.pop(k, None)
    out = {}
    for inplace in (False, True):
        h, w, _ = _lm_head((3, 5), 11, 37, dtype)
        z = h @ w.T
        before = z.detach().clone()
        loss = rapo_fast.rapo_loss(z, **d, **FULL, inplace_backward=inplace)
        loss.backward()
        out[inplace] = (loss.detach(), h.grad, w.grad, torch.equal(z.detach(), before))
    assert_close_verbose(out[True][0], out[False][0], atol=0.0, name="loss")
    assert torch.equal(out[True][1], out[False][1]) and torch.equal(out[True][2], out[False][2])
    assert out[False][3] and not out[True][3]


def test_opcheck_inplace_op():
    ops = torch.ops.rapo_fast
    rapo_fast.token_logprobs  # noqa: B018  (registers the ops)
    z = torch.randn(2, 3, 37)
    y = torch.randint(0, 37, (2, 3))
    logp, lse, ent = ops.token_logprobs_fwd(z, y, 0.7, True)
    g, g_ent = torch.randn_like(logp), torch.randn_like(logp)
    expected = ops.token_logprobs_bwd(z, y, lse, ent, g, g_ent, 0.7, True)
    torch.library.opcheck(ops.token_logprobs_bwd_inplace, (z.clone(), y, lse, ent, g, g_ent, 0.7, True))
    ops.token_logprobs_bwd_inplace(z, y, lse, ent, g, g_ent, 0.7, True)
    assert torch.equal(z, expected)


@pytest.mark.gpu
def test_gpu_inplace_saves_one_n_by_v_buffer():
    """On CUDA, torch.cuda.max_memory_allocated over lm_head GEMM + token_logprobs forward + backward (bf16,
    N=4096, V=32768: one N x V buffer is 256 MiB): in place peaks about one N x V buffer lower.

    Each variant runs once untimed first. The first GEMM on a thread allocates that thread's cuBLAS workspace through
    the caching allocator (32 MiB on Hopper) and keeps it: this thread's at the forward's lm_head GEMM, autograd's
    device thread's at the backward's. Measured cold, the first variant's peak can carry such first-use allocations
    (and whatever Triton's first compile and launch of a kernel allocate) while the second finds them in its `base`,
    which inflates the saving (predicted ~288 MiB on an H100, past the 281.6 MiB bound). Warm, both measurements start
    from the same state: workspaces held, kernels built; only the logits gradient differs.
    """
    n, hd, v, dev = 4096, 256, 32768, torch.device("cuda")
    nv = n * v * 2

    def peak(inplace):
        h, w, y = (t.to(dev) for t in _lm_head((n,), hd, v, torch.bfloat16))
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        lp = rapo_fast.token_logprobs(h @ w.T, targets=y, inplace_backward=inplace)
        lp.sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(dev) - base

    for inplace in (False, True):  # warm-up, result discarded: cuBLAS workspaces of both threads, Triton compiles
        peak(inplace)
    default, inplace = peak(False), peak(True)
    saved = default - inplace
    assert 0.9 * nv <= saved <= 1.1 * nv, f"default {default} B, in place {inplace} B, one N x V is {nv} B"
