"""Shared @triton.jit math of the rapo_fast kernels: the online log-sum-exp / entropy update over vocabulary blocks,
its finalisation, the per-element gradient of (log-prob, entropy) w.r.t. the logits, and the interpreter switch for
`tl.dot` operands.

What this is: device functions other kernels inline. Every formula works on logits relative to the row max m, so
errors scale with |z - m|, not |m|; the online state (m, s, t), its finalisation and the gradient: docs/loss.md
section 2; the -inf guards: docs/pitfalls.md #2 and #3.
What this is not: a kernel, a launcher, or anything that touches torch tensors.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreter_upcast() -> bool:
    """The value launchers pass as the UPCAST_DOT constexpr: True under TRITON_INTERPRET=1.

    The interpreter returns garbage for `tl.dot` on bf16 operands (docs/interpreter.md); fp32 operands are right.
    On a GPU the operands stay in their dtype so tensor cores are used.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dot_operand(x, UPCAST_DOT: tl.constexpr):
    """A `tl.dot` operand: upcast to fp32 only when the launcher says we run in the interpreter."""
    if UPCAST_DOT:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def load_scaled_logits(z_row, bias_ptr, v_start, c, mask, inv_temp, HAS_BIAS: tl.constexpr):
    """One block of a row's logits (+ bias) in fp32, divided by the temperature. Padded lanes load -inf and stay -inf
    after the scaling because inv_temp > 0 (docs/pitfalls.md #4)."""
    z = tl.load(z_row + c, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + v_start + c, mask=mask, other=0.0).to(tl.float32)
    return z * inv_temp


@triton.jit
def online_lse_update(m, s, t, z):
    """Fold one block `z` (fp32, masked lanes = -inf) of a row into the running (m, s, t); returns the new state.

    m, s, t are fp32 scalars (m = -inf, s = t = 0 for an empty state).
    """
    m_new = tl.maximum(m, tl.max(z, axis=0))
    # While everything seen is -inf, shift by 0 instead of -inf so no exp(-inf - -inf) appears (docs/pitfalls.md #3).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    # Old t was relative to m; re-centre it on m_new: t' = alpha * (t + (m - m_new) * s). When m = -inf, s = t = 0.
    shift = tl.where(m == float("-inf"), 0.0, m - m_safe)
    d = z - m_safe
    e = tl.exp(d)
    # e = 0 where z = -inf; zero d there before the product rather than mask 0 * -inf afterwards.
    ed = e * tl.where(e > 0.0, d, 0.0)
    s_new = s * alpha + tl.sum(e, axis=0)
    t_new = alpha * (t + shift * s) + tl.sum(ed, axis=0)
    return m_new, s_new, t_new


@triton.jit
def log_sum_entropy(s, t):
    """(s, t) of the final state -> (log s, entropy). The row's statistics are (m, log s), never lse = m + log s:
    rounding that sum to fp32 costs ulp(m) (docs/loss.md section 2). A row of only -inf gives m = log s = -inf, a
    row with NaN or +inf log s = NaN; the log-prob and entropy of either are NaN, as in the reference."""
    log_s = tl.log(s)
    return log_s, log_s - t / s


@triton.jit
def row_logprob(z, m, log_s):
    """log p of the scaled logits z (a block, or the target's one logit) from the row's (m, log s): (z - m) - log s,
    relative to the row max, so that its error scales with |z - m|, not with |m| (z - lse would round
    lse = m + log s to fp32 first: an error of ulp(m), 1e-3 at |m| = 1e4). A row of only -inf gives -inf - -inf =
    NaN, as log_sum_entropy says."""
    return (z - m) - log_s


@triton.jit
def is_finite(x):
    """x is neither NaN nor +-inf."""
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def logprob_entropy_grad(z, is_target, m, log_s, ent, g_lp, g_ent, inv_temp, WITH_ENTROPY: tl.constexpr):
    """d(g_lp * logp + g_ent * H)/d(logits) for one block, with z the temperature-scaled logits (fp32) and (m, log s)
    the row's statistics saved by the forward.

    grad = (g_lp * (onehot - p) - g_ent * p * (log p + H)) / T with log p = row_logprob(z, m, log s), so that p, like
    the forward, carries no error of size ulp(m). Lanes with p = 0 (-inf logits, padding) get no entropy term, which
    would otherwise be 0 * -inf; a row whose m or log s is not finite gets 0.
    """
    logp = row_logprob(z=z, m=m, log_s=log_s)
    p = tl.exp(logp)
    grad = g_lp * (is_target.to(tl.float32) - p)
    if WITH_ENTROPY:
        grad -= g_ent * p * tl.where(p > 0.0, logp + ent, 0.0)
    # A row whose lse = m + log s is not finite (only -inf: a padding row; any NaN or +inf) has NaN log-prob and
    # entropy and an exactly-zero gradient, as in the reference: a masked padding row must not put NaN into the
    # optimiser step through 0 * NaN (docs/loss.md section 2). log s <= log V, so lse is finite exactly when both are.
    row_ok = is_finite(m) & is_finite(log_s)
    return tl.where(row_ok, grad * inv_temp, 0.0)
