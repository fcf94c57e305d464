"""Read replicas of the verl step buffer: where they are placed, and which copy a client's search goes to.

What this is: `Readers` (a client's failover), `unavailable` / `gone` (which errors mean "try another copy"), the
replica errors, `check_replicas_per_node`, `replica_nodes` / `on_node`, `keep_owned` (the creator's hold on its
actors). The design: docs/verl.md section 4, "Read replicas". What it is not: how replicas are kept in step
(buffer_sync.py), the actor or the client (buffer_actor.py, buffer_client.py). Importing it imports no ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rapo_fast._checks import check_int

__all__ = [
    "Readers",
    "StepBufferReplicaError",
    "StepBufferStaleError",
    "call_within",
    "check_replicas_per_node",
    "gone",
    "handle_key",
    "keep_owned",
    "on_node",
    "replica_nodes",
    "unavailable",
]


# the creating process's handles of its buffers' actors: {(Ray node of this process, namespace, name): handles}
_OWNED: dict[tuple[str, str | None, str], list] = {}


def keep_owned(name: str, namespace: str | None, handles: Sequence[Any], more: bool = False) -> None:
    """Hold this process's handles of buffer `name`'s actors (primaries and replicas it made) for as long as its Ray
    session lasts, so they live as long as their creator, as documented. Ray kills a non-detached actor once its
    creator holds no handle to it, and a handle from ray.get_actor (get_step_buffer's) does not count: without this
    hold, the buffer died when the client get_or_create_step_buffer returned was collected. more: add to the held
    handles (place_replicas), else replace them (a buffer made again under its name). Entries of an earlier Ray
    session (another node id for this process) are dropped."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for key in [k for k in _OWNED if k[0] != here]:
        del _OWNED[key]
    key = (here, namespace, name)
    _OWNED[key] = (_OWNED.get(key, []) if more else []) + list(handles)


class StepBufferReplicaError(RuntimeError):
    """A write or save was sent to a read replica, or a replica was asked to do what only a replica does."""


class StepBufferStaleError(StepBufferReplicaError):
    """This replica lacks (or may lack) one of its primary's writes: it serves no search until it has caught up."""


def unavailable(exc: BaseException) -> bool:
    """An error that says "this copy cannot answer now" (dead, restarting, unreachable, timed out, stale), not "this
    request is wrong": the caller may ask another copy."""
    if isinstance(exc, (StepBufferStaleError, TimeoutError, ConnectionError)):
        return True
    rex = sys.modules.get("ray.exceptions")  # loaded wherever a Ray handle was used
    errors = ("RayActorError", "ActorUnschedulableError", "NodeDiedError", "ObjectLostError", "WorkerCrashedError")
    return rex is not None and isinstance(exc, tuple(getattr(rex, n) for n in errors if hasattr(rex, n)))


def gone(exc: BaseException) -> bool:
    """An error that says the actor will never answer again (Ray's ActorDiedError; LocalHandle.kill's
    ConnectionAbortedError), as opposed to one that is restarting or slow."""
    if isinstance(exc, ConnectionAbortedError):
        return True
    rex = sys.modules.get("ray.exceptions")
    return rex is not None and isinstance(exc, (rex.ActorDiedError, rex.ActorUnschedulableError))


def handle_key(handle: Any) -> Any:
    """What identifies an actor across pickled copies of its handle (Ray's actor id; an in-process handle itself)."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else id(handle)


def check_replicas_per_node(value: Any) -> int:
    """0 (no replicas: searches go to the primaries, as without this module) or a positive int."""
    return check_int("step buffer: replicas_per_node (rapo.step_buffer.replicas_per_node)", value, lo=0)


def replica_nodes() -> list[str]:
    """The alive nodes with CPUs, where verl places its agent-loop workers (AgentLoopManager's round robin)."""
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0)


def on_node(node_id: str) -> Any:
    """Ray's scheduling strategy that keeps an actor on `node_id` (hard: a replica elsewhere would serve no one)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _this_node() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


async def call_within(ref: Any, timeout_s: float) -> Any:
    """The result of a Ray call (or any awaitable), TimeoutError after timeout_s."""
    return await asyncio.wait_for(ref, timeout_s)


class Readers:
    """Which actor each shard's search goes to, and failover: the shard's serving replicas on the caller's node first
    (round robin per call), then its other replicas, then its primary. A copy that is unavailable (`unavailable`) is
    dropped from this client's set and reported to its primary; the search goes on at the next copy. Every
    `refresh_s` the set is re-read from the primaries (replicas that caught up or were added come back)."""

    def __init__(
        self,
        primaries: Sequence[Any],
        replicas: Sequence[Sequence[tuple[str, Any]]],
        timeout_s: float = 30.0,
        refresh_s: float = 10.0,
    ):
        self.primaries, self.replicas = list(primaries), [list(r) for r in replicas]
        self.timeout_s, self.refresh_s = timeout_s, refresh_s
        self.failovers = 0
        self._node: str | None = None
        self._turn = 0
        self._refreshed = time.monotonic()
        self._refreshing: asyncio.Task | None = None

    def order(self, shard: int) -> list[Any]:
        if self._node is None:  # on first use: a client is built on one node and unpickled on another
            self._node = _this_node() or ""
        reps = self.replicas[shard]
        here = [h for n, h in reps if n == self._node]
        there = [h for n, h in reps if n != self._node]
        k = self._turn % len(here) if here else 0
        k2 = self._turn % len(there) if there else 0
        return here[k:] + here[:k] + there[k2:] + there[:k2] + [self.primaries[shard]]

    async def call(self, shard: int, fn: Callable[[Any], Any]) -> Any:
        """fn(handle) -> an awaitable (a Ray call) at the first copy that answers."""
        self._maybe_refresh()
        self._turn += 1
        last: BaseException | None = None
        for h in self.order(shard):
            try:
                return await call_within(fn(h), self.timeout_s)
            except Exception as exc:
                if not unavailable(exc):
                    raise
                last = exc
                if h is not self.primaries[shard]:
                    self._drop(shard, h)
        raise last  # type: ignore[misc]  # the primary was the last copy: no copy answered

    def _drop(self, shard: int, h: Any) -> None:
        key = handle_key(h)
        self.replicas[shard] = [(n, r) for n, r in self.replicas[shard] if handle_key(r) != key]
        self.failovers += 1
        with contextlib.suppress(Exception):  # the primary re-checks it; a lost report only delays that
            self.primaries[shard].report_unreachable.remote(key)

    def _maybe_refresh(self) -> None:
        if time.monotonic() - self._refreshed < self.refresh_s:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshed = time.monotonic()
            self._refreshing = asyncio.ensure_future(self.refresh())

    async def refresh(self) -> None:
        """Re-read each shard's serving replicas from its primary (a primary that does not answer: unchanged)."""
        got = await asyncio.gather(
            *(call_within(p.replicas.remote(True), self.timeout_s) for p in self.primaries), return_exceptions=True
        )
        for s, reps in enumerate(got):
            if not isinstance(reps, BaseException):
                self.replicas[s] = list(reps)
