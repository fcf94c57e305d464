"""`ShardedStepBuffer`: a StepBuffer spread over the ranks of a torch.distributed process group (docs/retrieval.md).

Each rank keeps its own shard; `search` is collective and exact over the union, and validates collectively first (one
all_gather of a fixed-size descriptor, so all ranks go on or all raise the same error).
What this is not: a fault-tolerant collective (a rank that dies or never calls `search` still blocks the others until
the process group's timeout), or a distributed `add` (adding is local to each rank).
"""

from __future__ import annotations

import os

import torch

from rapo_fast._ext import DTYPE_CODES
from rapo_fast.retrieval.buffer import StepBuffer
from rapo_fast.retrieval.op import METRIC_CODES

__all__ = ["ShardedStepBuffer"]

# Descriptor layout: _HEADER int64 fields, then the local error's text (UTF-8, zero-padded) in _MSG_WORDS words.
_STATUS, _Q, _K, _MIN_SCORE, _DIM, _DTYPE, _METRIC, _CAPACITY = range(8)
_HEADER, _MSG_WORDS = 8, 64
_ERRORS = {0: None, 1: ValueError, 2: TypeError, 3: RuntimeError}  # status code -> the class every rank raises
_AGREED = {_K: "k", _MIN_SCORE: "min_score", _DIM: "dim", _DTYPE: "dtype", _METRIC: "metric", _CAPACITY: "capacity"}


def _float_bits(x: float) -> int:
    return int(torch.tensor([x + 0.0], dtype=torch.float64).view(torch.int64).item())  # + 0.0: -0.0 equals 0.0


def _bits_float(b: int) -> float:
    return float(torch.tensor([b], dtype=torch.int64).view(torch.float64).item())


def _encode_message(text: str) -> torch.Tensor:
    raw = text.encode("utf-8")[: _MSG_WORDS * 8]
    buf = torch.zeros(_MSG_WORDS * 8, dtype=torch.uint8)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.view(torch.int64)


def _decode_message(words: torch.Tensor) -> str:
    return bytes(words.contiguous().view(torch.uint8).tolist()).rstrip(b"\0").decode("utf-8", errors="replace")


class ShardedStepBuffer:
    """A StepBuffer sharded over the ranks of a torch.distributed process group (NCCL on GPU, gloo on CPU).

    Each rank stores its own steps (`add` is local) in a shard of `capacity` slots; global slot ids are
    rank * capacity + local slot. `search` is collective (every rank calls it, with its own queries, possibly a
    different Q per rank, and the same k and min_score): queries are all-gathered, each rank takes its shard's top-k for
    all of them, results are all-gathered and merged per query with the same order as StepBuffer (score, then global
    slot). Returns the same shapes as StepBuffer.search for the calling rank's queries. Every rank's shard must have the
    same capacity, dim, dtype and metric; `search` checks this, and a bad argument on any rank, collectively: all ranks
    raise the same ValueError/TypeError, naming the rank, and the group stays usable.
    """

    def __init__(
        self,
        capacity: int,
        dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        metric: str = "ip",
        eviction: str = "fifo",
        group=None,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedStepBuffer needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.local = StepBuffer(capacity, dim, dtype, device, metric, eviction)

    def __len__(self) -> int:
        """Number of steps in this rank's shard (see global_len for the total)."""
        return len(self.local)

    def global_len(self) -> int:
        """Total number of steps over all ranks (collective)."""
        import torch.distributed as dist

        t = torch.tensor([len(self.local)], dtype=torch.int64, device=self._comm_device())
        dist.all_reduce(t, group=self.group)
        return int(t.item())

    def add(
        self,
        embeddings: torch.Tensor,
        payload_ids: torch.Tensor,
        group_ids: torch.Tensor,
        scores: torch.Tensor | None = None,
        pinned: torch.Tensor | bool | None = None,
    ) -> torch.Tensor:
        """Store steps in this rank's shard; returns global slot ids [M] (-1 for a step not kept). Not collective.
        `pinned` as StepBuffer.add: pinned steps are evicted only by pinned ones (the shard's own eviction)."""
        slots = self.local.add(embeddings, payload_ids, group_ids, scores, pinned)
        return torch.where(slots >= 0, slots + self.rank * self.local.capacity, slots)

    @property
    def pinned(self) -> torch.Tensor:
        """This rank's shard's pins [len(self)] (StepBuffer.pinned)."""
        return self.local.pinned

    def set_pinned(self, mask: torch.Tensor) -> None:
        """Set this rank's shard's pins (StepBuffer.set_pinned; a loaded shard has none: pins are not saved)."""
        self.local.set_pinned(mask)

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist

        return self.local.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        dev = self._comm_device()
        out = [torch.empty_like(t, device=dev) for _ in range(self.world_size)]
        dist.all_gather(out, t.to(dev).contiguous(), group=self.group)
        return out

    def _check_local(
        self, queries, k, exclude_groups, min_score, backend="auto"
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """This rank's own checks (no communication): the queries rounded to the shard's dtype (as fp32), exclude."""
        # StepBuffer.search's own checks; the queries come back rounded to the shard's dtype, exact in the fp32 that
        # travels between ranks.
        q, _k, exclude, thr = self.local._check_search_args(queries, k, exclude_groups, min_score, backend)
        return q.to(torch.float32), exclude, thr

    def _descriptor(self, Q: int, k, thr: float, error: BaseException | None) -> torch.Tensor:
        buf = self.local
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[_STATUS] = 0 if error is None else {ValueError: 1, TypeError: 2}.get(type(error), 3)
        head[_Q] = Q
        head[_K] = k if error is None else -1
        head[_MIN_SCORE] = _float_bits(thr)
        head[_DIM], head[_DTYPE] = buf.dim, DTYPE_CODES[buf.dtype]
        head[_METRIC], head[_CAPACITY] = METRIC_CODES[buf.metric], buf.capacity
        msg = "" if error is None else str(error.args[0] if len(error.args) == 1 else error)
        return torch.cat([head, _encode_message(msg)])

    def _agree(
        self, queries, k, exclude_groups, min_score, backend="auto"
    ) -> tuple[torch.Tensor, torch.Tensor | None, float, list]:
        """Local checks, then one all_gather of the descriptors; raises the same error on every rank, or returns the
        checked (queries, exclude, min_score) and every rank's Q."""
        error, q, exclude, thr = None, None, None, float("-inf")
        try:
            q, exclude, thr = self._check_local(queries, k, exclude_groups, min_score, backend)
        except Exception as exc:  # any local failure must reach the other ranks before they gather
            error = exc
        Q = q.shape[0] if q is not None else -1
        descs = [d.cpu() for d in self._all_gather(self._descriptor(Q, k, thr, error))]
        where = f"ShardedStepBuffer.search, world_size {self.world_size}; every rank raises this error"
        for r, d in enumerate(descs):  # the lowest failing rank's error, identical on every rank
            status = int(d[_STATUS])
            if status != 0:
                raise _ERRORS.get(status, RuntimeError)(f"rank {r}: {_decode_message(d[_HEADER:])} ({where})")
        for field, name in _AGREED.items():
            values = [int(d[field]) for d in descs]
            if len(set(values)) > 1:
                shown = [_bits_float(v) for v in values] if field == _MIN_SCORE else values
                raise ValueError(f"{name}: expected one value on every rank, got {shown} by rank ({where})")
        return q, exclude, thr, [int(d[_Q]) for d in descs]

    def search(
        self,
        queries: torch.Tensor,
        k: int,
        exclude_groups: torch.Tensor | None = None,
        min_score: float | None = None,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective exact top-k over every shard: queries [Q, D] -> (scores [Q, k] fp32, payload_ids [Q, k]).

        Bad arguments on any rank, or a k/min_score/shard layout that differs between ranks, raise the same
        ValueError/TypeError on every rank before any data moves. backend: as StepBuffer.search, for this rank's shard
        (checked with the other arguments: one that cannot run on a rank's device fails every rank).
        """
        q, exclude, thr, sizes = self._agree(queries, k, exclude_groups, min_score, backend)
        dev, r, Q, qmax = self.local.device, self.rank, q.shape[0], max(sizes)
        qpad = torch.zeros(qmax, self.local.dim, dtype=torch.float32, device=dev)
        qpad[:Q] = q
        epad = torch.full((qmax,), -1, dtype=torch.int64, device=dev)
        if exclude is not None:
            epad[:Q] = exclude
        all_q = torch.cat(self._all_gather(qpad)).to(dev)
        all_e = torch.cat(self._all_gather(epad)).to(dev)
        # Every rank searches the same gathered queries with the same options: it succeeds or fails on all ranks alike.
        with self.local._lock.read():  # as StepBuffer.search: scores and payload ids from one state of the shard
            s, slot = self.local._search_slots(all_q, k, all_e, None if thr == float("-inf") else thr, backend)
            payload = torch.where(slot >= 0, self.local._payload[slot.clamp_min(0)], torch.full_like(slot, -1))
        gslot = torch.where(slot >= 0, slot + r * self.local.capacity, torch.full_like(slot, -1))
        mine = slice(r * qmax, r * qmax + Q)
        s_all = torch.cat([x.to(dev)[mine] for x in self._all_gather(s)], dim=1)  # [Q, W*k]
        g_all = torch.cat([x.to(dev)[mine] for x in self._all_gather(gslot)], dim=1)
        p_all = torch.cat([x.to(dev)[mine] for x in self._all_gather(payload)], dim=1)
        # Order by global slot first (padding last), then a stable sort by score keeps the smaller slot on ties.
        big = torch.iinfo(torch.int64).max
        order = torch.argsort(torch.where(g_all >= 0, g_all, torch.full_like(g_all, big)), dim=1)
        by_score = torch.argsort(torch.gather(s_all, 1, order), dim=1, descending=True, stable=True)
        order = torch.gather(order, 1, by_score)
        order = order[:, :k]
        return torch.gather(s_all, 1, order), torch.gather(p_all, 1, order)

    def save(self, directory: str | os.PathLike) -> None:
        """Save this rank's shard to <directory>/rank<r> (not collective)."""
        self.local.save(os.path.join(os.fspath(directory), f"rank{self.rank}"))

    def load_shard(self, directory: str | os.PathLike) -> None:
        """Replace this rank's shard with <directory>/rank<r> saved by `save`."""
        self.local = StepBuffer.load(os.path.join(os.fspath(directory), f"rank{self.rank}"), self.local.device)
