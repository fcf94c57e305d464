"""Shared builders of the loss tests: random loss inputs (`make_batch`), the kernel-vs-reference-vs-float64 check of
one option set (`check_case`), the aggregation modes and a set of every option (`FULL`).

Tolerance (tests/helpers/__init__.py): |kernel - ref64| <= 2 |ref_dtype - ref64| + atol[dtype] for the loss and
every gradient; metrics in the same dtype as the reference (atol 1e-5, counts exactly). Not a test file.
"""

from __future__ import annotations

import torch

import rapo_fast
from helpers import assert_close_verbose, assert_within_ref_error
from rapo_fast.reference import rapo_loss_ref

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
TENSOR_KEYS = ("old_logp", "advantages", "behav_logp", "ref_logp")


def make_batch(
    B=3,
    T=7,
    V=11,
    *,
    seg_lens=None,
    H=None,
    bias=True,
    per_seq_adv=False,
    mask_p=0.8,
    ret_p=0.3,
    masked_rows=(),
    response=False,
    spread=0.3,
    seed=0,
):
    """Random inputs in fp32. Padded [B, T] unless seg_lens (flat, cu_seqlens from the lengths). H: hidden path."""
    g = torch.Generator().manual_seed(seed)
    flat = seg_lens is not None
    lead = (sum(seg_lens),) if flat else (B, T)
    rows = len(seg_lens) if flat else B
    d = {}
    if H is None:
        d["logits"] = torch.randn(*lead, V, generator=g) * 2
        z = d["logits"]
    else:
        d["hidden"] = torch.randn(*lead, H, generator=g)
        d["weight"] = torch.randn(V, H, generator=g) / H**0.5 * 2
        if bias:
            d["bias"] = torch.randn(V, generator=g) * 0.1
        z = d["hidden"] @ d["weight"].T + (d["bias"] if bias else 0)
    d["targets"] = torch.randint(0, V, lead, generator=g)
    logp = torch.log_softmax(z.double(), -1).gather(-1, d["targets"][..., None])[..., 0].float()
    # a log-prob is <= 0 (rapo_loss refuses old_logp > OLD_LOGP_MAX at tokens in the loss): the noise is clamped
    d["old_logp"] = (logp + spread * torch.randn(lead, generator=g)).clamp(max=0.0)
    d["behav_logp"] = d["old_logp"] + 0.2 * torch.randn(lead, generator=g)
    d["ref_logp"] = logp + spread * torch.randn(lead, generator=g)
    d["advantages"] = torch.randn((rows,) if per_seq_adv else lead, generator=g)
    lm = torch.rand(lead, generator=g) < mask_p
    if flat:
        cu = torch.tensor([0] + seg_lens).cumsum(0)
        d["cu_seqlens"] = cu
        for r in masked_rows:
            lm[cu[r] : cu[r + 1]] = False
    else:
        for r in masked_rows:
            lm[r] = False
    d["loss_mask"] = lm
    d["retrieved_mask"] = torch.rand(lead, generator=g) < ret_p
    if response:
        d["response_mask"] = torch.rand(lead, generator=g) < 0.9
    return d


def inputs_for(d, dtype):
    """Leaf copies: the float activations (logits/hidden/weight/bias) in `dtype` with grad, the rest as given."""
    out, leaves = {}, []
    for k, v in d.items():
        if k in ("logits", "hidden", "weight", "bias"):
            v = v.detach().to(dtype).requires_grad_(True)
            leaves.append(k)
        elif k in TENSOR_KEYS and dtype == torch.float64:
            v = v.double()
        out[k] = v
    return out, leaves


def run_case(fn, d, dtype, opts):
    x, leaves = inputs_for(d, dtype)
    loss, metrics = fn(**x, **opts, return_metrics=True)
    grads = torch.autograd.grad(loss, [x[k] for k in leaves], allow_unused=True)
    # the metrics by name: the reference's dict, or our LossMetrics' 0-dim fields
    return loss, dict(zip(leaves, grads)), metrics if isinstance(metrics, dict) else metrics.scalars()


def check_case(d, opts, dtype=torch.float32, *, fn=None, metrics_atol=1e-5, device="cpu"):
    """The tolerance rule on loss and every gradient, kernel (`fn`, default rapo_fast.rapo_loss, on `device`) vs the
    references (on the CPU)."""
    fn = fn or rapo_fast.rapo_loss
    loss_k, g_k, m_k = run_case(fn, {k: v.to(device) for k, v in d.items()}, dtype, opts)
    loss_r, g_r, m_r = run_case(rapo_loss_ref, d, dtype, opts)
    d64 = {k: (v.double() if v.is_floating_point() else v) for k, v in d.items()}
    loss_64, g_64, m_64 = run_case(rapo_loss_ref, d64, torch.float64, opts)
    assert loss_k.shape == () and loss_k.dtype == torch.float32
    assert torch.isfinite(loss_k)
    assert_within_ref_error(loss_k, loss_r, loss_64, dtype, name=f"loss {opts}")
    for k in g_k:
        assert g_k[k].dtype == dtype
        assert_within_ref_error(g_k[k], g_r[k], g_64[k], dtype, name=f"grad {k} {opts}")
    assert set(m_k) == set(m_r)
    n_on = max(float(m_r["num_tokens"] - m_r["num_offpolicy_tokens"]), 1.0)
    for k in m_k:
        assert m_k[k].shape == () and not m_k[k].requires_grad
        if k.startswith("num_"):
            assert_close_verbose(m_k[k], m_r[k], atol=0.0, name=f"metric {k}")
        elif dtype == torch.float32:
            assert_close_verbose(m_k[k], m_r[k], atol=metrics_atol, rtol=1e-5, name=f"metric {k} {opts}")
        elif "frac" in k and k != "retrieved_frac":
            # the kernel's logp in low precision may move a token across a clip boundary: allow two such tokens
            assert_close_verbose(m_k[k], m_r[k], atol=2.5 / n_on, name=f"metric {k} {opts}")
        else:
            assert_within_ref_error(m_k[k], m_r[k], m_64[k], dtype, name=f"metric {k} {opts}")
    return loss_k, g_k, m_k


FULL = dict(
    offpolicy_train="truncated",
    tis_cap=1.5,
    dual_clip=3.0,
    beta=0.1,
    kl_estimator="k3",
    entropy_coef=0.01,
    shaping_m=0.05,
)
