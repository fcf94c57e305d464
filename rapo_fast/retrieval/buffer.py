"""The step buffer of RAPO's hybrid rollouts and its exact batched nearest-neighbour search (docs/retrieval.md).

`StepBuffer` holds, per slot, a step's key embedding, payload id, prompt-group id and outcome score; `search` is
exact, and its spec (with the score conventions) is rapo_fast.reference.retrieval.search_ref. Both devices go through
the registered op `rapo_fast::retrieval_search`; `ShardedStepBuffer` (sharded.py) spreads a buffer over ranks.
What this is not: an approximate index (no IVF/HNSW: exact search is the contract), or the storage of the payloads.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING, Any

import torch

from rapo_fast import _checks as C
from rapo_fast._checks import brief
from rapo_fast._constants import MAX_KEYS
from rapo_fast.reference.retrieval import key_aux_ref
from rapo_fast.retrieval.backends import check_backend
from rapo_fast.retrieval.buffer_args import as_tensor, check_ids, check_rows
from rapo_fast.retrieval.io import FORMAT_VERSION, StepBufferFormatError, read_snapshot, write_snapshot
from rapo_fast.retrieval.l2_chunks import chunked_l2_search, l2_chunk_rows
from rapo_fast.retrieval.l2_exact import certified_l2_search, rescored_l2_search
from rapo_fast.retrieval.op import MAX_K, METRIC_CODES, retrieval_search
from rapo_fast.retrieval.rwlock import ReadWriteLock

if TYPE_CHECKING:
    import numpy as np

__all__ = ["StepBuffer", "StepBufferFormatError", "FORMAT_VERSION"]

_KEY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_EVICTIONS = ("fifo", "lowest_score")
# the per-slot tensors and the value of a free slot in each (reset, _grow)
_SLOT_FILLS = (("_keys", 0), ("_aux", 0), ("_payload", -1), ("_group", -1), ("_score", 0), ("_seq", -1), ("_pinned", 0))


class StepBuffer:
    """Ring buffer of `capacity` steps with exact top-k search over their key embeddings.

    Args:
        capacity: number of slots C (1 <= C < 2^31). Slot ids 0..C-1 stay fixed while a step is stored.
        dim: key dimension D.
        dtype: key storage dtype, float32, float16 or bfloat16; queries are rounded to it before scoring.
        device: where the keys live; searches run there (C++ CPU backend or CUDA backend).
        metric: "ip" (inner product), "cosine", or "l2" (scores are -|q - k|^2, the negative squared distance:
            larger is better, as for the other metrics).
        eviction: when full, "fifo" overwrites the oldest step; "lowest_score" replaces the lowest-scored step (the
            oldest among equals) if the new step's score is >= it, and otherwise drops the new step (slot -1). A batch
            keeps exactly the steps that adding its steps one by one would keep; its kept steps take the freed slots
            in ascending order.

    Pinned steps (`add(..., pinned=...)`, `set_pinned`; none by default) are evicted only when no unpinned step is
    left, and are not saved by `save`: docs/retrieval.md, "Pinned steps".
    """

    def __init__(
        self,
        capacity: int,
        dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        metric: str = "ip",
        eviction: str = "fifo",
    ) -> None:
        capacity = C.check_int("capacity", capacity, lo=1, hi=MAX_KEYS)
        dim = C.check_int("dim", dim, lo=1)
        if dtype not in _KEY_DTYPES:
            raise TypeError(f"dtype: expected one of {_KEY_DTYPES}, got {brief(dtype)}")
        C.check_choice("metric", metric, tuple(METRIC_CODES))
        C.check_choice("eviction", eviction, _EVICTIONS)
        self._setup(capacity, dim, dtype, device, metric, eviction, rows=capacity)

    def _setup(self, capacity: int, dim: int, dtype, device, metric: str, eviction: str, rows: int) -> None:
        """The fields of an empty buffer (arguments checked by the caller), with storage for `rows` slots."""
        self.capacity, self.dim, self.dtype, self.metric, self.eviction = capacity, dim, dtype, metric, eviction
        self.device = torch.device(device if device is not None else "cpu")
        dev = self.device
        self._keys = torch.zeros(rows, dim, dtype=dtype, device=dev)
        self._aux = torch.zeros(rows, dtype=torch.float32, device=dev)
        self._payload = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self._group = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self._score = torch.zeros(rows, dtype=torch.float32, device=dev)
        self._seq = torch.full((rows,), -1, dtype=torch.int64, device=dev)  # insertion order, for eviction
        self._pinned = torch.zeros(rows, dtype=torch.bool, device=dev)  # never evicted by an unpinned step
        self._has_pins = False  # any pinned step: eviction goes through _assign_pinned
        # fifo by insertion number instead of the ring: set once pinned eviction broke the ring's age order
        self._by_age = False
        self._size = 0  # slots 0..size-1 are occupied (slots fill in order and are never freed)
        self._head = 0  # fifo: the oldest slot once full
        self._next_seq = 0
        # l2: float64 sum of the stored keys, kept by add (None: recomputed at the next search, e.g. after load); the
        # search centres keys and queries on its mean (docs/retrieval.md, "l2 about the keys' mean").
        self._key_sum: torch.Tensor | None = None
        # Searches share it, add holds it alone (docs/retrieval.md, "Thread safety").
        self._lock = ReadWriteLock()

    def __len__(self) -> int:
        return self._size

    def _grow(self, rows: int) -> None:
        """Storage for at least `rows` (<= capacity) slots, doubling. Only a loaded buffer has less than its capacity:
        `load` allocates what the snapshot stores, not what it declares (a 1 KB snapshot may declare 2^31 - 1 slots),
        and the storage grows as adds fill the slots."""
        have = self._keys.shape[0]
        if rows <= have:
            return
        new = min(self.capacity, max(rows, 2 * have))
        for name, fill in _SLOT_FILLS:
            old = getattr(self, name)
            t = old.new_full((new, *old.shape[1:]), fill)
            t[:have] = old
            setattr(self, name, t)

    def __repr__(self) -> str:
        return (
            f"StepBuffer(size={self._size}, capacity={self.capacity}, dim={self.dim}, dtype={self.dtype}, "
            f"device={self.device}, metric={self.metric!r}, eviction={self.eviction!r})"
        )

    # Read-only views of the occupied slots (index = slot id).
    @property
    def embeddings(self) -> torch.Tensor:
        return self._keys[: self._size]

    @property
    def payload_ids(self) -> torch.Tensor:
        return self._payload[: self._size]

    @property
    def group_ids(self) -> torch.Tensor:
        return self._group[: self._size]

    @property
    def scores(self) -> torch.Tensor:
        return self._score[: self._size]

    @property
    def pinned(self) -> torch.Tensor:
        return self._pinned[: self._size]

    def set_pinned(self, mask: torch.Tensor) -> None:
        """Replace the pin flags of the occupied slots: mask [len(self)] bool (slot order, as the views above)."""
        with self._lock.write():  # the size checked is the size written
            n = self._size
            C.check_tensor("mask", mask, shape=(n,), dtypes=(torch.bool,))  # one flag per stored step
            self._pinned[:n] = mask.to(self.device)
            self._has_pins = bool(mask.any())

    def add(
        self,
        embeddings: torch.Tensor | np.ndarray,
        payload_ids: torch.Tensor | np.ndarray | None = None,
        group_ids: torch.Tensor | np.ndarray | None = None,
        scores: torch.Tensor | np.ndarray | None = None,
        pinned: torch.Tensor | np.ndarray | bool | None = None,
    ) -> torch.Tensor:
        """Store M steps; returns their slot ids [M] int64 on the buffer's device (-1 for a step not kept).

        embeddings [M, D] float (finite; rounded to the buffer dtype), payload_ids [M] int64 (>= 0: -1 is the
        padding of `search`), group_ids [M] int64 (>= 0), scores [M] float (finite; default 0), pinned [M] bool or
        one bool for all (default: none pinned; see the class docstring). A batch larger than the free space evicts
        per the policy; steps of the same batch can evict each other (fifo keeps the last C). Tensors or NumPy
        arrays (`buf.add(x)` as with a faiss index); arrays are copied to the buffer's device.

        Automatic ids (faiss's numbering): without payload_ids, a step's payload id is its insertion number, the
        count of steps added before it since the buffer was made (or `reset`), dropped and evicted ones included, so
        the first add of M steps gets 0..M-1 and the next add continues; without group_ids, each step is its own
        group (group id = payload id: `exclude_groups` then skips exactly that step). Do not mix automatic and given
        payload ids in one buffer: nothing keeps them apart.
        """
        embeddings, payload_ids, group_ids, scores, pinned = (
            as_tensor(x, self.device) for x in (embeddings, payload_ids, group_ids, scores, pinned)
        )
        M = check_rows("embeddings", embeddings, self.dim, "M").shape[0]
        payload = None if payload_ids is None else check_ids("payload_ids", payload_ids, M).to(self.device)
        group = None if group_ids is None else check_ids("group_ids", group_ids, M).to(self.device)
        if scores is None:
            score = torch.zeros(M, dtype=torch.float32, device=self.device)
        else:
            score = C.check_tensor("scores", scores, shape=(M,), dtypes=C.FLOAT_DTYPES).to(self.device, torch.float32)
        pin = self._check_pinned(pinned, M)
        keys = embeddings.to(device=self.device, dtype=self.dtype)
        if M == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if not bool(torch.isfinite(keys).all()):
            raise ValueError(f"embeddings: expected finite values in {self.dtype}, got NaN/inf (or out of its range)")
        C.check_finite("scores", score)
        if group is not None and bool((group < 0).any()):  # a negative group means 'no exclusion' in search
            raise ValueError(f"group_ids: expected values >= 0, got {int(group.min())}")
        if payload is not None and bool((payload < 0).any()):  # -1 pads search results with fewer than k steps
            raise ValueError(f"payload_ids: expected values >= 0, got {int(payload.min())}")
        with self._lock.write():
            return self._store(keys, payload, group, score, pin)

    def _check_pinned(self, pinned, M: int) -> torch.Tensor | None:
        """add's pinned as a bool [M] tensor on the buffer's device, or None when no step is pinned."""
        if pinned is None or pinned is False:
            return None
        if pinned is True:
            return torch.ones(M, dtype=torch.bool, device=self.device)
        C.check_tensor("pinned", pinned, shape=(M,), dtypes=(torch.bool,))
        return pinned.to(self.device) if bool(pinned.any()) else None

    def _store(
        self,
        keys: torch.Tensor,
        payload: torch.Tensor | None,
        group: torch.Tensor | None,
        score: torch.Tensor,
        pinned: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """add's writes, under the write lock: assign slots, then fill them. payload None: the insertion numbers
        (read here, under the lock, so concurrent adds never share one); group None: the payload ids."""
        M, n_before = keys.shape[0], self._size
        if pinned is not None or self._has_pins or self._by_age:
            slots = self._assign_pinned(score, pinned)
            self._has_pins = self._has_pins or pinned is not None
        elif self.eviction == "lowest_score":
            slots = self._assign_slots(score)
        else:
            slots = self._assign_fifo(M)
        self._grow(self._size)  # every slot assigned is below the new size (slots fill in order)
        keep = slots >= 0
        if bool(keep.all()):
            idx, src = slots, slice(None)
        else:
            idx, src = slots[keep], keep
        seq = torch.arange(self._next_seq, self._next_seq + M, dtype=torch.int64, device=self.device)
        payload = seq if payload is None else payload
        group = payload if group is None else group
        if self._key_sum is not None:  # l2's running sum: minus the overwritten keys, plus the new ones
            old = self._keys[idx[idx < n_before]]
            self._key_sum += keys[src].sum(0, dtype=torch.float64) - old.sum(0, dtype=torch.float64)
        self._keys[idx] = keys[src]
        self._aux[idx] = key_aux_ref(keys[src], self.metric)
        self._payload[idx] = payload[src]
        self._group[idx] = group[src]
        self._score[idx] = score[src]
        self._seq[idx] = seq[src]
        self._pinned[idx] = False if pinned is None else pinned[src]
        self._next_seq += M
        return slots

    def _assign_fifo(self, M: int) -> torch.Tensor:
        C, dev = self.capacity, self.device
        slots = torch.full((M,), -1, dtype=torch.int64, device=dev)
        n_fill = min(M, C - self._size)
        slots[:n_fill] = torch.arange(self._size, self._size + n_fill, device=dev)
        self._size += n_fill
        r = M - n_fill
        if r > 0:  # overwrite in ring order from the oldest slot on
            slots[n_fill:] = (self._head + torch.arange(r, device=dev)) % C
            self._head = (self._head + r) % C
        slots[: max(0, M - C)] = -1  # steps of this batch overwritten by later ones of the same batch
        return slots

    def _assign_slots(self, new_score: torch.Tensor) -> torch.Tensor:
        """lowest_score: keep the C best of (stored + new) by (score, newer first); new keepers take freed slots."""
        C, n, M, dev = self.capacity, self._size, new_score.shape[0], self.device
        if n + M <= C:
            self._size = n + M
            return torch.arange(n, n + M, dtype=torch.int64, device=dev)
        all_score = torch.cat([self._score[:n], new_score])
        all_seq = torch.cat([self._seq[:n], torch.arange(self._next_seq, self._next_seq + M, device=dev)])
        order = torch.argsort(all_seq, descending=True)
        order = order[torch.argsort(all_score[order], descending=True, stable=True)]
        kept = torch.zeros(n + M, dtype=torch.bool, device=dev)
        kept[order[:C]] = True
        freed = torch.cat([torch.nonzero(~kept[:n]).flatten(), torch.arange(n, C, device=dev)])
        new_kept = kept[n:]
        slots = torch.full((M,), -1, dtype=torch.int64, device=dev)
        slots[new_kept] = freed  # freed is ascending; kept new steps take it in batch order
        self._size = C
        return slots

    def _assign_pinned(self, new_score: torch.Tensor, new_pinned: torch.Tensor | None) -> torch.Tensor:
        """Eviction with pinned steps: of (stored + new), ranked by the policy (fifo: newer first; lowest_score: higher
        score, then newer, first), keep the best min(P, C) of the P pinned and the best of the unpinned for the rest
        of the room; this is what adding the steps one by one keeps (the sequential model is in
        tests/retrieval/test_retrieval_buffer.py). New keepers take the freed slots in ascending order, as in
        _assign_slots."""
        C, n, M, dev = self.capacity, self._size, new_score.shape[0], self.device
        if self.eviction == "fifo":
            self._by_age = True  # freed slots no longer follow the ring, so fifo goes by insertion number from now on
        if n + M <= C:
            self._size = n + M
            return torch.arange(n, n + M, dtype=torch.int64, device=dev)
        new_pin = new_pinned if new_pinned is not None else torch.zeros(M, dtype=torch.bool, device=dev)
        pin = torch.cat([self._pinned[:n], new_pin])
        seq = torch.cat([self._seq[:n], torch.arange(self._next_seq, self._next_seq + M, device=dev)])
        order = torch.argsort(seq, descending=True)
        if self.eviction == "lowest_score":
            score = torch.cat([self._score[:n], new_score])
            order = order[torch.argsort(score[order], descending=True, stable=True)]
        keep_pinned = min(int(pin.sum()), C)
        p = pin[order]
        # rank of each step among its own kind (pinned or not) in `order`, 1-based
        rank = torch.where(p, torch.cumsum(p, 0), torch.cumsum(~p, 0))
        kept = torch.zeros(n + M, dtype=torch.bool, device=dev)
        kept[order] = torch.where(p, rank <= keep_pinned, rank <= C - keep_pinned)
        freed = torch.cat([torch.nonzero(~kept[:n]).flatten(), torch.arange(n, C, device=dev)])
        slots = torch.full((M,), -1, dtype=torch.int64, device=dev)
        slots[kept[n:]] = freed
        self._size = C
        return slots

    def _check_search_args(
        self, queries: Any, k: Any, exclude_groups: Any, min_score: Any, backend: Any = "auto"
    ) -> tuple[torch.Tensor, int, torch.Tensor | None, float]:
        """search's argument checks, shared with ShardedStepBuffer: (queries rounded to the buffer's dtype, k,
        exclude as int64 or None, the score threshold). `backend` is checked to run on the buffer's device."""
        check_backend(backend, self.device)
        check_rows("queries", queries, self.dim, "Q")
        C.check_same_device(buffer=self._keys, queries=queries)
        k = C.check_int("k", k, lo=1, hi=MAX_K)
        thr = C.check_min_score("min_score", min_score)
        exclude = None
        if exclude_groups is not None:
            exclude = check_ids("exclude_groups", exclude_groups, queries.shape[0])
            C.check_same_device(buffer=self._keys, exclude_groups=exclude)
        q = queries.detach().to(self.dtype)  # retrieval is not differentiable: no autograd graph through the op
        # As strict as add: NaN/inf, or out of range once rounded. Not while torch.compile traces (a data-dependent
        # branch would break the graph; docs/retrieval.md, "Thread safety").
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(q).all()):
            raise ValueError(f"queries: expected finite values in {self.dtype}, got NaN/inf (or out of its range)")
        return q, k, exclude, float("-inf") if thr is None else thr

    def _search_slots(
        self,
        queries: torch.Tensor,
        k: int,
        exclude_groups: torch.Tensor | None,
        min_score: float | None,
        backend="auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, exclude, thr = self._check_search_args(queries, k, exclude_groups, min_score, backend)
        search = functools.partial(retrieval_search, backend=backend)
        n = self._size
        keys, aux, centre = self._keys[:n], self._aux[:n], None
        if self.metric == "l2":
            if self._key_sum is None:
                self._key_sum = keys.sum(0, dtype=torch.float64)
            c = (self._key_sum / max(n, 1)).float()
            groups, no_thr = self._group[:n], float("-inf")
            if self.device.type == "cpu":  # the CPU backend centres keys as it packs them

                def raw(qs, ex, kk):
                    return search(keys, aux, groups, qs, ex, kk, METRIC_CODES["l2"], no_thr, c)

            else:  # the CUDA backend scores centred fp32 keys (FMA path): copies of one bounded chunk at a time

                def raw(qs, ex, kk):
                    rows = l2_chunk_rows(self.dim)
                    return chunked_l2_search(keys, groups, qs, ex, kk, no_thr, c, rows, search)

            if torch.compiler.is_compiling():  # the certificate branches on data: a traced search keeps fp32's set
                return rescored_l2_search(keys, q, k, thr, raw(q, exclude, k))
            # the fp32 answer certified per query against the float64 distances, else a float64 brute force: exact
            # also where the expanded form cancels about the mean (far-apart clusters; rapo_fast/retrieval/l2_exact.py)
            return certified_l2_search(keys, groups, q, exclude, k, thr, c, raw, MAX_K)
        return search(keys, aux, self._group[:n], q, exclude, k, METRIC_CODES[self.metric], thr, centre)

    def search(
        self,
        queries: torch.Tensor | np.ndarray,
        k: int,
        exclude_groups: torch.Tensor | np.ndarray | int | None = None,
        min_score: float | None = None,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k: queries [Q, D] float on the buffer's device -> (scores [Q, k] fp32, payload_ids [Q, k] int64).

        Scores, larger is better whatever the metric: "ip" <q, k>; "cosine" the cosine similarity; "l2" the NEGATIVE
        squared distance -|q - k|^2 (faiss's IndexFlatL2 returns +|q - k|^2, smaller first: negate ours to compare).
        Best first, ties to the smaller slot; rows with fewer than k eligible steps are padded with -inf / -1.
        exclude_groups [Q] int64: per query, steps of that group are skipped (a negative value skips nothing).
        min_score: steps scoring below it are skipped. 1 <= k <= MAX_K (1024). The scores carry no gradient.
        A 1-D query [D] is one query: the results are then scores [k] and payload_ids [k], and exclude_groups may be
        an int. NumPy arrays are accepted for queries and exclude_groups (copied to the buffer's device); the results
        are tensors either way (`.numpy()` on a CPU buffer's).
        backend: "auto" (default: the C++ backend of the buffer's device, or on CUDA the Triton kernel where the
        crossover table says so), "cpu", "cuda" or "triton" (CUDA, or CPU under TRITON_INTERPRET=1); all return the
        same results. An explicit backend that cannot run here raises ValueError (rapo_fast/retrieval/backends.py).
        """
        queries, exclude_groups = as_tensor(queries, self.device), as_tensor(exclude_groups, self.device)
        one = isinstance(queries, torch.Tensor) and queries.dim() == 1
        if one:  # one query, and its exclusion as a [1] vector (an int, a 0-d tensor), for the [Q, D] contract
            queries = queries[None]
            if isinstance(exclude_groups, int):
                exclude_groups = torch.tensor([exclude_groups], device=self.device)
            elif isinstance(exclude_groups, torch.Tensor) and exclude_groups.dim() == 0:
                exclude_groups = exclude_groups[None]
        # One consistent state for the scores and the payload ids they map to. A traced search (torch.compile) cannot
        # hold a Python lock: it runs without it (docs/retrieval.md, "Thread safety").
        with contextlib.nullcontext() if torch.compiler.is_compiling() else self._lock.read():
            scores, slots = self._search_slots(queries, k, exclude_groups, min_score, backend)
            if self._payload.numel() == 0:  # a loaded empty buffer holds no rows to gather from (every slot is -1)
                payload = torch.full_like(slots, -1)
            else:
                payload = torch.where(slots >= 0, self._payload[slots.clamp_min(0)], torch.full_like(slots, -1))
        return (scores[0], payload[0]) if one else (scores, payload)

    def reset(self) -> None:
        """Empty the buffer (faiss's `reset`): no steps, no pins, automatic ids from 0 again; capacity, dim, dtype,
        device, metric and eviction are kept, and so is the storage (no reallocation)."""
        with self._lock.write():
            for name, fill in _SLOT_FILLS:
                getattr(self, name).fill_(fill)
            self._size = self._head = self._next_seq = 0
            self._has_pins = self._by_age = False
            self._key_sum = None

    def save(self, directory: str | os.PathLike) -> None:
        """Save atomically to `directory` (safetensors + JSON, format version FORMAT_VERSION); docs/formats.md."""
        with self._lock.read():  # one consistent state, also while another thread adds (adds wait)
            n = self._size
            tensors = {
                "keys": self._keys[:n],
                "payload_ids": self._payload[:n],
                "group_ids": self._group[:n],
                "scores": self._score[:n],
                "seq": self._seq[:n],
            }
            meta = {
                "capacity": self.capacity,
                "dim": self.dim,
                "dtype": str(self.dtype).removeprefix("torch."),
                "metric": self.metric,
                "eviction": self.eviction,
                "size": n,
                "head": self._head,
                "next_seq": self._next_seq,
            }
            write_snapshot(directory, tensors, meta)

    @classmethod
    def load(cls, directory: str | os.PathLike, device: torch.device | str | None = None) -> StepBuffer:
        """Load a buffer saved by `save` (onto `device`, default CPU). Raises StepBufferFormatError when any file,
        field or tensor is missing, corrupt or inconsistent (every one is checked first: rapo_fast/retrieval/io.py)."""
        tensors, meta = read_snapshot(directory)
        dtype = getattr(torch, meta["dtype"])  # one of the three key dtypes: read_snapshot checked it
        n, head, next_seq = meta["size"], meta["head"], meta["next_seq"]
        buf = cls.__new__(cls)  # storage for the n stored steps only (_grow), not the declared capacity
        buf._setup(meta["capacity"], meta["dim"], dtype, device, meta["metric"], meta["eviction"], rows=n)
        dev = buf.device
        buf._keys[:n] = tensors["keys"].to(dev)
        buf._aux[:n] = key_aux_ref(buf._keys[:n], buf.metric)
        buf._payload[:n] = tensors["payload_ids"].to(dev)
        buf._group[:n] = tensors["group_ids"].to(dev)
        buf._score[:n] = tensors["scores"].to(dev)
        buf._seq[:n] = tensors["seq"].to(dev)
        buf._size, buf._head, buf._next_seq = n, head, next_seq
        if buf.eviction == "fifo" and n > 1:  # pinned eviction may have left slots out of ring order: go by age then
            ring_seq = buf._seq[(head + torch.arange(n, device=dev)) % n]
            buf._by_age = not bool((ring_seq[1:] > ring_seq[:-1]).all())
        return buf
