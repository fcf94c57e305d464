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
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rapo_fast._atomic import FormatError, VersionWriter, read_version
from rapo_fast._checks import check_field, check_float, check_int, check_min_score
from rapo_fast.integrations.verl.buffer_replicas import Readers, gone, unavailable
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
    (buffer_replicas.Readers: a copy that fails or takes over timeout_s is dropped and the search asked of the next;
    every refresh_s the serving replicas are re-read from the primaries). Picklable: a copy holds the handles and
    settings, and makes its encoder when first used."""

    def __init__(
        self,
        handles: Sequence[Any],
        encoder: str | Callable = "hashed",
        *,
        replicas: Sequence[Sequence[tuple[str, Any]]] | None = None,
        window_s: float = 0.0,
        max_batch: int = 1024,
        timeout_s: float = 30.0,
        refresh_s: float = 10.0,
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
        timeout_s = check_float("StepBufferClient: timeout_s", timeout_s, min_value=0.0, min_inclusive=False)
        refresh_s = check_float("StepBufferClient: refresh_s", refresh_s, min_value=0.0)
        self.handles, self.encoder_spec, self.replicas = list(handles), encoder, replicas
        self.window_s, self.max_batch, self.timeout_s, self.refresh_s = float(window_s), max_batch, timeout_s, refresh_s
        self._readers = Readers(self.handles, replicas, timeout_s, refresh_s)
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
            "timeout_s": self.timeout_s,
            "refresh_s": self.refresh_s,
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
        """One encoding and one call per shard (to a replica or its primary, failing over: Readers.call) for the
        batch's histories; each request gets its rows."""
        hist = [h for req in batch for h in req[0]]
        excl = [g for req in batch for g in req[1]]
        keys = await asyncio.get_running_loop().run_in_executor(None, self.encode, hist)
        search = lambda h: h.retrieve.remote(keys, excl, batch[0][2])  # noqa: E731
        parts = await asyncio.gather(*(self._readers.call(s, search) for s in range(self.num_shards)))
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
        self,
        histories: list[str],
        steps: list[str],
        group_ids: list[int],
        scores: list[float] | None = None,
        write_id: str | None = None,
    ) -> int:
        """Add the policy's own steps (one entry per step) under their prompts' group ids; returns how many the shards
        stored (a shard full of pinned off-policy steps drops new ones: its stats() count them in steps_dropped). The
        histories are encoded here; each shard's primary gets the keys of its groups (and replays them on its
        replicas). Stored means stored at the primary and at every replica that serves searches (one that missed it
        serves none until it has caught up). write_id (default: a new one): each shard's part carries it, so a call
        repeated with the same id (a retry after an error) stores nothing twice; this client retries a part whose
        primary is briefly unavailable (restarting), with its id."""
        histories = check_histories(histories, "add_steps")
        group_ids = check_groups(group_ids, len(histories), "group_ids", "add_steps", lo=0)
        steps = check_histories(steps, "add_steps", "steps")
        if len(steps) != len(histories):
            raise ValueError(f"add_steps: steps: expected {len(histories)} entries (one per history), got {len(steps)}")
        scores = check_scores(scores, len(histories))
        if not histories:
            return 0
        keys = await asyncio.get_running_loop().run_in_executor(None, self.encode, histories)
        n, calls, write_id = self.num_shards, [], write_id or uuid.uuid4().hex
        for s, h in enumerate(self.handles):
            idx = [i for i, g in enumerate(group_ids) if g % n == s]
            if idx:
                part = [None if xs is None else [xs[i] for i in idx] for xs in (steps, group_ids, scores)]
                calls.append(_add_part(h, (keys[idx], *part, f"{write_id}:{s}")))
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
        """Each actor's stats(): the primaries in shard order, then their replicas (role "replica") that answer within
        timeout_s (one that does not is left out: the primaries' replicas_stale / replicas_lost count it)."""
        import ray

        primaries = ray.get([h.stats.remote() for h in self.handles], timeout=self.timeout_s)
        reps = [h for hs in ray.get([h.replicas.remote() for h in self.handles]) for _, h in hs]
        refs = [h.stats.remote() for h in reps]
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=0))
            except Exception as exc:
                if not unavailable(exc):
                    raise
        return primaries + out


async def _add_part(handle: Any, args: tuple, tries: int = 3) -> int:
    """One shard's add, repeated with its write id while its primary is unavailable but not gone."""
    attempt = 0
    while True:
        try:
            return await handle.add_steps.remote(*args)
        except Exception as exc:
            attempt += 1
            if not unavailable(exc) or gone(exc) or attempt >= tries:
                raise
            await asyncio.sleep(0.2 * 2**attempt)
