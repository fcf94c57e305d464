"""Argument checks of the KV splice (rapo_fast/kv/splice.py), including the dtypes/shapes the registered op
`rapo_fast::kv_splice_` reads its pointers as.

What this is not: the splice itself (rapo_fast/kv/splice.py) or the index checks of the compiled backends
(csrc/include/rapo/kv_splice.h, which check every index they dereference).
"""

from __future__ import annotations

from typing import Any

import torch

from rapo_fast._checks import (
    INT32_MAX,
    INT32_MIN,
    KERNEL_FLOAT_DTYPES,
    brief,
    check_int,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from rapo_fast._constants import KV_REQUEST_FIELDS
from rapo_fast.kv.store import StepKVStore


def as_int(name: str, v: Any) -> int:
    """An integer argument within int64 (the request table's width): rapo_fast._checks.check_int, which refuses a
    float (int() would truncate 2.7 to 2 silently) or a bool, and names the argument for a past-int64 int (torch would
    say only "Overflow when unpacking long long")."""
    return check_int(name, v)


def check_block_table_int32(block_table: torch.Tensor, host: torch.Tensor) -> None:
    """An int64 block table fits the int32 the kernels read it as: a block id past int32 would wrap (2^32 + 1 read as
    block 1) and write another block. `host` is the table on the CPU (the values are read there)."""
    if host.dtype == torch.int32 or host.numel() == 0:
        return
    lo, hi = int(host.min()), int(host.max())
    if lo < INT32_MIN or hi > INT32_MAX:
        raise ValueError(
            f"block_table: expected block ids in int32's range [{INT32_MIN}, {INT32_MAX}] (the kernels read it as "
            f"int32), got {block_table.dtype} values in [{lo}, {hi}]"
        )


def as_requests(requests: Any) -> list[tuple[int, int, int]]:
    if isinstance(requests, torch.Tensor):
        if requests.dim() != 2 or requests.shape[1] != 3:
            raise ValueError(
                f"requests: expected shape [R, 3] (payload_id, batch_row, position), got {tuple(requests.shape)}"
            )
        if requests.is_floating_point() or requests.is_complex() or requests.dtype == torch.bool:
            raise TypeError(f"requests: expected an integer tensor [R, 3], got dtype {requests.dtype}")
        return [tuple(int(x) for x in r) for r in requests.tolist()]
    out = []
    for i, r in enumerate(requests):
        if len(r) != 3:
            raise ValueError(f"requests[{i}]: expected (payload_id, batch_row, position), got {brief(r)}")
        names = (f"requests[{i}] payload_id", f"requests[{i}] batch_row", f"requests[{i}] position")
        out.append(tuple(as_int(n, x) for n, x in zip(names, r)))
    return out


def check_layer_tensors(name: str, ts: list[torch.Tensor], store: StepKVStore, head_axis: int) -> None:
    if len(ts) != store.num_layers:
        raise ValueError(f"{name}: expected the store's {store.num_layers} layers, got {len(ts)}")
    t0 = ts[0]
    for i, t in enumerate(ts):
        if t.dtype != store.dtype:
            raise TypeError(f"{name}[{i}]: expected the store's dtype {store.dtype}, got {t.dtype}")
        if t.device != store.device:
            raise ValueError(f"{name}[{i}]: expected the store's device {store.device}, got {t.device}")
        if t.dim() != 4 or t.shape[head_axis] != store.num_kv_heads or t.shape[-1] != store.head_dim:
            raise ValueError(
                f"{name}[{i}]: expected {store.num_kv_heads} KV heads of dim {store.head_dim} (axis {head_axis}, -1), "
                f"got shape {tuple(t.shape)}"
            )
        if t.shape != t0.shape or t.stride() != t0.stride() or t.stride(-1) != 1:
            raise ValueError(
                f"{name}[{i}]: expected layer 0's shape {tuple(t0.shape)} and strides {t0.stride()}, head dim "
                f"contiguous (stride 1), got {tuple(t.shape)} and {t.stride()}"
            )


def check_physical_overlap(table: list, bt_cpu: torch.Tensor, bs: int) -> None:
    """No two written slots map to one physical slot (two rows sharing a block, or one row mapping two logical blocks
    to one physical block): the backends write in parallel, so the result would depend on the order of writes."""
    spans: list[tuple[int, int, int, int]] = []  # (physical block, first offset, end offset, request)
    for i, (_off, n, row, pos, _d) in enumerate(table):
        for b in range(pos // bs, (pos + n - 1) // bs + 1) if n else ():
            lo, hi = max(pos, b * bs) - b * bs, min(pos + n, (b + 1) * bs) - b * bs
            spans.append((int(bt_cpu[row, b]), lo, hi, i))
    spans.sort()
    for (blk, _lo, hi, i), (blk2, lo2, _hi2, j) in zip(spans, spans[1:]):
        if blk == blk2 and lo2 < hi:
            raise ValueError(
                f"requests[{j}]: expected slots of its own, got the same physical slots of block {blk} as "
                f"requests[{i}] (the block table maps two written logical blocks to one physical block)"
            )


def check_op_tensors(keys, values, k_pool, v_pool, requests, inv_freq, block_table, max_tokens) -> None:
    """What the op reads its pointers as: dtypes, ranks, one shape for every cache layer of keys and values, devices.
    The extension checks every index (requests, rows, slots, blocks) itself."""
    check_tensor("requests", requests, ndim=2, dtypes=(torch.int64,))
    if requests.shape[1] != KV_REQUEST_FIELDS:
        raise ValueError(f"requests: expected shape [R, {KV_REQUEST_FIELDS}], got {tuple(requests.shape)}")
    check_int("max_tokens", max_tokens, lo=0)
    check_tensor("k_pool", k_pool, ndim=4, dtypes=KERNEL_FLOAT_DTYPES)
    check_tensor("v_pool", v_pool, shape=k_pool.shape, dtypes=(k_pool.dtype,))
    check_same_device(k_pool=k_pool, v_pool=v_pool)
    if k_pool.stride(-1) != 1 or v_pool.stride() != k_pool.stride():
        raise ValueError(
            f"k_pool/v_pool: expected one set of strides, head dim contiguous, got {k_pool.stride()}/{v_pool.stride()}"
        )
    if len(keys) != k_pool.shape[0] or len(values) != k_pool.shape[0]:
        raise ValueError(f"keys/values: expected {k_pool.shape[0]} layers (k_pool's), got {len(keys)}/{len(values)}")
    # One shape for keys and values; strides per kind (the op takes both sets).
    for t0, t in [(keys[0], k) for k in keys] + [(values[0], v) for v in values]:
        if t.dim() != 4 or t.shape != keys[0].shape or t.stride() != t0.stride() or t.stride(-1) != 1:
            raise ValueError(
                f"keys/values: expected every layer 4-d of one shape {tuple(keys[0].shape)} (and, per kind, one set "
                f"of strides), head dim contiguous, got shape {tuple(t.shape)} strides {t.stride()}"
            )
        if t.dtype != k_pool.dtype or t.device != k_pool.device:
            raise TypeError(f"keys/values: expected {k_pool.dtype} on {k_pool.device}, got {t.dtype} on {t.device}")
    check_tensor("inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,))
    if 2 * inv_freq.numel() > k_pool.shape[3]:
        raise ValueError(
            f"inv_freq: expected at most head_dim/2 = {k_pool.shape[3] // 2} entries, got {inv_freq.numel()}"
        )
    check_optional_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64))
