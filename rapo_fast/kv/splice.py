"""Splicing cached K/V of retrieved steps into live KV caches, keys re-rotated by RoPE (spec: docs/kv_splice.md).

What this is: `splice_kv` (many requests in one call of the registered op `rapo_fast::kv_splice_`), `PagedKVCache`
(the flash-attn/vLLM paged layout) and `insert_segment` (the rollout's entry point). Spliced K/V are exact in layer 0
only, so sampling from a spliced cache is a behaviour policy (docs/kv_splice.md section 6).
What this is not: the rotation math (csrc/include/rapo/rope.h, reference in rapo_fast/reference/kv_splice.py) or
HF cache internals (rapo_fast/kv/hf_cache.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rapo_fast._checks import brief, check_choice, check_same_device, check_tensor
from rapo_fast._dispatch import register_op
from rapo_fast.kv import hf_cache as hfc
from rapo_fast.kv import splice_checks as sc
from rapo_fast.kv.rope import RopeSpec
from rapo_fast.kv.store import StepKVStore

__all__ = ["StepKVStore", "RopeSpec", "PagedKVCache", "splice_kv", "insert_segment", "InsertResult"]


@dataclass
class PagedKVCache:
    """Paged KV cache: keys/values per layer [num_blocks, block_size, H_kv, D] (a list, or one tensor with a leading
    layer dim) and block_table [B, max_blocks] int32/int64 mapping sequence b's logical block i to a physical block."""

    keys: Sequence[torch.Tensor] | torch.Tensor
    values: Sequence[torch.Tensor] | torch.Tensor
    block_table: torch.Tensor

    @property
    def block_size(self) -> int:
        return int(self.keys[0].shape[1])


def _kv_splice_impl(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    requests: torch.Tensor,
    inv_freq: torch.Tensor,
    block_table: torch.Tensor | None,
    interleaved: bool,
    max_tokens: int,
) -> None:
    """The extension's splice on plain tensors; registered as `rapo_fast::kv_splice_` (keys, values mutated).

    keys/values: per layer [B, H_kv, S, D] (HF) or [num_blocks, block_size, H_kv, D] (paged, with block_table
    [B, max_blocks] int32), all layers of one shape and strides, head dim contiguous. k_pool/v_pool
    [num_layers, capacity, H_kv, D] of the caches' dtype. requests int64 [R, 5]: (pool offset, tokens, batch row,
    slot, rope delta), on any device (on the CPU it costs no sync: the extension checks every request on a host copy).
    inv_freq fp32 [rotary_dim / 2]. max_tokens: the largest token count in requests (an int so that no device sync is
    needed to find it). splice_kv validates every value first; called directly, the op still refuses (IndexError /
    ValueError from the extension) any index outside the pools, the caches or the block table.
    """
    from rapo_fast import _ext

    device = k_pool.device
    C = _ext.require_backend(device)
    sc.check_op_tensors(keys, values, k_pool, v_pool, requests, inv_freq, block_table, max_tokens)
    num_requests = requests.shape[0]
    if num_requests == 0 or max_tokens == 0:
        return
    # The extension checks every index it dereferences on host copies of the requests and the block table (a device
    # copy of a CUDA block table costs a sync; splice_kv passes requests on the CPU, so they cost none), and each tensor
    # where it takes its pointer (csrc/kv_splice_bindings.cpp).
    req_host = requests.contiguous() if requests.device.type == "cpu" else requests.cpu()
    req = req_host.to(device)
    inv = inv_freq.to(device).contiguous()
    bt, bt_host = _int32_block_table(block_table)
    dl = _ext.dlpack
    args = dict(keys=[dl(t) for t in keys], values=[dl(t) for t in values], k_pool=dl(k_pool), v_pool=dl(v_pool))
    args.update(requests=dl(req), inv_freq=dl(inv), block_table=dl(bt))
    if device.type == "cpu":
        C.kv_splice_cpu(**args, interleaved=bool(interleaved), max_tokens=int(max_tokens))
        return
    dst_ptrs = torch.empty(2, len(keys), dtype=torch.int64, device=device)  # the extension copies the addresses in
    C.kv_splice_cuda(
        **args,
        requests_host=dl(req_host),
        block_table_host=dl(bt_host),
        dst_ptrs=dl(dst_ptrs),
        interleaved=bool(interleaved),
        max_tokens=int(max_tokens),
        device=int(device.index or 0),
        stream=_ext.stream_of(device),
    )
    # req/dst_ptrs/inv/bt must live until the kernel has read them: tie them to the stream instead of syncing.
    for t in (req, dst_ptrs, inv) + ((bt,) if bt is not None else ()):
        t.record_stream(torch.cuda.current_stream(device))


def _int32_block_table(block_table: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The int32 block table the kernels read and its host copy (both must outlive the call: the caller keeps them),
    or (None, None) for the HF layout. An int64 table is narrowed only after a range check; a CUDA block table is
    copied to the host for the extension's index checks (one sync)."""
    if block_table is None:
        return None, None
    if block_table.dtype != torch.int32:  # narrowed to the kernels' int32 only after a range check
        sc.check_block_table_int32(block_table, block_table if block_table.device.type == "cpu" else block_table.cpu())
    bt = (block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)).contiguous()
    return bt, (bt if bt.device.type == "cpu" else bt.cpu())


def _kv_splice_fake(keys, values, k_pool, v_pool, requests, inv_freq, block_table, interleaved, max_tokens) -> None:
    return None


# A registered op (docs/testing.md rule 3) so that torch.compile sees the in-place write to the caches; the Python cache
# bookkeeping (HF lengths, growth, validation) stays in splice_kv, outside the op.
kv_splice_ = register_op(
    "kv_splice_", _kv_splice_impl, mutates_args=("keys", "values"), fake=_kv_splice_fake, eager_direct=True
)


def _launch_extension(ks, vs, store: StepKVStore, table, rope: RopeSpec, block_table) -> None:
    """Build the request table and call the registered op (validated by splice_kv already)."""
    device = store.device
    req = torch.tensor(table, dtype=torch.int64)  # on the CPU: the op checks it there and copies it to the device
    max_tokens = max(n for _o, n, _r, _p, _d in table)
    kv_splice_(
        list(ks),
        list(vs),
        store.keys_pool,
        store.values_pool,
        req,
        rope.inv_freq_on(device),
        block_table,
        rope.layout == "interleaved",
        max_tokens,
    )


def splice_kv(
    cache: Any,
    store: StepKVStore,
    requests: Sequence[tuple[int, int, int]] | torch.Tensor,
    rope: RopeSpec,
    *,
    lengths: Sequence[int] | None = None,
    rope_positions: Sequence[int] | None = None,
    backend: Literal["auto", "reference", "cpu", "cuda"] = "auto",
) -> int:
    """Copy each requested segment's K/V into `cache` at `position` of `batch_row`, keys rotated by R(position).

    cache: a transformers DynamicCache/StaticCache (per layer [B, H_kv, S, D]) or a PagedKVCache.
    requests: (payload_id, batch_row, position) triples, or an int64 tensor [R, 3]. Token j of the segment lands at
        slot position + j; its key, stored at rotation j, becomes rotation position + j (K' = R(delta) K, delta =
        rope_positions[r] if given, else position: left-padded ragged batches pass their per-row logical position).
    lengths: optional per-request number of leading tokens to splice (default: the whole stored segment).
    Returns the HF cache's length after the call (for a DynamicCache: max(old length, max position + length); rows that
    end earlier have unwritten slots the caller must mask) or 0 for a paged cache (it has no length of its own).
    Raises ValueError/TypeError before any write for an unknown payload id, a row or position out of range, a float
    (or bool) id / row / position / length / rope position (TypeError), overlapping requests (also two requests whose
    slots map to one physical slot of a paged cache), or a dtype / head count / head dim / layer count / device
    mismatch between store, rope and cache.
    """
    reqs = sc.as_requests(requests)
    if not isinstance(rope, RopeSpec):
        raise TypeError(f"rope: expected a RopeSpec (e.g. RopeSpec.from_model(model)), got {type(rope).__name__}")
    if rope.head_dim != store.head_dim:
        raise ValueError(f"rope.head_dim: expected the store's head_dim {store.head_dim}, got {rope.head_dim}")
    table = _request_table(reqs, store, lengths, rope_positions)
    if isinstance(cache, PagedKVCache):
        ks, vs, block_table = _paged_target(cache, store, table)
        if table:
            _launch(ks, vs, store, table, rope, block_table, backend)
        return 0
    ks, vs, new_len = _hf_target(cache, store, table)
    if table:
        _launch(ks, vs, store, table, rope, None, backend)
    if hfc.check_cache(cache) == "static":
        hfc.set_length(cache, new_len)
    return new_len


def _request_table(
    reqs: list[tuple[int, int, int]],
    store: StepKVStore,
    lengths: Sequence[int] | None,
    rope_positions: Sequence[int] | None,
) -> list[tuple[int, int, int, int, int]]:
    """(pool offset, length, batch row, position, rope delta) per request, after checking ids, lengths, positions and
    that no two requests write the same slots of a row."""
    if lengths is not None and len(lengths) != len(reqs):
        raise ValueError(f"lengths: expected {len(reqs)} entries (one per request), got {len(lengths)}")
    if rope_positions is not None and len(rope_positions) != len(reqs):
        raise ValueError(f"rope_positions: expected {len(reqs)} entries (one per request), got {len(rope_positions)}")
    rows_spans: dict[int, list[tuple[int, int]]] = {}
    table = []
    for i, (pid, row, pos) in enumerate(reqs):
        if pid not in store:
            raise ValueError(f"requests[{i}] payload_id: expected one in the StepKVStore, got {pid}")
        off, n_stored = store.locate(pid)
        n = n_stored if lengths is None else sc.as_int(f"lengths[{i}]", lengths[i])
        if not 0 <= n <= n_stored:
            raise ValueError(f"lengths[{i}]: expected an int in [0, {n_stored}] (payload {pid}'s tokens), got {n}")
        if pos < 0:
            raise ValueError(f"requests[{i}] position: expected >= 0, got {pos}")
        delta = pos if rope_positions is None else sc.as_int(f"rope_positions[{i}]", rope_positions[i])
        if delta < 0:
            raise ValueError(f"rope_positions[{i}]: expected >= 0, got {delta}")
        for a, b in rows_spans.get(row, []):
            if pos < b and a < pos + n:
                raise ValueError(f"requests[{i}]: expected no overlap with others, got [{pos}, {pos + n}) of row {row}")
        rows_spans.setdefault(row, []).append((pos, pos + n))
        table.append((off, n, row, pos, delta))
    return table


def _paged_target(cache: PagedKVCache, store: StepKVStore, table: list) -> tuple[list, list, torch.Tensor]:
    """The paged cache's per-layer tensors and its int32 block table, after checking every request's blocks."""
    ks, vs = list(cache.keys), list(cache.values)
    sc.check_layer_tensors("cache.keys", ks, store, 2)
    sc.check_layer_tensors("cache.values", vs, store, 2)
    bt = cache.block_table
    check_tensor("block_table", bt, ndim=2, dtypes=(torch.int32, torch.int64))
    check_same_device(store=store.keys_pool, block_table=bt)
    bs, nb = ks[0].shape[1], ks[0].shape[0]
    bt_cpu = bt.cpu()
    for i, (_off, n, row, pos, _d) in enumerate(table):
        if not 0 <= row < bt.shape[0]:
            raise ValueError(f"requests[{i}] batch_row: expected an int in [0, {bt.shape[0]}), got {row}")
        if n and (pos + n - 1) // bs >= bt.shape[1]:
            raise ValueError(
                f"requests[{i}]: expected slots within the block table ({bt.shape[1]} blocks of {bs}), got {pos} + {n}"
            )
        used = bt_cpu[row, pos // bs : (pos + n - 1) // bs + 1] if n else bt_cpu[row, :0]
        if used.numel() and (used.min() < 0 or used.max() >= nb):
            raise ValueError(f"block_table[{row}]: expected block ids in [0, {nb}), got {used.tolist()}")
    sc.check_physical_overlap(table, bt_cpu, bs)
    sc.check_block_table_int32(bt, bt_cpu)
    return ks, vs, (bt.to(torch.int32) if bt.dtype != torch.int32 else bt)


def _hf_target(cache: Any, store: StepKVStore, table: list) -> tuple[list, list, int]:
    """A transformers cache's per-layer tensors after growing it to hold every request, and its new length. Every
    check runs before the cache is grown: a refused call leaves the cache alone."""
    kind = hfc.check_cache(cache)
    cur = hfc.length(cache)
    b = hfc.batch_size(cache)
    if b is None:
        b = max((row for _, _, row, _, _ in table), default=-1) + 1
        hfc.ensure_layers(cache, store.num_layers, b, store.num_kv_heads, store.head_dim, store.dtype, store.device)
    for i, (_off, _n, row, pos, _d) in enumerate(table):
        if not 0 <= row < b:
            raise ValueError(f"requests[{i}] batch_row: expected an int in [0, {b}), got {row}")
        if kind == "dynamic" and pos > cur:
            raise ValueError(
                f"requests[{i}] position: expected <= the cache's length {cur} (a DynamicCache holds no gap), got {pos}"
            )
    new_len = max([cur] + [pos + n for _o, n, _r, pos, _d in table])
    ks, vs = hfc.layer_tensors(cache)
    sc.check_layer_tensors("cache keys", ks, store, 1)
    sc.check_layer_tensors("cache values", vs, store, 1)
    hfc.grow(cache, new_len)  # raises for a StaticCache without room, before any write
    ks, vs = hfc.layer_tensors(cache)
    sc.check_layer_tensors("cache keys", ks, store, 1)
    sc.check_layer_tensors("cache values", vs, store, 1)
    return ks, vs, new_len


def _launch(ks, vs, store: StepKVStore, table, rope: RopeSpec, block_table, backend: str) -> None:
    device = store.device
    if backend == "auto":
        from rapo_fast import _ext

        backend = "reference"
        if _ext.has_extension() and hasattr(_ext.extension(), "kv_splice_cpu"):
            backend = device.type
    if backend == "reference":
        from rapo_fast.reference.kv_splice import splice_segment_ref

        inv = rope.inv_freq_on(device)
        for off, n, row, pos, delta in table:
            if n == 0:
                continue
            sk = store.keys_pool[:, off : off + n]
            sv = store.values_pool[:, off : off + n]
            splice_segment_ref(
                ks,
                vs,
                sk,
                sv,
                row,
                pos,
                inv,
                rotary_dim=rope.rotary_dim,
                layout=rope.layout,
                rope_delta=delta,
                block_table=block_table,
                block_size=0 if block_table is None else ks[0].shape[1],
            )
        return
    if backend != device.type:
        raise ValueError(f"backend: expected 'reference' or {device.type!r}, got {brief(backend)}")
    _launch_extension(ks, vs, store, table, rope, block_table)


@dataclass
class InsertResult:
    """What `insert_segment` leaves: next-token logits [B, V] fp32 after the segment, the cache slot where the next
    token goes, and the rope position of the next token per row [B] (int64; equal to next_slot without rope offsets)."""

    logits: torch.Tensor
    next_slot: int
    next_positions: torch.Tensor
    recomputed_tokens: int


@torch.no_grad()
def insert_segment(
    model: Any,
    cache: Any,
    segment_tokens: Sequence[Sequence[int]] | torch.Tensor,
    rows: Sequence[int],
    positions: Sequence[int],
    *,
    mode: Literal["splice", "exact", "blend"] = "splice",
    store: StepKVStore | None = None,
    payload_ids: Sequence[int] | None = None,
    rope: RopeSpec | None = None,
    blend_fraction: float = 0.15,
    rope_positions: Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    backend: Literal["auto", "reference", "cpu", "cuda"] = "auto",
) -> InsertResult:
    """Insert segment i at cache slot positions[i] of batch row rows[i] of an HF cache, and return next-token logits.

    Contract for HF caches (one length for all rows): `rows` covers every batch row exactly once, all `positions` are
    equal (slot p <= the cache's length; anything cached at slots >= p is discarded) and all segments have the same
    length L; anything else raises ValueError. Ragged (left-padded) batches share the slot p and pass each row's
    logical position in `rope_positions` (keys are rotated to it, position_ids follow it) plus their `attention_mask`
    [B, p + L]. After the call the cache holds p + L tokens and generation continues at slot p + L with
    position_ids = next_positions (a forward without position_ids gets p + L, right when there is no padding).

    mode: "exact" re-prefills all L tokens through the model (position_ids p..p+L-1); "splice" copies tokens 0..L-2
        from `store` (payload_ids[i], keys re-rotated) and runs only the last token through the model, so that logits
        come out; "blend" splices the first L - r tokens and re-prefills the last r = max(1, ceil(blend_fraction * L))
        (a suffix recompute: the recomputed tokens attend to the true context; not CacheBlend's deviation-based pick).
    """
    check_choice("mode", mode, ("splice", "exact", "blend"))
    kind = hfc.check_cache(cache)
    toks, b, p, cur = _check_segments(cache, segment_tokens, rows, positions)
    seg_len = len(toks[0])
    order = sorted(range(len(rows)), key=lambda i: int(rows[i]))
    device = next(model.parameters()).device
    tokens = torch.tensor([toks[i] for i in order], dtype=torch.long, device=device)
    base = (
        torch.full((b,), p, dtype=torch.long)
        if rope_positions is None
        else torch.tensor([sc.as_int(f"rope_positions[{i}]", rope_positions[i]) for i in order], dtype=torch.long)
    )
    n_exact = seg_len if mode == "exact" else 1 if mode == "splice" else max(1, math.ceil(blend_fraction * seg_len))
    n_exact = min(n_exact, seg_len)
    n_splice = seg_len - n_exact
    if n_splice > 0:  # every check before the cache is touched
        _check_stored(store, payload_ids, toks, order, n_splice, mode)
        rope = RopeSpec.from_model(model) if rope is None else rope
    if cur > p:
        hfc.set_length(cache, p)
    if n_splice > 0:
        reqs = [(int(payload_ids[i]), int(rows[i]), p) for i in order]
        splice_kv(cache, store, reqs, rope, lengths=[n_splice] * b, rope_positions=base.tolist(), backend=backend)
    pos_ids = (base[:, None] + torch.arange(n_splice, seg_len)[None, :]).to(device)
    if kind == "static":
        hfc.set_length(cache, p + n_splice)
    out = model(
        input_ids=tokens[:, n_splice:],
        position_ids=pos_ids,
        use_cache=True,
        attention_mask=attention_mask,
        **{hfc.cache_kwarg(model): cache},
    )
    return InsertResult(
        logits=out.logits[:, -1].float(),
        next_slot=p + seg_len,
        next_positions=(base + seg_len).to(device),
        recomputed_tokens=n_exact * b,
    )


def _check_segments(cache: Any, segment_tokens: Any, rows: Sequence[int], positions: Sequence[int]):
    """insert_segment's contract for HF caches: every row once, one shared slot, one segment length. Returns the
    segments as token lists, the batch size, the slot and the cache's current length."""
    toks = [
        list(map(int, t))
        for t in (segment_tokens.tolist() if isinstance(segment_tokens, torch.Tensor) else segment_tokens)
    ]
    if not (len(toks) == len(rows) == len(positions)):
        raise ValueError(f"rows/positions: expected one per segment ({len(toks)}), got {len(rows)}/{len(positions)}")
    b = hfc.batch_size(cache) or len(rows)
    if sorted(int(r) for r in rows) != list(range(b)):
        raise ValueError(
            f"rows: expected every batch row 0..{b - 1} once (HF caches share one length), got {list(rows)}"
        )
    if len(set(int(p) for p in positions)) != 1:
        raise ValueError(
            f"positions: expected one slot for all rows of an HF cache (one length for all rows), got "
            f"{list(positions)}; ragged batches share the slot and pass rope_positions"
        )
    if len({len(t) for t in toks}) != 1 or not toks[0]:
        raise ValueError(f"segment_tokens: expected segments of one length >= 1, got lengths {[len(t) for t in toks]}")
    p = int(positions[0])
    cur = hfc.length(cache)
    if p > cur:
        raise ValueError(f"positions: expected a slot <= the cache's length {cur}, got {p}")
    return toks, b, p, cur


def _check_stored(
    store: StepKVStore | None,
    payload_ids: Sequence[int] | None,
    toks: list[list[int]],
    order: list[int],
    n_splice: int,
    mode: str,
) -> None:
    """The store holds every payload to splice, with the same tokens and at least n_splice of them."""
    if store is None or payload_ids is None:
        raise ValueError(f"store/payload_ids: expected both with mode={brief(mode)}, got None")
    if len(payload_ids) != len(toks):
        raise ValueError(f"payload_ids: expected {len(toks)} entries (one per row), got {len(payload_ids)}")
    for i in order:
        if int(payload_ids[i]) not in store:
            raise ValueError(f"payload_ids[{i}]: expected a payload in the StepKVStore, got {payload_ids[i]}")
        stored = store.tokens(int(payload_ids[i]))
        if stored is not None and stored != toks[i]:
            raise ValueError(f"segment_tokens[{i}]: expected payload {payload_ids[i]}'s stored tokens, got others")
        if store.locate(int(payload_ids[i]))[1] < n_splice:
            raise ValueError(f"payload_ids[{i}]: expected >= {n_splice} tokens stored, got fewer in {payload_ids[i]}")
