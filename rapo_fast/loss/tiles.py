"""Logits tiles of the hidden-state path: the tile budget, the tile shape, and the launches of the token_logprobs
kernels on one tile; shared by rapo_fast/loss/linear_logprobs.py (token_logprobs' hidden-state ops) and
rapo_fast/loss/fused_linear.py (the one-pass policy loss). rapo_fast/loss/logprobs.py (the logits= path) uses its
launch configuration and kernel loader.

What this is: a [rows, V_chunk] block of logits is formed by torch.matmul in the input dtype into a reused buffer,
then one Triton launch folds it into the per-row online state (m, s, t, target logit) or overwrites it with its
gradient grad_z. The budget bounds the tile's bytes (TILE_BYTES) and its vocabulary width (MAX_VOCAB_TILE, so that
an fp32 grad_W accumulator of one vocabulary tile stays small too); tests shrink both through these module dicts.
What this is not: the kernels (kernels/loss/token_logprobs.py), the logits= path's launches
(rapo_fast/loss/logprobs.py), or a place for autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rapo_fast._dispatch import device_guard, interpret_mode

__all__ = [
    "TILE_BYTES",
    "MAX_VOCAB_TILE",
    "device_kind",
    "launch_cfg",
    "logprob_kernels",
    "vocab_tiles",
    "tile_buffer",
    "logits_tile",
    "tile_fwd",
    "tile_grad",
]

# Byte budget of one logits tile (input dtype) of the hidden path, per device kind.
# GPU: 512 MiB keeps GEMMs at full size (e.g. 16k x 16k bf16) while the tile is ~1/20 of [16k, 152k] bf16.
# Interpreter / CPU: small, so tests exercise many tiles.
TILE_BYTES = {"gpu": 512 << 20, "cpu": 8 << 20}
MAX_VOCAB_TILE = {"gpu": 16384, "cpu": 16384}


def logprob_kernels():
    """The module of the token_logprobs kernels. Triton is imported on first use only, so that `import rapo_fast`
    stays cheap."""
    from rapo_fast.kernels.loss import token_logprobs as k

    return k


def device_kind(device: torch.device) -> str:
    """The key of TILE_BYTES / MAX_VOCAB_TILE for `device`."""
    return "gpu" if device.type == "cuda" else "cpu"


def launch_cfg(n_cols: int) -> tuple[int, int]:
    """BLOCK_V and num_warps for a row of n_cols. The interpreter runs one numpy op per block: fewer, larger blocks."""
    cap = 32768 if interpret_mode() else 4096
    block = max(16, min(cap, 1 << max(0, n_cols - 1).bit_length()))
    return block, (8 if block >= 2048 else 4)


def vocab_tiles(n: int, v: int, elem: int, device: torch.device) -> tuple[int, int]:
    """(rows, vocab columns) of one logits tile under the byte budget, at most MAX_VOCAB_TILE columns; both >= 1."""
    kind = device_kind(device)
    vc = max(1, min(v, MAX_VOCAB_TILE[kind]))
    nc = max(1, min(n, TILE_BYTES[kind] // (vc * elem)))
    return nc, vc


def tile_buffer(nc: int, vc: int, like: Tensor) -> Tensor:
    """Storage for one [nc, vc] logits tile in `like`'s dtype, reused by every tile."""
    return torch.empty(nc * vc, dtype=like.dtype, device=like.device)


def logits_tile(buf: Tensor, hc: Tensor, weight: Tensor, v0: int, v1: int) -> Tensor:
    """hc @ weight[v0:v1].T written into the front of buf (input dtype), as a [rows, v1 - v0] view."""
    z = buf[: hc.shape[0] * (v1 - v0)].view(hc.shape[0], v1 - v0)
    torch.matmul(hc, weight[v0:v1].T, out=z)
    return z


def tile_fwd(
    z: Tensor, targets: Tensor, bias: Tensor | None, state: Tensor, logp: Tensor, lse: Tensor,
    entropy: Tensor | None, *, v0: int, vocab: int, inv_temp: float,
) -> None:  # fmt: skip
    """Fold the logits tile z [rows, cols] (vocabulary columns v0 .. v0 + cols of `vocab`) into the online state
    [4, rows] (m, s, t, scaled target logit) of its rows; the first vocabulary tile starts the state, the last one
    writes logp, lse and, unless entropy is None, the entropy ([rows] fp32 each)."""
    rows, cols = z.shape
    block, warps = launch_cfg(cols)
    with device_guard(z):
        logprob_kernels().token_logprobs_fwd_kernel[(rows,)](
            z_ptr=z, tgt_ptr=targets, bias_ptr=z if bias is None else bias,
            m_ptr=state[0], s_ptr=state[1], t_ptr=state[2], zt_ptr=state[3],
            logp_ptr=logp, lse_ptr=lse, ent_ptr=lse if entropy is None else entropy,
            rows_inner=rows, stride_outer=0, stride_inner=cols, n_cols=cols, v_start=v0, inv_temp=inv_temp,
            INIT=v0 == 0, FINAL=v0 + cols == vocab, HAS_BIAS=bias is not None, WITH_ENTROPY=entropy is not None,
            BLOCK_V=block, num_warps=warps,
        )  # fmt: skip


def tile_grad(
    z: Tensor, targets: Tensor, bias: Tensor | None, lse: Tensor, g_logp: Tensor, *, v0: int, inv_temp: float,
    entropy: Tensor | None = None, g_entropy: Tensor | None = None,
) -> None:  # fmt: skip
    """Overwrite the logits tile z [rows, cols] (vocabulary columns from v0) with grad_z, the gradient of
    sum_t g_logp_t logp_t (+ g_entropy_t H_t when both entropy and g_entropy are given); lse etc. are [rows] fp32."""
    rows, cols = z.shape
    block, warps = launch_cfg(cols)
    with_entropy = entropy is not None and g_entropy is not None
    with device_guard(z):
        logprob_kernels().token_logprobs_bwd_kernel[(rows,)](
            z_ptr=z, gz_ptr=z, tgt_ptr=targets, bias_ptr=z if bias is None else bias, lse_ptr=lse,
            ent_ptr=entropy if with_entropy else lse, glp_ptr=g_logp, gent_ptr=g_entropy if with_entropy else g_logp,
            rows_inner=rows, stride_outer=0, stride_inner=cols, stride_gz=cols, n_cols=cols, v_start=v0,
            inv_temp=inv_temp, HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, BLOCK_V=block, num_warps=warps,
        )  # fmt: skip
