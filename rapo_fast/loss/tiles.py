"""Logits tiles of the hidden-state path: the tile budget, the tile shape, and the launches of the token_logprobs
kernels on one tile; shared by rapo_fast/loss/linear_logprobs.py and rapo_fast/loss/fused_linear.py.

What this is: `tile_budget`, TILE_BYTES, MAX_VOCAB_TILE (module dicts that tests shrink), the per-tile launches and
`accumulate_fp32`. How the budget is set and how fp32 sums are made: docs/loss.md section 2, "Hidden path".
What this is not: the kernels (rapo_fast/kernels/loss/token_logprobs.py), the logits= path's launches
(rapo_fast/loss/logprobs.py), or a place for autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rapo_fast._dispatch import device_guard, interpret_mode

__all__ = [
    "TILE_BYTES",
    "MAX_VOCAB_TILE",
    "FREE_FRACTION",
    "MIN_TILE_BYTES",
    "budget_from_free",
    "tile_budget",
    "balanced_rows",
    "fp32_addmm_supported",
    "accumulate_fp32",
    "device_kind",
    "launch_cfg",
    "logprob_kernels",
    "vocab_tiles",
    "tile_buffer",
    "logits_tile",
    "tile_fwd",
    "tile_grad",
    "finite_rows",
    "mark_rows_undefined",
]

# Byte budget of one logits tile (input dtype) of the hidden path, per device kind.
# GPU: the cap of the free-memory budget (tile_budget). 8 GiB holds the whole [16k, 152k] bf16 logits (5 GB), so that
# on a device with room the fused loss runs one token tile and writes grad_W with one GEMM per vocabulary tile.
# Interpreter / CPU: the budget itself, small, so tests exercise many tiles.
TILE_BYTES = {"gpu": 8 << 30, "cpu": 8 << 20}
MAX_VOCAB_TILE = {"gpu": 16384, "cpu": 16384}
# GPU: the tile takes at most this fraction of the free memory (the rest is left to the gradients the call allocates
# -- grad_h [N, H], grad_W [V, H] and its fp32 accumulator -- and to the caller), and at least MIN_TILE_BYTES.
FREE_FRACTION = 0.25
MIN_TILE_BYTES = 64 << 20

# (device type, index, dtype) -> whether torch.addmm(..., out_dtype=torch.float32, out=fp32) runs there
_FP32_ADDMM: dict[tuple[str, int | None, torch.dtype], bool] = {}


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


def budget_from_free(free_bytes: int, cap: int, *, fraction: float | None = None, floor: int | None = None) -> int:
    """The tile budget for `free_bytes` of free device memory: fraction * free (default FREE_FRACTION), at most cap, at
    least min(floor, cap) (default MIN_TILE_BYTES; both read at call time). A pure function (tested on its own);
    tile_budget feeds it the device's free memory."""
    fraction = FREE_FRACTION if fraction is None else fraction
    floor = MIN_TILE_BYTES if floor is None else floor
    return int(max(min(floor, cap), min(cap, int(free_bytes * fraction))))


def free_device_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device as a tensor could use it: the driver's free memory plus what torch's caching
    allocator holds reserved but unallocated."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def tile_budget(device: torch.device) -> int:
    """Byte budget of one logits tile on `device`: budget_from_free(free memory, TILE_BYTES["gpu"]) on CUDA (one
    query of the driver per call), the fixed TILE_BYTES["cpu"] elsewhere."""
    kind = device_kind(device)
    if device.type != "cuda":
        return TILE_BYTES[kind]
    return budget_from_free(free_device_bytes(device), TILE_BYTES[kind])


def balanced_rows(n: int, max_rows: int) -> int:
    """Rows per token tile: as few tiles as max_rows allows, of near-equal size (ceil(n / tiles); the last tile is
    at most tiles - 1 rows shorter), so that no tile is a small remainder. >= 1, at most max(1, max_rows)."""
    max_rows = max(1, max_rows)
    n_tiles = max(1, -(-n // max_rows))
    return max(1, -(-n // n_tiles))


def vocab_tiles(n: int, v: int, elem: int, device: torch.device) -> tuple[int, int]:
    """(rows, vocab columns) of one logits tile under the byte budget, at most MAX_VOCAB_TILE columns; both >= 1."""
    vc = max(1, min(v, MAX_VOCAB_TILE[device_kind(device)]))
    nc = balanced_rows(n, min(n, tile_budget(device) // (vc * elem)))
    return nc, vc


def _probe_fp32_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    a = torch.tensor([[1.0, 2.0]], dtype=dtype, device=device)
    b = torch.tensor([[3.0], [4.0]], dtype=dtype, device=device)
    acc = torch.full((1, 1), 0.5, dtype=torch.float32, device=device)
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError, TypeError):  # no such overload, or no kernel for this device/dtype
        return False
    return acc.dtype == torch.float32 and float(acc.item()) == 11.5  # 0.5 + 1 * 3 + 2 * 4: beta = 1 kept self


def fp32_addmm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)` runs for `dtype` inputs and an fp32 acc on
    `device` (CUDA in recent torch; not the CPU in torch 2.13; torch versions differ on whether an fp32 self is taken,
    hence a probe rather than a version test). Probed once per device and dtype (one tiny GEMM and one sync)."""
    if dtype == torch.float32:
        return True
    key = (device.type, device.index, dtype)
    if key not in _FP32_ADDMM:
        _FP32_ADDMM[key] = _probe_fp32_addmm(device, dtype)
    return _FP32_ADDMM[key]


def accumulate_fp32(acc: Tensor, a: Tensor, b: Tensor, *, first: bool, chunk: int) -> None:
    """acc = a @ b, or acc += a @ b unless first; acc fp32 [m, n], a [m, k] and b [k, n] in the input dtype.

    fp32 inputs: addmm_ in place. bf16/fp16 where fp32_addmm_supported: one addmm with out_dtype=float32 into acc (the
    GEMM accumulates in fp32 and reads/writes acc in its epilogue: no low-precision product, no temporary). Otherwise
    (the CPU, or a torch without the overload) the product in the input dtype, summed into acc in row chunks of at most
    `chunk` rows so that the temporary stays small."""
    beta = 0.0 if first else 1.0  # beta = 0: acc's old content (uninitialised) is ignored, not multiplied
    if a.dtype == torch.float32:
        acc.addmm_(a, b, beta=beta)
    elif fp32_addmm_supported(a.device, a.dtype):
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        for c0 in range(0, acc.shape[0], max(1, chunk)):
            c1 = min(acc.shape[0], c0 + max(1, chunk))
            part = a[c0:c1] @ b
            if first:
                acc[c0:c1].copy_(part)
            else:
                acc[c0:c1] += part


def tile_buffer(nc: int, vc: int, like: Tensor) -> Tensor:
    """Storage for one [nc, vc] logits tile in `like`'s dtype, reused by every tile."""
    return torch.empty(nc * vc, dtype=like.dtype, device=like.device)


def logits_tile(buf: Tensor, hc: Tensor, weight: Tensor, v0: int, v1: int) -> Tensor:
    """hc @ weight[v0:v1].T written into the front of buf (input dtype), as a [rows, v1 - v0] view."""
    z = buf[: hc.shape[0] * (v1 - v0)].view(hc.shape[0], v1 - v0)
    torch.matmul(hc, weight[v0:v1].T, out=z)
    return z


def tile_fwd(
    z: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    state: Tensor,
    logp: Tensor,
    stats: Tensor,
    entropy: Tensor | None,
    *,
    v0: int,
    vocab: int,
    inv_temp: float,
) -> None:
    """Fold the logits tile z [rows, cols] (vocabulary columns v0 .. v0 + cols of `vocab`) into the online state
    [4, rows] (m, s, t, scaled target logit) of its rows; the first vocabulary tile starts the state, the last one
    writes logp [rows], stats [2, rows] (the rows' max m and log s, what tile_grad reads) and, unless entropy is None,
    the entropy [rows] (fp32 each)."""
    rows, cols = z.shape
    block, warps = launch_cfg(cols)
    with device_guard(z):
        logprob_kernels().token_logprobs_fwd_kernel[(rows,)](
            z_ptr=z,
            tgt_ptr=targets,
            bias_ptr=z if bias is None else bias,
            m_ptr=state[0],
            s_ptr=state[1],
            t_ptr=state[2],
            zt_ptr=state[3],
            logp_ptr=logp,
            row_max_ptr=stats[0],
            log_s_ptr=stats[1],
            ent_ptr=logp if entropy is None else entropy,
            rows_inner=rows,
            stride_outer=0,
            stride_inner=cols,
            n_cols=cols,
            v_start=v0,
            inv_temp=inv_temp,
            INIT=v0 == 0,
            FINAL=v0 + cols == vocab,
            HAS_BIAS=bias is not None,
            WITH_ENTROPY=entropy is not None,
            BLOCK_V=block,
            num_warps=warps,
        )


def tile_grad(
    z: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    stats: Tensor,
    g_logp: Tensor,
    *,
    v0: int,
    inv_temp: float,
    entropy: Tensor | None = None,
    g_entropy: Tensor | None = None,
) -> None:
    """Overwrite the logits tile z [rows, cols] (vocabulary columns from v0) with grad_z, the gradient of
    sum_t g_logp_t logp_t (+ g_entropy_t H_t when both entropy and g_entropy are given); stats [2, rows] (tile_fwd's),
    the others [rows], all fp32."""
    rows, cols = z.shape
    block, warps = launch_cfg(cols)
    with_entropy = entropy is not None and g_entropy is not None
    with device_guard(z):
        logprob_kernels().token_logprobs_bwd_kernel[(rows,)](
            z_ptr=z,
            gz_ptr=z,
            tgt_ptr=targets,
            bias_ptr=z if bias is None else bias,
            row_max_ptr=stats[0],
            log_s_ptr=stats[1],
            ent_ptr=entropy if with_entropy else g_logp,
            glp_ptr=g_logp,
            gent_ptr=g_entropy if with_entropy else g_logp,
            rows_inner=rows,
            stride_outer=0,
            stride_inner=cols,
            stride_gz=cols,
            n_cols=cols,
            v_start=v0,
            inv_temp=inv_temp,
            HAS_BIAS=bias is not None,
            WITH_ENTROPY=with_entropy,
            BLOCK_V=block,
            num_warps=warps,
        )


def finite_rows(hidden: Tensor) -> tuple[Tensor, Tensor]:
    """(hidden with every row that holds a NaN or an inf replaced by zeros, bad [rows] bool marking those rows).

    grad_W = grad_z^T h sums over every row, so a masked row of NaN would put 0 * NaN = NaN into grad_W although its
    grad_z row is zero: the GEMMs take the zeroed rows instead, and mark_rows_undefined makes those rows' log-prob,
    stats and entropy NaN afterwards (what the row would have given; its NaN stats make tile_grad write a zero grad_z
    row). One elementwise pass over [rows, H], small next to the [rows, H] x [H, V] GEMM that follows."""
    bad = ~torch.isfinite(hidden).all(-1)
    return torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=hidden.dtype, device=hidden.device), hidden), bad


def mark_rows_undefined(bad: Tensor, *vectors: Tensor | None) -> None:
    """Write NaN into each [rows] or [k, rows] tensor (log-prob, stats, entropy) where bad [rows] is set, in place
    (None skipped)."""
    for v in vectors:
        if v is not None and v.numel():
            v.masked_fill_(bad, float("nan"))
