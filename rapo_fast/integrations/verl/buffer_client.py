"""The client of the verl step buffer: what an agent loop or reward worker holds, and the buffer's save layout.

What this is: `StepBufferClient` (picklable, async) and the save layout's names (SAVE_FORMAT, SAVE_VERSION,
SAVE_PREFIX, `StepBufferSaveError`, `is_bare_traces`); docs/verl.md section 4 describes both.
What it is not: the actor or the buffer's creation (buffer_actor.py, which re-exports this client). Importing it
imports no ray (the sync save/load/stats import it).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rapo_fast._atomic import FormatError, VersionWriter, read_version
from rapo_fast._checks import check_field, check_float, check_int, check_min_score
from rapo_fast.integrations.verl.buffer_replicas import Readers
from rapo_fast.integrations.verl.buffer_requests import (
    Coalescer,
    check_groups,
    check_histories,
    check_scores,
)
from rapo_fast.retrieval.encoders import make_encoder

__all__ = ["StepBufferClient", "StepBufferSaveError", "is_bare_traces", "SAVE_FORMAT", "SAVE_VERSION", "SAVE_PREFIX"]

SAVE_FORMAT, SAVE_VERSION, SAVE_PREFIX = "rapo_fast.verl.StepBuffer", 1, "stepbuf"


class StepBufferSaveError(FormatError):
    """A saved step buffer (this module's sharded layout) is missing, corrupt or does not fit the actors."""


def is_bare_traces(path: Path) -> bool:
    """A directory saved by StepTraces.save itself (one shard), rather than this module's sharded layout."""
    try:
        return (path / "CURRENT").read_text().startswith("traces-")
    except OSError:
        return False


class StepBufferClient:
    """The agent loop's view of the buffer: async retrieve/add_steps, sync save/load/stats (driver side).

    It encodes the histories in the caller's process (with `encoder`, the spec the actors were built with) and sends
    keys; a process's retrieves that arrive while a call is being served (or within window_s of the first one, when
    window_s > 0), up to max_batch histories, share the next encoding and call per shard. handles: the shards'
    primaries (adds, saves, loads); replicas: per shard, (node id, handle) of its read replicas, where the searches go
    (buffer_replicas.Readers). Picklable: a copy holds the handles and settings, and makes its encoder when first
    used."""

    def __init__(
        self,
        handles: Sequence[Any],
        encoder: str | Callable = "hashed",
        *,
        replicas: Sequence[Sequence[tuple[str, Any]]] | None = None,
        window_s: float = 0.0,
        max_batch: int = 1024,
    ):
        if not handles:
            raise ValueError("StepBufferClient: handles: expected at least one actor handle, got none")
        replicas = [[] for _ in handles] if replicas is None else [list(r) for r in replicas]
        if len(replicas) != len(handles):
            raise ValueError(
                f"StepBufferClient: replicas: expected one entry per shard ({len(handles)}), got {len(replicas)}"
            )
        window_s = check_float("StepBufferClient: window_s", window_s, min_value=0.0, max_value=10.0)
        max_batch = check_int("StepBufferClient: max_batch", max_batch, lo=1)
        self.handles, self.encoder_spec, self.replicas = list(handles), encoder, replicas
        self.window_s, self.max_batch = float(window_s), max_batch
        self._readers = Readers(self.handles, replicas)
        self._encoder: Callable | None = None
        self._lock = threading.Lock()
        self._retrieves = Coalescer(self._serve_retrieve, self.window_s, max_batch)

    def __getstate__(self) -> dict:
        return {
            "handles": self.handles,
            "encoder": self.encoder_spec,
            "replicas": self.replicas,
            "window_s": self.window_s,
            "max_batch": self.max_batch,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.pop("handles"), **state)

    @property
    def num_shards(self) -> int:
        return len(self.handles)

    def encode(self, histories: list[str]) -> torch.Tensor:
        """fp32 [N, D] keys of `histories`, as the actors' StepTraces.encode would make them (markers stripped)."""
        from rapo_fast.retrieval.step_traces import strip_retrieve_markers

        with self._lock:  # one encoder per client, made on first use (a MiniLM load must not happen twice)
            if self._encoder is None:
                self._encoder = make_encoder(self.encoder_spec)
        keys = self._encoder([strip_retrieve_markers(h) for h in histories])
        if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[0] != len(histories):
            raise ValueError(f"encoder: expected a [{len(histories)}, D] tensor, got {getattr(keys, 'shape', keys)!r}")
        return keys.detach().float().cpu()

    async def retrieve(
        self, histories: list[str], exclude_groups: list[int] | None = None, min_score: float | None = None
    ) -> list[tuple[list[int] | None, int, float]]:
        """Per history: (token ids of the retrieved segment incl. <retrieve> delimiters or None, payload id or -1,
        score or -inf). exclude_groups: per history, the group whose steps must not be returned (negative: none)."""
        histories = check_histories(histories, "retrieve")
        n = len(histories)
        excl = [-1] * n if exclude_groups is None else check_groups(exclude_groups, n, "exclude_groups", "retrieve")
        min_score = check_min_score("retrieve: min_score", min_score)
        if not histories:
            return []
        return await self._retrieves.submit((histories, excl, min_score), n, min_score)

    async def _serve_retrieve(self, batch: list) -> list[list[tuple[list[int] | None, int, float]]]:
        """One encoding and one call per shard (to its primary or a replica) for the batch's histories; each request
        gets its rows."""
        hist = [h for req in batch for h in req[0]]
        excl = [g for req in batch for g in req[1]]
        keys = await asyncio.get_running_loop().run_in_executor(None, self.encode, hist)
        parts = await asyncio.gather(*(h.retrieve.remote(keys, excl, batch[0][2]) for h in self._readers.pick()))
        n, rows = self.num_shards, []
        for q in range(len(hist)):
            best = (None, -1, float("-inf"))
            for s, (segs, pids, scores) in enumerate(parts):  # strict >: a tie keeps the lower shard
                if pids[q] >= 0 and (best[1] < 0 or scores[q] > best[2]):
                    best = (segs[q], pids[q] * n + s, scores[q])
            rows.append(best)
        out, i = [], 0
        for req in batch:
            out.append(rows[i : i + len(req[0])])
            i += len(req[0])
        return out

    async def add_steps(
        self, histories: list[str], steps: list[str], group_ids: list[int], scores: list[float] | None = None
    ) -> int:
        """Add the policy's own steps (one entry per step) under their prompts' group ids; returns how many the shards
        stored (a shard full of pinned off-policy steps drops new ones: its stats() count them in steps_dropped). The
        histories are encoded here; each shard's primary gets the keys of its groups (and replays them on its
        replicas)."""
        histories = check_histories(histories, "add_steps")
        group_ids = check_groups(group_ids, len(histories), "group_ids", "add_steps", lo=0)
        steps = check_histories(steps, "add_steps", "steps")
        if len(steps) != len(histories):
            raise ValueError(f"add_steps: steps: expected {len(histories)} entries (one per history), got {len(steps)}")
        scores = check_scores(scores, len(histories))
        if not histories:
            return 0
        keys = await asyncio.get_running_loop().run_in_executor(None, self.encode, histories)
        n, calls = self.num_shards, []
        for s, h in enumerate(self.handles):
            idx = [i for i, g in enumerate(group_ids) if g % n == s]
            if idx:
                part = [None if xs is None else [xs[i] for i in idx] for xs in (steps, group_ids, scores)]
                calls.append(h.add_steps.remote(keys[idx], *part))
        return int(sum(await asyncio.gather(*calls)))

    def save(self, path: str | os.PathLike) -> None:
        """Save every shard's primary (not its replicas: they hold the same state) into one versioned directory
        (rapo_fast._atomic): shard_i/ are StepTraces saves, listed with their checksums in one manifest that CURRENT
        switches to atomically. `path` must be reachable from the actors' nodes (a shared filesystem on a multi-node
        cluster)."""
        import ray

        with VersionWriter(path, SAVE_PREFIX, SAVE_FORMAT, SAVE_VERSION) as w:
            ray.get([h.save.remote(str(w.path / f"shard_{i}")) for i, h in enumerate(self.handles)])
            for i in range(self.num_shards):
                w.add_nested(f"shard_{i}")
            w.commit({"num_shards": self.num_shards})

    def load(self, path: str | os.PathLike) -> None:
        """Replace every shard's state by a save of `save` (or, with one shard, of StepTraces.save); each primary
        has its replicas load it too."""
        import ray

        path = Path(path)
        if is_bare_traces(path):
            if self.num_shards != 1:
                raise StepBufferSaveError(f"{path}: a one-shard StepTraces save, the buffer has {self.num_shards}")
            ray.get(self.handles[0].load.remote(str(path)))
            return
        with read_version(path, SAVE_PREFIX, SAVE_FORMAT, SAVE_VERSION, StepBufferSaveError) as v:
            n = check_field(v.meta, "num_shards", v.path / "meta.json", StepBufferSaveError, check_int, lo=1)
            if n != self.num_shards:
                raise StepBufferSaveError(f"{v.path}: field 'num_shards' is {n}, the buffer has {self.num_shards}")
            ray.get([h.load.remote(str(v.path / f"shard_{i}")) for i, h in enumerate(self.handles)])

    def stats(self) -> list[dict]:
        """Each actor's stats(): the primaries in shard order, then the replicas (role "replica")."""
        import ray

        return ray.get([h.stats.remote() for h in self.handles + [h for reps in self.replicas for _, h in reps]])
