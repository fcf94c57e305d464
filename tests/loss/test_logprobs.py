"""Correctness of rapo_fast.token_logprobs (Triton kernels) against its reference, and of the reference against
float64 autograd: forward (logp, entropy) and every gradient (logits, hidden, weight, bias), fp32/fp16/bf16, with the
tolerance rule (docs/testing.md rule 1), on the shapes and inputs of docs/pitfalls.md (#1-5, 7, 9, 11).

Not here: argument checks, op registration and torch.compile (test_logprobs_ops.py), memory bounds
(test_logprobs_memory.py). The CPU runs use the Triton interpreter (tests/conftest.py); tests marked gpu run the same
comparisons on CUDA at large shapes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ATOL, assert_close_verbose, assert_within_ref_error

import rapo_fast
import rapo_fast.loss.logprobs as lp_mod
import rapo_fast.loss.tiles as tiles_mod
from rapo_fast.reference import linear_token_logprobs_ref, token_logprobs_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _fwd_bwd(fn, leaves, targets_shape, return_entropy, g_lp, g_ent):
    """Run fn() on fresh leaf copies, backprop sum(g_lp * logp + g_ent * H); return outputs and the leaves' grads."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]
    out = fn(*leaves)
    logp, ent = out if return_entropy else (out, None)
    assert logp.shape == targets_shape and logp.dtype in (torch.float32, torch.float64)
    loss = (logp * g_lp.to(logp.dtype)).sum()
    if return_entropy:
        assert ent.shape == targets_shape and ent.dtype == logp.dtype
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    loss.backward()
    grads = [None if x is None or not x.requires_grad else x.grad for x in leaves]
    return logp, ent, grads


def _check_all(kern, ref_dt, ref64, dtype, names, grad_dtypes):
    """docs/testing.md rule 1 on every output and gradient; gradients must come back in the inputs' dtypes."""
    for i, (k, r, e) in enumerate(zip(kern[:2], ref_dt[:2], ref64[:2])):
        if k is not None:
            assert k.dtype == torch.float32
            assert_within_ref_error(k, r, e, dtype, name=("logp", "entropy")[i])
    for name, gd, k, r, e in zip(names, grad_dtypes, kern[2], ref_dt[2], ref64[2]):
        if k is None:
            assert e is None, f"{name}: no gradient"
            continue
        assert k.dtype == gd, f"grad {name} dtype {k.dtype}, want {gd}"
        # Weight and bias gradients sum over all tokens and grow with N; in bf16 one ulp of a value of magnitude M is
        # M * 2^-8, which no bf16 output can beat elementwise. So the dtype floor applies relative to the gradient's
        # scale (unchanged when that scale is <= 1).
        scale = max(1.0, e[torch.isfinite(e)].abs().max().item()) if e.numel() else 1.0
        assert_within_ref_error(k.double() / scale, r.double() / scale, e.double() / scale, dtype, name=f"grad {name}")


def _upstream(shape, return_entropy):
    # Non-uniform upstream gradients for both outputs (docs/pitfalls.md #7).
    return torch.randn(shape), (torch.randn(shape) if return_entropy else None)


def _make_logits(lead, v, dtype, kind):
    z = torch.randn(*lead, v) * 3
    if kind == "negative":  # all logits < 0: a max identity of 0 would break the entropy (docs/pitfalls.md #2)
        z = -z.abs() - 40
    y = torch.randint(0, v, lead)
    if kind == "masked":  # -inf on part of the vocabulary, never on the target (docs/pitfalls.md #3)
        mask = torch.rand(*lead, v) < 0.6
        if v > 1:
            mask.view(-1, v)[0, :] = True  # a row with only its target unmasked
        mask.scatter_(-1, y.unsqueeze(-1), False)
        z = z.masked_fill(mask, float("-inf"))
    return z.to(dtype), y


def _compare_logits(z, y, dtype, temperature, return_entropy, tight=True):
    g_lp, g_ent = _upstream(y.shape, return_entropy)

    def kern(x):
        return rapo_fast.token_logprobs(x, targets=y, temperature=temperature, return_entropy=return_entropy)

    def ref(x):
        return token_logprobs_ref(x, y, temperature, return_entropy)

    z = z.requires_grad_()
    k = _fwd_bwd(kern, [z], y.shape, return_entropy, g_lp, g_ent)
    r = _fwd_bwd(ref, [z], y.shape, return_entropy, g_lp, g_ent)
    e = _fwd_bwd(ref, [z.detach().double().requires_grad_()], y.shape, return_entropy, g_lp, g_ent)
    _check_all(k, r, e, dtype, ["logits"], [dtype])
    if tight:
        # Kernel and reference both compute in fp32 from the same inputs, so they agree far below the dtype floor.
        assert_close_verbose(k[0], r[0], atol=2e-5, rtol=2e-5, name="logp vs ref")
        if return_entropy:
            assert_close_verbose(k[1], r[1], atol=5e-5, rtol=2e-5, name="entropy vs ref")
        # Gradients: fp32 rounding of different operation orders, or one ulp of the output dtype.
        rtol = {torch.float32: 1e-4, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
        assert_close_verbose(k[2][0], r[2][0], atol=1e-5, rtol=rtol, name="grad logits vs ref")
    return k


# ------------------------------------------------------------------------------------------------------------------
# reference vs float64 autograd (the spec itself)
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "masked", "negative"])
def test_reference_matches_float64_autograd(dtype, kind):
    z, y = _make_logits((13,), 77, dtype, kind)
    g_lp, g_ent = _upstream(y.shape, True)
    r = _fwd_bwd(lambda x: token_logprobs_ref(x, y, 0.8, True), [z.requires_grad_()], y.shape, True, g_lp, g_ent)

    # float64 autograd of the textbook formulas, independent of the reference's code.
    def textbook(x):
        logq = torch.log_softmax(x.double() / 0.8, dim=-1)
        q = logq.exp()
        return logq.gather(-1, y.unsqueeze(-1)).squeeze(-1), -(q * torch.nan_to_num(logq, neginf=0.0)).sum(-1)

    e = _fwd_bwd(textbook, [z.detach().requires_grad_()], y.shape, True, g_lp, g_ent)
    assert_close_verbose(r[0], e[0], atol=1e-5, rtol=1e-5, name="logp")
    assert_close_verbose(r[1], e[1], atol=1e-4, rtol=1e-5, name="entropy")
    assert_close_verbose(r[2][0], e[2][0], atol=ATOL[dtype] / 10, rtol=1e-2, name="grad")
    assert torch.isfinite(r[2][0]).all()


def test_linear_reference_matches_logits_reference():
    h, w, b = torch.randn(9, 33, dtype=torch.float64), torch.randn(50, 33, dtype=torch.float64), torch.randn(50)
    y = torch.randint(0, 50, (9,))
    lin = linear_token_logprobs_ref(h, w, y, b.double(), 1.5, True)
    direct = token_logprobs_ref(h @ w.T + b.double(), y, 1.5, True)
    for a, c in zip(lin, direct):
        assert_close_verbose(a, c, atol=1e-12, name="linear ref")


# ------------------------------------------------------------------------------------------------------------------
# logits path
# ------------------------------------------------------------------------------------------------------------------

LOGITS_CASES = [
    # (lead shape, V, temperature, kind, return_entropy)
    ((1,), 1, 1.0, "normal", True),  # V = 1: logp = 0, H = 0
    ((1,), 1000, 1.0, "normal", True),  # N = 1
    ((7,), 97, 0.7, "normal", True),  # odd sizes, T < 1
    ((2, 3), 257, 1.9, "normal", False),  # [B, T, V], logp only
    ((5,), 4099, 1.0, "masked", True),  # V not a multiple of the block, -inf vocab
    ((3, 2), 129, 1.3, "negative", True),  # all-negative logits
    ((6,), 600, 0.5, "masked", True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LOGITS_CASES, ids=lambda c: f"{c[0]}-V{c[1]}-T{c[2]}-{c[3]}-ent{int(c[4])}")
def test_logits_path(case, dtype):
    lead, v, temperature, kind, ent = case
    z, y = _make_logits(lead, v, dtype, kind)
    k = _compare_logits(z, y, dtype, temperature, ent)
    if v == 1:
        assert torch.equal(k[0], torch.zeros_like(k[0]))


@pytest.mark.parametrize("v", [129920, 151936, 152064])
def test_logits_large_vocab(v):
    # Real vocabularies that are not multiples of 256 (docs/pitfalls.md #1); a +123 log-prob there collapsed training.
    z, y = _make_logits((2,), v, torch.bfloat16, "normal")
    k = _compare_logits(z, y, torch.bfloat16, 1.0, True)
    assert (k[0] <= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_strided_views_read_in_place(dtype, monkeypatch):
    # logits[:, :-1] of [B, T+1, V] and a row-padded [N, V] view: the kernel reads them through their strides.
    base, _ = _make_logits((3, 6), 300, dtype, "normal")
    seen = []
    real_op = lp_mod._token_logprobs_fwd

    def spy(logits, *args):
        seen.append((logits.data_ptr(), logits.stride()))
        return real_op(logits, *args)

    monkeypatch.setattr(lp_mod, "_token_logprobs_fwd", spy)
    view3 = base[:, :-1]
    y3 = torch.randint(0, 300, (3, 5))
    padded = torch.randn(7, 311).to(dtype)
    view2 = padded[:, 5:305]
    y2 = torch.randint(0, 300, (7,))
    assert not view3.is_contiguous() and not view2.is_contiguous()
    lp3 = rapo_fast.token_logprobs(view3, targets=y3)
    lp2 = rapo_fast.token_logprobs(view2, targets=y2)
    assert seen == [(view3.data_ptr(), view3.stride()), (view2.data_ptr(), view2.stride())], "a view was copied"
    monkeypatch.undo()
    assert_close_verbose(lp3, token_logprobs_ref(view3, y3), atol=2e-5, rtol=2e-5, name="3-D view")
    assert_close_verbose(lp2, token_logprobs_ref(view2, y2), atol=2e-5, rtol=2e-5, name="2-D view")
    _compare_logits(view3.detach().clone(), y3, dtype, 1.0, True)  # gradient of a strided input, via a copy
    # Last dim not contiguous: copied once, same result.
    zt = torch.randn(300, 4).to(dtype).T
    yt = torch.randint(0, 300, (4,))
    assert_close_verbose(rapo_fast.token_logprobs(zt, targets=yt), token_logprobs_ref(zt, yt), atol=2e-5, name="T")


def test_logits_gradient_through_one_output_only():
    # Only logp used (entropy returned but unused), then only the entropy: autograd passes no grad for the other.
    z, y = _make_logits((4,), 50, torch.float32, "normal")
    for use in (0, 1):
        a = z.clone().requires_grad_()
        rapo_fast.token_logprobs(a, targets=y, return_entropy=True)[use].sum().backward()
        b = z.clone().requires_grad_()
        token_logprobs_ref(b, y, 1.0, True)[use].sum().backward()
        assert_close_verbose(a.grad, b.grad, atol=1e-6, rtol=1e-5, name=f"output {use}")


def test_logits_int32_targets_and_empty():
    z, y = _make_logits((5,), 40, torch.float32, "normal")
    assert_close_verbose(rapo_fast.token_logprobs(z, targets=y.int()), token_logprobs_ref(z, y), atol=2e-5, name="i32")
    # no tokens at all: empty outputs and a zero gradient, no launch
    e = torch.randn(0, 40, requires_grad=True)
    lp, h = rapo_fast.token_logprobs(e, targets=torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert lp.shape == (0,) and h.shape == (0,)
    (lp.sum() + h.sum()).backward()
    assert e.grad.shape == (0, 40)


# ------------------------------------------------------------------------------------------------------------------
# hidden-state path
# ------------------------------------------------------------------------------------------------------------------


def _make_linear(lead, hd, v, dtype, with_bias):
    h = torch.randn(*lead, hd)
    w = torch.randn(v, hd) * (2.0 / hd**0.5)
    b = torch.randn(v) * 0.5 if with_bias else None
    y = torch.randint(0, v, lead)
    return h.to(dtype), w.to(dtype), None if b is None else b.to(dtype), y


def _compare_linear(h, w, b, y, dtype, temperature, return_entropy, need=(True, True, True)):
    g_lp, g_ent = _upstream(y.shape, return_entropy)
    leaves = [h.requires_grad_(need[0]), w.requires_grad_(need[1]), None if b is None else b.requires_grad_(need[2])]

    def kern(hh, ww, bb):
        return rapo_fast.token_logprobs(
            hidden=hh, weight=ww, bias=bb, targets=y, temperature=temperature, return_entropy=return_entropy
        )

    def ref(hh, ww, bb):
        return linear_token_logprobs_ref(hh, ww, y, bb, temperature, return_entropy)

    k = _fwd_bwd(kern, leaves, y.shape, return_entropy, g_lp, g_ent)
    r = _fwd_bwd(ref, leaves, y.shape, return_entropy, g_lp, g_ent)
    leaves64 = [None if x is None else x.detach().double().requires_grad_(x.requires_grad) for x in leaves]
    e = _fwd_bwd(ref, leaves64, y.shape, return_entropy, g_lp, g_ent)
    _check_all(k, r, e, dtype, ["hidden", "weight", "bias"], [dtype] * 3)
    return k


LINEAR_CASES = [
    # (lead, H, V, bias, temperature, entropy, tiled)
    ((1,), 1, 1, False, 1.0, True, False),  # N = H = V = 1
    ((37,), 111, 300, True, 1.3, True, True),  # odd sizes, many row and vocabulary tiles, bias
    ((2, 5), 64, 259, False, 0.8, False, True),  # [B, T, H], logp only
    ((11,), 111, 500, True, 1.0, True, False),  # one tile
]


def _small_tiles(monkeypatch, dtype, rows=8, cols=128):
    monkeypatch.setitem(tiles_mod.MAX_VOCAB_TILE, "cpu", cols)
    monkeypatch.setitem(tiles_mod.TILE_BYTES, "cpu", rows * cols * dtype.itemsize)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: "-".join(map(str, c)))
def test_hidden_path(case, dtype, monkeypatch):
    lead, hd, v, with_bias, temperature, ent, tiled = case
    if tiled:
        _small_tiles(monkeypatch, dtype)
    h, w, b, y = _make_linear(lead, hd, v, dtype, with_bias)
    _compare_linear(h, w, b, y, dtype, temperature, ent)


@pytest.mark.parametrize("need", [(True, False, False), (False, True, True), (False, False, True)])
def test_hidden_path_partial_gradients(need, monkeypatch):
    # Frozen lm_head (or frozen trunk): only the requested gradients are computed, and they stay right.
    _small_tiles(monkeypatch, torch.bfloat16)
    h, w, b, y = _make_linear((19,), 40, 200, torch.bfloat16, True)
    _compare_linear(h, w, b, y, torch.bfloat16, 1.0, True, need=need)


def test_hidden_path_strided_parameters(monkeypatch):
    # A transposed weight (a tied embedding stored [H, V]), a strided bias and a strided [B, T, H] hidden view, taken
    # from leaf tensors inside the call so the launcher really sees the strides.
    _small_tiles(monkeypatch, torch.float32)
    hd, v = 12, 140
    bases = [torch.randn(2, 6, hd), torch.randn(hd, v) * 0.5, torch.randn(2 * v)]
    y = torch.randint(0, v, (2, 5))
    g_lp, g_ent = _upstream(y.shape, True)

    def views(hb, wb, bb):
        h, w, b = hb[:, 1:], wb.T, bb[::2]
        assert not (h.is_contiguous() or w.is_contiguous() or b.is_contiguous())
        return h, w, b

    def kern(hb, wb, bb):
        h, w, b = views(hb, wb, bb)
        return rapo_fast.token_logprobs(hidden=h, weight=w, bias=b, targets=y, return_entropy=True)

    def ref(hb, wb, bb):
        return linear_token_logprobs_ref(*views(hb, wb, bb)[:2], y, views(hb, wb, bb)[2], 1.0, True)

    k = _fwd_bwd(kern, [x.requires_grad_() for x in bases], y.shape, True, g_lp, g_ent)
    r = _fwd_bwd(ref, bases, y.shape, True, g_lp, g_ent)
    for name, a, c in zip(
        ["logp", "entropy", "grad hidden", "grad weight", "grad bias"], [*k[:2], *k[2]], [*r[:2], *r[2]]
    ):
        assert_close_verbose(a, c, atol=1e-5, rtol=1e-4, name=name)


def test_hidden_path_large_vocab():
    # V = 152064 at small N and odd H: vocabulary tiles of the default CPU width, the last one partial.
    h, w, b, y = _make_linear((3,), 17, 152064, torch.bfloat16, False)
    k = _compare_linear(h, w, b, y, torch.bfloat16, 1.0, True)
    assert (k[0] <= 0).all()


def test_hidden_path_masked_bias():
    # -inf bias on part of the vocabulary (a common way to mask tokens) stays out of the softmax and the gradients.
    h, w, b, y = _make_linear((6,), 16, 90, torch.float32, True)
    b[torch.randperm(90)[:40]] = float("-inf")
    b[y] = 0.0
    k = _compare_linear(h, w, b, y, torch.float32, 1.0, True)
    assert all(torch.isfinite(g).all() for g in k[2][:2])


# ------------------------------------------------------------------------------------------------------------------
# CUDA (large shapes; run on a GPU machine)
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("return_entropy", [False, True])
def test_gpu_logits_path_large(return_entropy):
    z, y = _make_logits((4096,), 152064, torch.bfloat16, "normal")
    z[:64, 1000:90000] = float("-inf")
    y[:64] = 5
    _compare_logits(z.cuda(), y.cuda(), torch.bfloat16, 0.9, return_entropy, tight=True)


@pytest.mark.gpu
def test_gpu_logits_int64_offsets():
    # row * stride passes 2^31 elements (docs/pitfalls.md #5): check the last rows against the reference.
    n, v = 14200, 152064
    assert (n - 1) * v > 2**31
    z = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda")
    lp, h = rapo_fast.token_logprobs(z, targets=y, return_entropy=True)
    rl, rh = token_logprobs_ref(z[-8:], y[-8:], 1.0, True)
    assert_close_verbose(lp[-8:], rl, atol=2e-5, rtol=2e-5, name="logp tail")
    assert_close_verbose(h[-8:], rh, atol=5e-5, rtol=2e-5, name="entropy tail")
    zg = z.requires_grad_()
    lp = rapo_fast.token_logprobs(zg, targets=y)
    lp.sum().backward()
    zr = z[-8:].detach().clone().requires_grad_()
    token_logprobs_ref(zr, y[-8:]).sum().backward()
    assert_close_verbose(zg.grad[-8:], zr.grad, atol=1e-6, rtol=2**-7, name="grad tail")


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_hidden_path_large(with_bias):
    h, w, b, y = _make_linear((4096,), 4096, 152064, torch.bfloat16, with_bias)
    _compare_linear(h.cuda(), w.cuda(), None if b is None else b.cuda(), y.cuda(), torch.bfloat16, 1.0, True)


@pytest.mark.gpu
def test_gpu_hidden_path_memory():
    # Peak memory beyond inputs and gradients stays far below one [N, V] fp32 tensor (what the reference allocates).
    n, hd, v = 4096, 4096, 152064
    h, w, _, y = _make_linear((n,), hd, v, torch.bfloat16, False)
    h, w, y = h.cuda().requires_grad_(), w.cuda().requires_grad_(), y.cuda()
    g = torch.randn(n, device="cuda")
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)  # allocate the grads up front: not "extra"
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = rapo_fast.token_logprobs(hidden=h, weight=w, targets=y, return_entropy=True)
    ((lp * g).sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # grads are accumulated into the preallocated .grad (one transient copy each at most)
    allowed = n * v * 4 // 4 + h.numel() * 2 + w.numel() * 2
    assert extra < allowed, f"extra peak {extra / 2**20:.0f} MiB, allowed {allowed / 2**20:.0f} MiB"
