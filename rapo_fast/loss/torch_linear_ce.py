"""The CPU fallback of token_logprobs(hidden=...) through PyTorch's own chunked linear cross-entropy.

What this is: where Triton does not run, log-probs from hidden states without entropy by torch's
F.linear_cross_entropy (torch >= 2.13), chunked so that it never holds [N, V] (but for batches whose logits fit in
SMALL_BYTES). Why this path and where it does not apply:
docs/loss.md section 2, "Without Triton"; rapo_fast/loss/path_plan.py picks it.
What this is not: the path for entropy, for a row whose log-sum-exp is not finite, or under torch.compile tracing.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["linear_logprobs_torch", "torch_linear_ce_available"]

_LCE = getattr(torch.nn.functional, "linear_cross_entropy", None)
_OPTIONS = getattr(torch.nn, "LinearCrossEntropyOptions", None)
CHUNK_BYTES = 32 << 20  # fp32 logits of one chunk: 256 rows at V = 32768, the anchor the CPU bench compares with
# fp32 logits up to this size go through torch's unchunked op (options=None: linear, then cross_entropy, which keeps
# the [N, V] log-softmax for the backward): the chunked op precomputes both gradients in its forward, a fixed cost that
# makes it 1.1-3x slower below this size on the CPU; above it, without a gradient, the unchunked op is the slower one
# (bench/NOTES_token_logprobs.md)
SMALL_BYTES = 1 << 20


def torch_linear_ce_available() -> bool:
    """Whether this torch has the chunked F.linear_cross_entropy (torch >= 2.13)."""
    return _LCE is not None and _OPTIONS is not None


def chunk_rows(n: int, v: int) -> int:
    """Rows per chunk of torch's op: a [rows, V] fp32 logits chunk within CHUNK_BYTES, a power of two, at least 32.
    torch's own default for fp32 on the CPU ("aspect_ratio:2") gives 16 rows at N=2048, H=512, V=32768 and ran 3x
    slower than 256 rows; 128 to 1024 rows were within 15% of each other there (bench/NOTES_token_logprobs.md)."""
    rows = max(1, CHUNK_BYTES // (4 * max(v, 1)))
    return max(32, min(max(n, 1), 1 << (rows.bit_length() - 1)))


@functools.lru_cache(maxsize=64)
def _options(rows: int):
    """torch's (immutable) options object for a chunk size: building one is a visible cost at small N; bounded, since
    the chunk size takes any value from 32 up to the bound when N is below it. Never traced: this path is not taken
    under torch.compile."""
    return _OPTIONS(batch_chunk_size=rows, chunking_method=None)


def linear_logprobs_torch(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float
) -> Tensor:
    """logp [targets.shape] fp32 of softmax((hidden @ weight.T + bias) / T) at targets, by torch's op (needs
    torch_linear_ce_available()). Non-finite where a row's loss is not finite: the caller checks (module docstring).
    Arguments are already validated by token_logprobs."""
    h = hidden.reshape(-1, hidden.shape[-1])
    w, b = weight, bias
    if h.dtype != torch.float32:  # fp32 log-softmax and gradient sums; grads rounded once by these casts' backward
        h, w = h.float(), w.float()
        b = None if b is None else b.float()
    if temperature != 1.0:  # (h W^T + b) / T = (h / T) W^T + b / T: an [N, H] scale instead of an [N, V] one
        h = h / temperature
        b = None if b is None else b / temperature
    y = targets.reshape(-1).long()
    n, v = h.shape[0], w.shape[0]
    opts = None if 4 * n * v <= SMALL_BYTES else _options(chunk_rows(n, v))
    loss = _LCE(h, w, y, linear_bias=b, reduction="none", options=opts)
    return (-loss).view(targets.shape)
