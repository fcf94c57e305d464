"""StepKVStore: per payload id, every layer's K/V of a retrieved step computed once at positions 0..L-1, pooled.

What this is: the store that rapo_fast.kv.splice reads from (one pooled tensor per K and V, first-fit reuse of evicted
ranges, state_dict for checkpoints). What it is not: the splicing itself (rapo_fast.kv.splice) or the step buffer
that decides which payload ids exist (rapo_fast.retrieval.buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rapo_fast._checks import KERNEL_FLOAT_DTYPES, brief, check_int, check_int_list
from rapo_fast.kv import hf_cache as hfc


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _checked_where(where: Any, used: int) -> dict[int, tuple[int, int]]:
    """payload id -> (offset, length) inside [0, used), no two ranges overlapping; ValueError naming the entry."""
    if not isinstance(where, dict):
        raise ValueError(f"StepKVStore.load_state_dict: field 'where': expected a dict, got {type(where).__name__}")
    out: dict[int, tuple[int, int]] = {}
    for pid, span in where.items():
        ok = _is_int(pid) and isinstance(span, (tuple, list)) and len(span) == 2 and all(_is_int(x) for x in span)
        if not ok or not (0 <= span[0] and 0 <= span[1] and span[0] + span[1] <= used):
            raise ValueError(
                f"StepKVStore.load_state_dict: field 'where': expected int payload ids -> (offset, length) inside "
                f"the {used} saved tokens, got {brief(pid)}: {brief(span)}"
            )
        out[pid] = (span[0], span[1])
    pos = 0
    for off, n in sorted(out.values()):
        if off < pos:
            raise ValueError(
                f"StepKVStore.load_state_dict: field 'where': expected disjoint token ranges, got [{off}, {off + n}) "
                "overlapping another payload's"
            )
        pos = off + n
    return out


def _checked_tokens(tokens: Any, where: dict) -> dict[int, list[int]]:
    """payload id (stored in `where`) -> one token id >= 0 per cached position; ValueError naming the entry."""
    if not isinstance(tokens, dict):
        raise ValueError(f"StepKVStore.load_state_dict: field 'tokens': expected a dict, got {type(tokens).__name__}")
    for pid, ids in tokens.items():
        ok = pid in where and isinstance(ids, (list, tuple)) and len(ids) == where[pid][1]
        if not ok or not all(_is_int(x) and x >= 0 for x in ids):
            raise ValueError(
                "StepKVStore.load_state_dict: field 'tokens': expected stored payload ids -> one token id >= 0 per "
                f"cached position, got {brief(pid)}: {brief(ids)}"
            )
    return {pid: list(ids) for pid, ids in tokens.items()}


class StepKVStore:
    """Per payload id, the K/V of a step's tokens for every layer, computed once at positions 0..L-1.

    Pools: keys_pool / values_pool [num_layers, capacity_tokens, H_kv, D] (keys as the attention saw them, i.e.
    rotated to positions 0..L-1). A payload occupies tokens [offset, offset + L) of the pools; evicted ranges are
    reused first-fit, and the pools are bounded by what the store holds, not by how many payloads passed through it
    (docs/kv_splice.md, "Memory bound"). Payload ids are the StepBuffer's payload ids; re-adding a live id raises
    unless replace=True (the StepBuffer overwrote that step).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        capacity_tokens: int = 1024,
    ) -> None:
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(name, v, lo=1)
        check_int("capacity_tokens", capacity_tokens, lo=1)
        if dtype not in KERNEL_FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of float32/float16/bfloat16, got {brief(dtype)}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, capacity_tokens, num_kv_heads, head_dim)
        self.keys_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.values_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self._where: dict[int, tuple[int, int]] = {}
        self._tokens: dict[int, list[int]] = {}
        self._free: list[tuple[int, int]] = [(0, capacity_tokens)]
        # tokens the free list spans; the pools may hold fewer (after load_state_dict) and grow as payloads land
        self._capacity = capacity_tokens

    @classmethod
    def for_model(cls, model: Any, **kwargs: Any) -> StepKVStore:
        """An empty store shaped for a transformers model (layers, KV heads, head dim, dtype, device)."""
        from rapo_fast.kv.rope import _head_dim, _text_config

        cfg = _text_config(model.config)
        heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
        p = next(model.parameters())
        kwargs.setdefault("dtype", p.dtype)
        kwargs.setdefault("device", p.device)
        return cls(int(layers), int(kv), _head_dim(cfg), **kwargs)

    def __contains__(self, payload_id: int) -> bool:
        return int(payload_id) in self._where

    def __len__(self) -> int:
        return len(self._where)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the store holds before its pools double. A store made by the constructor has pools of that size;
        after load_state_dict the pools hold the saved tokens only (a state may declare up to 2^31 - 1 tokens) and
        grow as payloads are added."""
        return self._capacity

    def payload_ids(self) -> list[int]:
        return sorted(self._where)

    def locate(self, payload_id: int) -> tuple[int, int]:
        """(offset, length) of a payload in the pools; KeyError if absent."""
        return self._where[int(payload_id)]

    def tokens(self, payload_id: int) -> list[int] | None:
        """The token ids stored with a payload (None when added without tokens)."""
        return self._tokens.get(int(payload_id))

    def get(self, payload_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views keys, values [num_layers, L, H_kv, D] of a payload; ValueError if unknown."""
        if int(payload_id) not in self._where:
            raise ValueError(f"payload_id: expected one in the store, got {payload_id}")
        off, n = self._where[int(payload_id)]
        return self.keys_pool[:, off : off + n], self.values_pool[:, off : off + n]

    def state_dict(self) -> dict[str, Any]:
        """Everything the store holds, for a checkpoint: the pools (trimmed to the used tokens) and the payload map."""
        used = max((off + n for off, n in self._where.values()), default=0)
        return {
            "shape": (self.num_layers, self.num_kv_heads, self.head_dim),
            "dtype": self.dtype,
            "capacity_tokens": self.capacity_tokens,
            "keys": self.keys_pool[:, :used].cpu(),
            "values": self.values_pool[:, :used].cpu(),
            "where": dict(self._where),
            "tokens": {k: list(v) for k, v in self._tokens.items()},
        }

    def check_state_dict(self, state: Any) -> tuple[int, dict[int, tuple[int, int]], dict[int, list[int]]]:
        """Check that `state` is a state_dict() this store can hold, without changing the store: the fields and their
        types, the shape and dtype, every (offset, length) inside the saved pools and no two overlapping, tokens one
        id per cached position, finite K/V. Returns (capacity_tokens, where, tokens); ValueError naming the field."""
        if not isinstance(state, dict):
            raise TypeError(f"StepKVStore.load_state_dict: state: expected a dict, got {type(state).__name__}")
        missing = sorted({"shape", "dtype", "capacity_tokens", "keys", "values", "where", "tokens"} - set(state))
        if missing:
            raise ValueError(f"StepKVStore.load_state_dict: state: expected every field, got none for {missing}")
        want = (self.num_layers, self.num_kv_heads, self.head_dim)
        shape = state["shape"]
        if not isinstance(shape, (tuple, list)) or not all(_is_int(x) for x in shape):
            raise ValueError(f"StepKVStore.load_state_dict: field 'shape': expected 3 ints, got {brief(shape)}")
        if tuple(shape) != want or state["dtype"] != self.dtype:
            raise ValueError(
                "StepKVStore.load_state_dict: state: expected this store's (layers, kv heads, head dim) "
                f"{want} in {self.dtype}, got {tuple(shape)} in {state['dtype']}"
            )
        k, v = state["keys"], state["values"]
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor) or t.dtype != self.dtype or t.dim() != 4:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"StepKVStore.load_state_dict: field {name!r}: expected a 4-d {self.dtype} tensor, got {got}"
                )
            if (t.shape[0], t.shape[2], t.shape[3]) != want or t.shape != k.shape:
                raise ValueError(
                    f"StepKVStore.load_state_dict: field {name!r}: expected shape [{want[0]}, used, {want[1]}, "
                    f"{want[2]}], keys and values alike, got {tuple(t.shape)}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"StepKVStore.load_state_dict: field {name!r}: expected finite values, got NaN or inf")
        used, cap = k.shape[1], state["capacity_tokens"]
        if not _is_int(cap) or not max(used, 1) <= cap < 2**31:
            raise ValueError(
                f"StepKVStore.load_state_dict: field 'capacity_tokens': expected an int in [{max(used, 1)}, 2^31), "
                f"got {brief(cap)}"
            )
        where = _checked_where(state["where"], used)
        return cap, where, _checked_tokens(state["tokens"], where)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a state_dict() of a store of the same shape and dtype. Everything is checked
        first (check_state_dict): a bad state raises ValueError/TypeError and leaves the store as it was."""
        cap, where, tokens = self.check_state_dict(state)
        # the pools hold what the state stores, not what it declares (capacity_tokens)
        keys_pool = state["keys"].to(self.device, copy=True)
        values_pool = state["values"].to(self.device, copy=True)
        self.keys_pool, self.values_pool, self._where, self._tokens = keys_pool, values_pool, where, tokens
        self._capacity = cap
        # the free list is the gaps between the payloads (first-fit reuse continues as before the save)
        self._free = []
        pos = 0
        for off, n in sorted(self._where.values()):
            self._release(pos, off - pos)
            pos = off + n
        self._release(pos, cap - pos)

    def _alloc(self, n: int) -> int:
        for i, (start, size) in enumerate(self._free):
            if size >= n:
                self._free[i] = (start + n, size - n)
                if size == n:
                    del self._free[i]
                self._reserve(start + n)
                return start
        # No free range fits: pack the payloads into new pools (the capacity grows only when the free tokens do not
        # suffice), so that freed ranges too small to reuse cannot make the pools grow with the payloads ever added.
        # New tensors, not a shuffle in place: views handed out by `get` keep their contents.
        old, used = self._capacity, sum(k for _, k in self._where.values())
        self._capacity = old if used + n <= old else max(2 * old, used + n)
        rows = min(self._capacity, max(self.keys_pool.shape[1], used + n))
        keys_pool = self.keys_pool.new_zeros((self.num_layers, rows, self.num_kv_heads, self.head_dim))
        values_pool = torch.zeros_like(keys_pool)
        pos = 0
        for pid, (off, k) in sorted(self._where.items(), key=lambda x: x[1]):
            keys_pool[:, pos : pos + k] = self.keys_pool[:, off : off + k]
            values_pool[:, pos : pos + k] = self.values_pool[:, off : off + k]
            self._where[pid] = (pos, k)
            pos += k
        self.keys_pool, self.values_pool, self._free = keys_pool, values_pool, []
        self._release(pos, self._capacity - pos)
        return self._alloc(n)

    def _reserve(self, end: int) -> None:
        """Pools of at least `end` (<= capacity_tokens) tokens, doubling."""
        have = self.keys_pool.shape[1]
        if end <= have:
            return
        new = min(self._capacity, max(end, 2 * have))
        for name in ("keys_pool", "values_pool"):
            pool = getattr(self, name)
            grown = pool.new_zeros((pool.shape[0], new, *pool.shape[2:]))
            grown[:, :have] = pool
            setattr(self, name, grown)

    def _release(self, start: int, n: int) -> None:
        if n <= 0:
            return
        free = sorted(self._free + [(start, n)])
        merged: list[tuple[int, int]] = []
        for s, k in free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + k)
            else:
                merged.append((s, k))
        self._free = merged

    def add(
        self,
        payload_ids: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        *,
        tokens: Sequence[Sequence[int]] | None = None,
        replace: bool = False,
    ) -> None:
        """Store segments: keys[i], values[i] [num_layers, L_i, H_kv, D] (rotated to positions 0..L_i-1).

        All or nothing, and only what `load_state_dict` accepts: payload ids ints in [0, 2^63 - 1] (bool and float
        refused: a float id would be truncated; -1 is the "no step" of a search), K/V float tensors finite once cast to
        the store's dtype, tokens one int id >= 0 per cached position. Everything is checked before the store changes;
        a refusal raises ValueError/TypeError naming the argument and entry."""
        if not (len(payload_ids) == len(keys) == len(values)):
            raise ValueError(f"keys/values: expected {len(payload_ids)} each, got {len(keys)}/{len(values)}")
        if tokens is not None and len(tokens) != len(payload_ids):
            raise ValueError(f"tokens: expected {len(payload_ids)} entries (one per payload id), got {len(tokens)}")
        want = (self.num_layers, self.num_kv_heads, self.head_dim)
        pids = [check_int(f"payload_ids[{i}]", p, lo=0) for i, p in enumerate(payload_ids)]
        toks: list[list[int]] | None = None if tokens is None else []
        for i, (pid, k, v) in enumerate(zip(pids, keys, values)):
            for nm, t in (("keys", k), ("values", v)):
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                    raise TypeError(f"{nm}[{i}]: expected a float tensor [num_layers, L, H_kv, D], got {got}")
                if t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != want:
                    raise ValueError(
                        f"{nm}[{i}]: expected shape [num_layers={want[0]}, L, H_kv={want[1]}, D={want[2]}], "
                        f"got {tuple(t.shape)}"
                    )
                if not bool(torch.isfinite(t.to(self.dtype)).all()):
                    raise ValueError(
                        f"{nm}[{i}]: expected finite values in {self.dtype}, got NaN/inf (or out of range)"
                    )
            if k.shape != v.shape:
                raise ValueError(f"values[{i}]: expected keys[{i}]'s shape {tuple(k.shape)}, got {tuple(v.shape)}")
            if pid in self._where and not replace:
                raise ValueError(f"payload_ids[{i}]: expected a new id (or replace=True), got {pid}: already stored")
            if toks is not None:
                ids = tokens[i].tolist() if isinstance(tokens[i], torch.Tensor) else tokens[i]
                toks.append(check_int_list(f"tokens[{i}]", ids, lo=0))
                if len(toks[i]) != k.shape[1]:
                    raise ValueError(f"tokens[{i}]: expected {k.shape[1]} ids (cached positions), got {len(toks[i])}")
        for i, (pid, k, v) in enumerate(zip(pids, keys, values)):
            self.evict([pid]) if pid in self._where else None
            off = self._alloc(k.shape[1])
            self.keys_pool[:, off : off + k.shape[1]] = k.to(device=self.device, dtype=self.dtype)
            self.values_pool[:, off : off + k.shape[1]] = v.to(device=self.device, dtype=self.dtype)
            self._where[pid] = (off, k.shape[1])
            if toks is not None:
                self._tokens[pid] = toks[i]

    def evict(self, payload_ids: Sequence[int]) -> None:
        """Forget payloads (unknown ids are ignored, as the StepBuffer may evict steps that were never cached)."""
        for pid in payload_ids:
            where = self._where.pop(int(pid), None)
            self._tokens.pop(int(pid), None)
            if where is not None:
                self._release(*where)

    @torch.no_grad()
    def add_from_model(
        self,
        model: Any,
        payload_ids: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        *,
        batch_size: int = 16,
        replace: bool = False,
    ) -> None:
        """Run each step's tokens through `model` at positions 0..L-1 (no preceding context) and store its K/V.

        Segments are right-padded in batches; with causal attention a token never sees the padding after it.
        """
        from transformers import DynamicCache

        if len(payload_ids) != len(token_lists):
            raise ValueError(f"token_lists: expected one per payload id ({len(payload_ids)}), got {len(token_lists)}")
        dev = next(model.parameters()).device
        for s in range(0, len(token_lists), batch_size):
            chunk = [list(map(int, t)) for t in token_lists[s : s + batch_size]]
            if any(len(t) == 0 for t in chunk):
                raise ValueError(f"token_lists: expected >= 1 token in each, got lengths {[len(t) for t in chunk]}")
            n = max(len(t) for t in chunk)
            ids = torch.tensor([t + [0] * (n - len(t)) for t in chunk], dtype=torch.long, device=dev)
            cache = DynamicCache(config=model.config)
            pos = torch.arange(n, device=dev)[None].expand(len(chunk), n)
            model(input_ids=ids, position_ids=pos, use_cache=True, **{hfc.cache_kwarg(model): cache})
            ks, vs = hfc.layer_tensors(cache)
            keys = [torch.stack([k[j, :, : len(t)].transpose(0, 1) for k in ks]) for j, t in enumerate(chunk)]
            values = [torch.stack([v[j, :, : len(t)].transpose(0, 1) for v in vs]) for j, t in enumerate(chunk)]
            self.add(payload_ids[s : s + batch_size], keys, values, tokens=chunk, replace=replace)
