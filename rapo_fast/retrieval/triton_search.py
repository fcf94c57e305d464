"""The Triton search path of StepBuffer.search on CUDA: its launcher, argument checks, the merge of the per-split
candidates, and the dispatch table that picks the Triton path or the CUDA backend per call.

What this is: `triton_search(...)` (the contract of `rapo_fast::retrieval_search`; also on CPU under TRITON_INTERPRET=1)
and `select_backend` (RAPO_FAST_RETRIEVAL_BACKEND, else CROSSOVERS, whose rows are PREDICTED, not measured: replaced by
the GPU run's figures). Both: docs/retrieval.md, "Triton path".
What this is not: the kernel (rapo_fast/kernels/retrieval/search.py), StepBuffer's argument checks (rapo_fast/retrieval/
buffer.py), or the CUDA backend (csrc/retrieval_cuda.cu).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rapo_fast._checks import brief, check_int, check_same_device, check_tensor
from rapo_fast._constants import COSINE_EPS, MAX_K, METRIC_COSINE, METRIC_IP, METRIC_L2, TRITON_EMPTY_KEY
from rapo_fast._dispatch import device_guard, interpret_mode

__all__ = [
    "CROSSOVERS",
    "CROSSOVERS_STATUS",
    "Crossover",
    "BACKEND_ENV",
    "TILES_ENV",
    "select_backend",
    "triton_search",
    "gpu_tiles",
    "plan",
    "workspace_layout",
]

BACKEND_ENV = "RAPO_FAST_RETRIEVAL_BACKEND"
_MAX_C = 2**31 - 2**20  # the kernel's int32 key indices (a split's end: C + splits x BLOCK_C) stay below 2^31
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SENTINEL = TRITON_EMPTY_KEY  # an empty candidate (rapo_fast/kernels/retrieval/search.py reads the same constant)


@dataclass(frozen=True)
class Crossover:
    """One row of the dispatch table: calls with this key dtype, Q >= min_q, C >= min_c and k <= max_k go to
    `backend`. The first matching row wins; no match means 'cuda'. The rows of CROSSOVERS are PREDICTED, not
    measured: replaced by the GPU run's figures (CROSSOVERS_STATUS)."""

    dtype: torch.dtype
    min_q: int
    min_c: int
    max_k: int
    backend: str


# Every row is a prediction from the kernels' design, none a timing: why these bounds is docs/perf.md, "Predicted
# crossover"; bench/gpu/call1_headline.py times `ours_cuda` and `ours_triton` side by side; its numbers replace them.
CROSSOVERS_STATUS = "PREDICTED, not measured: replaced by the GPU run's figures"
CROSSOVERS: tuple[Crossover, ...] = (
    Crossover(torch.float16, min_q=512, min_c=1_000_000, max_k=256, backend="triton"),
    Crossover(torch.bfloat16, min_q=512, min_c=1_000_000, max_k=256, backend="triton"),
)


def select_backend(Q: int, C: int, D: int, dtype: torch.dtype, k: int, metric: int, override: str | None = None) -> str:
    """'cuda' or 'triton' for a search on CUDA tensors. `override` (or the env var RAPO_FAST_RETRIEVAL_BACKEND when
    None) is 'cuda', 'triton' or 'auto' (the table). l2 (metric 2) scores fp32 centred keys: CUDA under 'auto'."""
    choice = os.environ.get(BACKEND_ENV, "auto") if override is None else override
    if choice not in ("cuda", "triton", "auto"):
        raise ValueError(f"{BACKEND_ENV} (or backend): expected 'cuda', 'triton' or 'auto', got {choice!r}")
    if choice != "auto":
        return choice
    if metric == METRIC_L2 or dtype == torch.float32 or C > _MAX_C:
        return "cuda"
    for row in CROSSOVERS:
        if dtype == row.dtype and Q >= row.min_q and C >= row.min_c and k <= row.max_k:
            return row.backend
    return "cuda"


@dataclass(frozen=True)
class Plan:
    """Launch configuration: tile sizes, workspace row width W, merge row chunk, splits of the keys."""

    block_q: int
    block_c: int
    block_d: int
    kp: int
    w: int
    rows: int
    splits: int
    keys_per_split: int
    num_warps: int
    num_stages: int


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


TILES_ENV = "RAPO_FAST_TRITON_RETRIEVAL_TILES"


def gpu_tiles(fp32: bool, aligned: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_Q, BLOCK_C, BLOCK_D, num_warps, num_stages) on a GPU. `aligned`: D, both row strides and both base
    addresses multiples of 16 (as the JIT specialises them), so that the D loop is pipelined through shared memory.

    fp16/bf16, aligned: 128 x 128 x 64, 8 warps, 3 stages: 64 flop per byte streamed from L2 (the scan is L2 bound),
    at the price of a few bytes of stack reloaded once per merge, never in the per-tile path. Not aligned (an odd D):
    loads go through registers, so BLOCK_D is 16 and BLOCK_C 64. fp32 (FMA, no TF32): 64 x 64 x 16, 8 warps, 1 stage
    (BLOCK_D 32 spills 80 B under Triton 3.9 with the 64-wide tile's merge block). The measured registers and spills of
    each choice, under the GPU image's Triton and CI's, and of their alternatives: bench/NOTES_retrieval.md, "Registers
    and spills". TILES_ENV ("128,64,64,8,3") overrides them all, for the GPU run to
    compare (docs/retrieval.md, "Triton path"); tests/test_sm90_compile.py holds these choices' registers, spills and
    shared memory to stated bounds."""
    env = os.environ.get(TILES_ENV)
    if env:
        vals = tuple(int(v) for v in env.split(","))
        if len(vals) != 5 or min(vals[3:]) < 1 or any(v < 16 or v & (v - 1) for v in vals[:3]) or vals[1] < 32:
            raise ValueError(
                f"{TILES_ENV}: expected 'BQ,BC,BD,warps,stages' with powers of two >= 16 (BC >= 32: two halves of at "
                f"least 16), got {env!r}"
            )
        return vals  # type: ignore[return-value]
    if fp32:
        return (64, 64, 16, 8, 1)
    return (128, 128, 64, 8, 3) if aligned else (128, 64, 16, 8, 3)


def workspace_layout(k: int, block_q: int, block_c: int, on_gpu: bool) -> tuple[int, int, int]:
    """(KP, W, ROWS): the running list's width (k rounded up to a power of two), the workspace row width, and the rows
    a merge takes at a time."""
    kp = _pow2(k)
    w = _pow2(kp + 2 * block_c)  # room for at least one tile of survivors after the running list, with slack
    # The merge's [rows, W] int64 block: 32 x BLOCK_C entries (4096 at the 128-wide tile, 2048 at the 64-wide ones).
    # Triton spreads each row over all warps, so every bisection step pays one cross-warp reduction whatever `rows` is:
    # more rows a chunk, fewer of them. The size is what spills least on sm_90a under both Triton 3.6 (the GPU image)
    # and 3.9 (CI): 2048 entries take the 128-wide tile from 32 to 96 B of stack under 3.9; 4096 put 64-96 B on the
    # 64-wide tiles under 3.6 (bench/NOTES_retrieval.md, "Registers and spills"). The interpreter takes all rows at
    # once.
    rows = max(1, min(block_q, 32 * block_c // w)) if on_gpu else block_q
    return kp, w, rows


def plan(
    Q: int, C: int, k: int, fp32: bool, device: torch.device, splits: int | None = None, aligned: bool = True
) -> Plan:
    """Tiles and splits. GPU: `gpu_tiles`, and about 4 waves of programs over the SMs with the workspace held under
    512 MiB and at least 64 key tiles a split. Interpreter: small tiles, so that tests cross many tiles, splits and
    merges quickly. `splits` forces the split count (tests)."""
    if device.type == "cuda":
        bq, bc, bd, warps, stages = gpu_tiles(fp32, aligned)
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count
        target = max(1, (4 * n_sm) // -(-Q // bq))
        min_tiles = 64  # a merge costs about as much as ten tiles, and a split merges at least twice
    else:
        bq, bc, bd, warps, stages = 16, 32, 16, 4, 1
        target, min_tiles = 2, 1
    kp, w, rows = workspace_layout(k, bq, bc, device.type == "cuda")
    n_tiles = max(1, -(-C // bc))
    cap = max(1, (512 << 20) // max(1, Q * w * 8))
    s = splits if splits is not None else min(target, cap, max(1, n_tiles // min_tiles))
    s = max(1, min(s, n_tiles))
    per = -(-n_tiles // s) * bc
    s = max(1, -(-C // per))
    return Plan(bq, bc, bd, kp, w, rows, s, per, warps, stages)


def _check(keys, key_aux, groups, queries, exclude, k, metric, min_score, centre) -> None:
    """Every argument the kernel reads, checked before any launch (ValueError / TypeError naming it)."""
    for name, t in (("keys", keys), ("queries", queries), ("key_aux", key_aux), ("groups", groups)):
        check_tensor(name, t)
    if keys.dim() != 2 or queries.dim() != 2 or keys.shape[1] != queries.shape[1]:
        raise ValueError(f"keys/queries: expected [C, D] and [Q, D], got {tuple(keys.shape)}, {tuple(queries.shape)}")
    if keys.dtype not in _DTYPES or queries.dtype != keys.dtype:
        raise TypeError(f"keys/queries: expected one float32/float16/bfloat16 dtype, got {keys.dtype}, {queries.dtype}")
    C, Q, D = keys.shape[0], queries.shape[0], keys.shape[1]
    if C > _MAX_C:
        raise ValueError(f"keys: expected at most {_MAX_C} keys on the Triton path, got {C}")
    want = {"key_aux": (key_aux, torch.float32, C), "groups": (groups, torch.int64, C)}
    if exclude is not None:
        want["exclude"] = (exclude, torch.int64, Q)
    if centre is not None:
        want["centre"] = (centre, torch.float32, D)
    for name, (t, dt, n) in want.items():
        check_tensor(name, t, shape=(n,), dtypes=(dt,))
    check_same_device(queries=queries, keys=keys, **{name: v[0] for name, v in want.items()})
    if queries.device.type == "cpu" and not interpret_mode():
        raise ValueError(f"queries: expected CUDA tensors (CPU under TRITON_INTERPRET=1), got {queries.device}")
    k = check_int("k", k, lo=1, hi=MAX_K)
    if metric not in (METRIC_IP, METRIC_COSINE, METRIC_L2):
        raise ValueError(f"metric: expected 0 (ip), 1 (cosine) or 2 (l2), got {brief(metric)}")
    if min_score != min_score:  # -inf is the op's "no threshold"
        raise ValueError("min_score: expected a number or -inf, got NaN")


def _prepare(keys, key_aux, queries, metric, centre):
    """(keys, key_aux, queries, query aux) as the kernel reads them. l2 with a centre scores centred fp32 copies,
    as StepBuffer does for the CUDA backend (docs/retrieval.md, "l2 about the keys' mean")."""
    if metric == METRIC_L2 and centre is not None:
        keys = keys.float() - centre
        key_aux = keys.double().square().sum(1).float()
        queries = queries.float() - centre
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    sumsq = queries.float().square().sum(1)
    if metric == METRIC_COSINE:
        qaux = 1.0 / sumsq.sqrt().clamp_min(COSINE_EPS)
    elif metric == METRIC_L2:
        qaux = sumsq
    else:
        qaux = torch.zeros_like(sumsq)
    return keys, key_aux.contiguous(), queries, qaux.contiguous()


def decode_keys(cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 candidate keys -> (fp32 scores, int64 slots); SENTINEL -> (-inf, -1). The inverse of encode_keys."""
    hi = (cand >> 32).to(torch.int32)
    bits = torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
    empty = cand == SENTINEL
    scores = torch.where(empty, float("-inf"), bits.view(torch.float32))
    slots = torch.where(empty, -1, 0x7FFFFFFF - (cand & 0xFFFFFFFF))
    return scores, slots


def triton_search(
    keys: torch.Tensor,
    key_aux: torch.Tensor,
    groups: torch.Tensor,
    queries: torch.Tensor,
    exclude: torch.Tensor | None,
    k: int,
    metric: int,
    min_score: float,
    centre: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k with the Triton kernel; arguments and results as `rapo_fast::retrieval_search` (op.py).
    `splits` forces the number of key splits (tests)."""
    _check(keys, key_aux, groups, queries, exclude, k, metric, min_score, centre)
    dev, Q, C = queries.device, queries.shape[0], keys.shape[0]
    if Q == 0 or C == 0:
        return torch.full((Q, k), float("-inf"), device=dev), torch.full((Q, k), -1, dtype=torch.int64, device=dev)
    keys, key_aux, queries, qaux = _prepare(keys, key_aux, queries, metric, centre)
    # The JIT specialises D, the row strides and the pointers on divisibility by 16; without it the D loop is not
    # pipelined and needs the smaller tile (gpu_tiles).
    aligned = all(v % 16 == 0 for v in (keys.shape[1], queries.stride(0), keys.stride(0))) and all(
        t.data_ptr() % 16 == 0 for t in (keys, queries)
    )
    p = plan(Q, C, k, keys.dtype == torch.float32, dev, splits, aligned)
    ws = torch.empty(p.splits, Q, p.w, dtype=torch.int64, device=dev)
    thr = torch.empty(p.splits, Q, dtype=torch.int64, device=dev)
    cnt = torch.empty(p.splits, Q, dtype=torch.int32, device=dev)
    # Triton on first use only, so that `import rapo_fast` stays cheap (and works where triton is not installed).
    from rapo_fast.kernels.retrieval.search import retrieval_topk_kernel
    from rapo_fast.kernels.triton_helpers import interpreter_upcast

    n_qt = -(-Q // p.block_q)
    with device_guard(dev):
        retrieval_topk_kernel[(n_qt * p.splits,)](
            queries,
            keys,
            key_aux,
            qaux,
            groups,
            exclude if exclude is not None else groups,
            ws,
            thr,
            cnt,
            Q,
            C,
            keys.shape[1],
            queries.stride(0),
            keys.stride(0),
            p.keys_per_split,
            float(min_score),
            K_TOP=k,
            KP=p.kp,
            W=p.w,
            METRIC=metric,
            HAS_EXCL=exclude is not None,
            FP32_KEYS=keys.dtype == torch.float32,
            UPCAST_DOT=interpreter_upcast(),
            BLOCK_Q=p.block_q,
            BLOCK_C=p.block_c,
            BLOCK_D=p.block_d,
            ROWS=p.rows,
            num_warps=p.num_warps,
            num_stages=p.num_stages,
        )
    # Merge of the splits: the best k of [Q, splits * KP] distinct keys (a descending integer top-k is the order).
    cand = ws[:, :, : p.kp].permute(1, 0, 2).reshape(Q, p.splits * p.kp)
    best = torch.topk(cand, k, dim=1, sorted=True).values
    return decode_keys(best)
