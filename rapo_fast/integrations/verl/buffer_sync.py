"""How a verl step-buffer primary keeps its read replicas in step: the write log and catch-up (`ReplicaSet`, the
primary's side), the replica's side (`ReplicaRole`, mixed into StepBufferActor), the order a replica applies writes in
(`InOrder`) and the snapshots that carry a primary's state to a replica (`pack_traces` / `unpack_traces`).

What it is not: where replicas are placed or which copy a client reads (buffer_replicas.py), or the actor itself
(buffer_actor.py). The design: docs/verl.md section 4, "Read replicas". Importing it imports no ray.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import sys
import tarfile
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rapo_fast.integrations.verl.buffer_replicas import (
    StepBufferReplicaError,
    StepBufferStaleError,
    call_within,
    gone,
    handle_key,
    unavailable,
)

__all__ = ["InOrder", "PrimaryRole", "ReplicaRole", "ReplicaSet", "pack_traces", "unpack_traces"]


def pack_traces(traces: Any) -> bytes:
    """A StepTraces' save (StepTraces.save: checksummed) as one bytes object, to send through Ray's object store."""
    with tempfile.TemporaryDirectory() as tmp:
        traces.save(Path(tmp) / "s")
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            tar.add(Path(tmp) / "s", arcname="s")
        return out.getvalue()


def unpack_traces(state: bytes, load: Callable[[str], Any]) -> Any:
    """`load(directory)` of what pack_traces packed (its checks run there: a damaged snapshot raises)."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(state)) as tar:
            tar.extractall(tmp, filter="data")
        return load(str(Path(tmp) / "s"))


class InOrder:
    """Lets operation `seq` through once 0 .. seq - 1 have been through: `await turn(seq)` is True for the first
    arrival of `seq` (the caller then applies it and calls `advance()` with no await between), False for a repeat of
    one already through (applied: nothing to do). The primary numbers its writes in the order its one worker thread
    takes them; Ray does not promise that an async actor starts calls in the order they were sent, and two writes
    applied in different orders leave different FIFO rings."""

    def __init__(self) -> None:
        self.next = 0
        self._waiting: dict[int, asyncio.Future] = {}

    async def turn(self, seq: int) -> bool:
        while seq > self.next:
            fut = self._waiting.get(seq)
            if fut is None or fut.done():
                fut = self._waiting[seq] = asyncio.get_running_loop().create_future()
            await fut
        return seq == self.next

    def advance(self) -> None:
        """The current operation is queued: let the next one through."""
        self.reset(self.next + 1)

    def reset(self, nxt: int) -> None:
        """Writes 0 .. nxt - 1 are applied (a restore from a snapshot taken after them): wake every waiter, each
        checks again."""
        self.next = nxt
        for seq in [s for s in self._waiting if s <= nxt]:
            fut = self._waiting.pop(seq)
            if not fut.done():
                fut.set_result(None)


class _Member:
    def __init__(self, node: str, handle: Any):
        self.node, self.handle, self.key = node, handle, handle_key(handle)
        self.live = True  # receives the primary's writes as they happen (else: stale, being caught up)
        self.incarnation: Any = None  # the replica process's id (sync_state): a restarted one has another
        self.syncing: asyncio.Task | None = None


class ReplicaSet:
    """A primary's replicas and the log of its recent writes. `replicate(seq, op, args, expected)` sends a write the
    primary has applied to every live replica; one that fails, times out or reports another result (`expected`: the
    primary's fingerprint of the write) is marked stale: told to stop serving, sent no more writes, and caught up in
    the background (`snapshot()` when the log no longer reaches back to what it holds, then the log by sequence
    number) before it is live again. A replica that is gone for good (Ray's ActorDiedError) is dropped.
    `snapshot()`: an awaitable of (state bytes, writes applied before it)."""

    def __init__(
        self, snapshot: Callable[[], Awaitable[tuple[bytes, int]]], timeout_s: float, log_writes: int = 256
    ) -> None:
        self.snapshot, self.timeout_s = snapshot, timeout_s
        self.members: list[_Member] = []
        self.log: collections.OrderedDict[int, tuple[str, tuple, Any]] = collections.OrderedDict()
        self.log_writes, self.logged = log_writes, 0  # logged: writes 0 .. logged - 1 are in the log's past
        names = ("replicas_lost", "replica_resyncs", "replica_write_failures", "read_failovers")
        self.counters = dict.fromkeys(names, 0)

    async def attach(self, node: str, handle: Any, live: bool) -> None:
        """live: `handle` holds this primary's state now (made from its source before its first write); else it is
        caught up first."""
        m = _Member(node, handle)
        self.members.append(m)
        if live:
            try:
                _, m.incarnation = await call_within(handle.sync_state.remote(), self.timeout_s)
                await call_within(handle.serve.remote(0), self.timeout_s)
                return
            except Exception as exc:
                if not unavailable(exc):
                    raise
        self._stale(m)

    def listing(self, serving_only: bool = False) -> list[tuple[str, Any]]:
        return [(m.node, m.handle) for m in self.members if m.live or not serving_only]

    def stats(self) -> dict:
        stale = sum(not m.live for m in self.members)
        return {**self.counters, "replicas_stale": stale}

    async def replicate(self, seq: int, op: str, args: tuple, expected: Any) -> None:
        """Log write `seq` (applied here with result `expected`) and send it to every live replica; returns once each
        has applied it or is marked stale (told to stop serving), so no replica serves a state without it."""
        self.log[seq] = (op, args, expected)
        while len(self.log) > self.log_writes:
            self.log.popitem(last=False)
        self.logged = max(self.logged, seq + 1)
        live = [m for m in self.members if m.live]  # with no await since the log: a resync sees it or we see them
        calls = [m.handle.replay.remote(seq, m.incarnation, expected, op, *args) for m in live]
        got = await asyncio.gather(*(call_within(c, self.timeout_s) for c in calls), return_exceptions=True)
        # None: a repeat of a write it holds already (a catch-up's replay overtook this one)
        bad = [m for m, g in zip(live, got) if (isinstance(g, BaseException) or g not in (None, expected)) and m.live]
        self.counters["replica_write_failures"] += len(bad)
        for m in bad:
            self._stale(m)
        await asyncio.gather(*(self._stop(m) for m in bad))

    async def report(self, key: Any) -> None:
        """A client could not read from replica `key`: count it, and mark the replica stale unless it answers."""
        self.counters["read_failovers"] += 1
        for m in [m for m in self.members if m.key == key and m.live]:
            try:
                applied, incarnation = await call_within(m.handle.sync_state.remote(), self.timeout_s)
            except Exception as exc:
                if not unavailable(exc):
                    raise
                applied, incarnation = -1, None
            if m.live and (applied < 0 or incarnation != m.incarnation):  # broken, or restarted since
                self._stale(m)

    def _stale(self, m: _Member) -> None:
        m.live = False
        if m.syncing is None or m.syncing.done():
            m.syncing = asyncio.get_running_loop().create_task(self._resync(m))

    async def _stop(self, m: _Member) -> None:
        with contextlib.suppress(Exception):  # unreachable: it cannot serve either
            await call_within(m.handle.stop_serving.remote(), self.timeout_s)

    async def _resync(self, m: _Member) -> None:
        """Catch `m` up until it holds every logged write, then let it serve; retried with a growing pause while it
        is unreachable (restarting), given up when it is gone."""
        pause = 0.05
        while m in self.members:
            try:
                await self._catch_up(m)
                return
            except Exception as exc:
                if gone(exc):
                    self.members.remove(m)
                    self.counters["replicas_lost"] += 1
                    return
            await asyncio.sleep(pause)
            pause = min(2 * pause, 2.0)

    async def _catch_up(self, m: _Member) -> None:
        await self._stop(m)
        applied, m.incarnation = await call_within(m.handle.sync_state.remote(), self.timeout_s)  # -1: needs a snapshot
        while True:
            if applied < 0 or (applied < self.logged and applied not in self.log):
                state, applied = await self.snapshot()
                await call_within(m.handle.restore.remote(state, applied), self.timeout_s)
            todo = [s for s in self.log if s >= applied]
            if not todo and applied >= self.logged:
                break
            for seq in todo:  # in order: a replica applies one write at a time anyway
                op, args, expected = self.log.get(seq, (None, None, None))
                if op is None:  # left the log meanwhile: the snapshot above on the next pass
                    applied = -1
                    break
                got = await call_within(m.handle.replay.remote(seq, m.incarnation, expected, op, *args), self.timeout_s)
                if got is not None and got != expected:
                    raise StepBufferStaleError(f"replica on node {m.node}: write {seq} gave {got!r}, not {expected!r}")
                applied = seq + 1
        m.live = True  # no await since the check above: every later write reaches it through replicate
        await call_within(m.handle.serve.remote(applied), self.timeout_s)
        self.counters["replica_resyncs"] += 1


class PrimaryRole:
    """The primary's side, mixed into StepBufferActor (which provides _set: a ReplicaSet, _pool, _next_write, _done,
    _spec, replica, traces, _apply and _count): its replicas, and writes numbered, applied and replicated."""

    async def attach_replicas(self, replicas: list[tuple[str, Any]], spec: dict | None = None) -> None:
        """(node id, handle) of this primary's replicas, built from its source: from now on every add and load is
        replayed on them in this actor's order. Before the first write only (they must hold this state). spec: how
        they were made (`replica_spec()`: for place_replicas)."""
        if self.replica or self._next_write:
            raise StepBufferReplicaError("attach_replicas: a primary's replicas are attached before its first write")
        self._spec = spec
        await asyncio.gather(*(self._set.attach(node, h, live=True) for node, h in replicas))

    async def add_replica(self, node: str, handle: Any) -> None:
        """A replica made after this primary's first writes (a node that joined): caught up, then it serves."""
        self._refuse_on_replica("add_replica")
        await self._set.attach(node, handle, live=False)

    async def replicas(self, serving_only: bool = False) -> list[tuple[str, Any]]:
        """A primary's replicas (those in step with it only, with serving_only), as (node id, handle)."""
        return self._set.listing(serving_only)

    async def replica_spec(self) -> dict | None:
        return self._spec

    async def report_unreachable(self, key: Any) -> None:
        """A client could not read from the replica `key` (buffer_replicas.handle_key): checked, stale if so."""
        await self._set.report(key)

    def _remember(self, write_id: str | None, task: asyncio.Task) -> asyncio.Task:
        """Keep a recent add's task under its write id (a repeat awaits it); forgotten if it fails (a retry applies)."""
        if write_id is not None:
            self._done[write_id] = task
            task.add_done_callback(lambda t: (t.cancelled() or t.exception()) and self._done.pop(write_id, None))
            while len(self._done) > 65536:
                self._done.popitem(last=False)
        return task

    def _refuse_on_replica(self, what: str) -> None:
        if self.replica:
            raise StepBufferReplicaError(f"{what}: this actor is a read replica; writes and saves go to its primary")

    def _write(self, op: str, *args: Any) -> asyncio.Task:
        """Apply an add or load here, then replicate it (buffer_replicas.ReplicaSet). Its number is taken and its work
        queued on the one worker thread with no await between, so the numbers follow the order this actor applies its
        writes in; the rest runs as a task a cancelled caller does not stop (a number never sent would stall the
        replicas)."""
        seq, self._next_write = self._next_write, self._next_write + 1
        here = asyncio.wrap_future(self._pool.submit(self._apply, op, args))
        return asyncio.get_running_loop().create_task(self._replicate(seq, op, args, here))

    async def _replicate(self, seq: int, op: str, args: tuple, here: asyncio.Future) -> Any:
        try:
            out = await here
        except BaseException:
            await self._set.replicate(seq, "skip", (), "skip")  # the replicas skip it too: no gap in the numbers
            raise
        await self._set.replicate(seq, op, args, out)
        return self._count(op, args, out)

    async def _snapshot(self) -> tuple[bytes, int]:
        """This primary's state (bytes) and how many writes it holds: queued behind every write numbered before."""
        at = self._next_write
        # self.traces read when the snapshot runs: an earlier load in the queue replaces it
        return await asyncio.wrap_future(self._pool.submit(lambda: pack_traces(self.traces))), at


class ReplicaRole:
    """The replica's side of ReplicaSet, mixed into StepBufferActor (which provides traces, _pool, _in_order,
    _incarnation, _serving, _broken, replica, _apply, _count and _load_traces)."""

    async def replay(self, seq: int, incarnation: str, expected: Any, op: str, *args: Any) -> Any:
        """Its primary's write number `seq`, applied after writes 0 .. seq - 1; the result (a fingerprint of what it
        stored) must be `expected`, the primary's, else this replica is broken (serves nothing until restored). None:
        a repeat of a write it holds. incarnation: the process the primary caught up (a restarted one refuses)."""
        self._only_on_replica("replay")
        if incarnation != self._incarnation:
            raise StepBufferStaleError("replay: this replica restarted since its primary caught it up")
        if not await self._in_order.turn(seq):
            return None
        fut = self._pool.submit(self._apply_replay, op, args, expected)  # the one worker thread keeps the order
        self._in_order.advance()
        out = await asyncio.wrap_future(fut)
        self._count(op, args, out)
        return out

    def _apply_replay(self, op: str, args: tuple, expected: Any) -> Any:
        if self._broken:
            raise StepBufferStaleError(f"{op}: this replica failed an earlier write; it waits for a snapshot")
        try:
            out = self._apply(op, args)
        except BaseException:
            self._serving, self._broken = False, True
            raise
        if out != expected:
            self._serving, self._broken = False, True
            raise StepBufferStaleError(f"{op}: this replica stored {out!r}, its primary {expected!r}")
        return out

    async def sync_state(self) -> tuple[int, str]:
        """(writes applied, or -1 when broken; this process's incarnation)."""
        self._only_on_replica("sync_state")
        return (-1 if self._broken else self._in_order.next), self._incarnation

    async def serve(self, applied: int) -> None:
        """Serve searches: it holds its primary's writes 0 .. applied - 1 and gets the later ones as they happen."""
        self._only_on_replica("serve")
        if self._broken or self._in_order.next < applied:
            raise StepBufferStaleError(f"serve: this replica holds {self._in_order.next} writes, not {applied}")
        self._serving = True

    async def stop_serving(self) -> None:
        self._serving = False

    async def restore(self, state: bytes, applied: int) -> None:
        """Replace the state by its primary's snapshot, taken after its writes 0 .. applied - 1."""
        self._only_on_replica("restore")
        self._serving = False
        self._in_order.reset(sys.maxsize)  # until restored, a late replay is a repeat (the snapshot holds it)
        await asyncio.wrap_future(self._pool.submit(self._restore, state))
        self._in_order.reset(applied)

    def _restore(self, state: bytes) -> None:
        self.traces = unpack_traces(state, self._load_traces)
        self._broken = False

    def _only_on_replica(self, what: str) -> None:
        if not self.replica:
            raise StepBufferReplicaError(f"{what}: only a replica takes its primary's writes")
