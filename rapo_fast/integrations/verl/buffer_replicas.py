"""Read replicas of the verl step buffer: where they are placed, the order they apply their primary's writes in, and
which actor a client's search goes to.

What this is: `InOrder`, `check_replicas_per_node`, `replica_nodes` / `on_node` and `Readers`. The design and its
limits: docs/verl.md section 4, "Read replicas".
What it is not: the actor or the client (buffer_actor.py), which use these. Importing it imports no ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rapo_fast._checks import check_int

__all__ = ["InOrder", "Readers", "check_replicas_per_node", "on_node", "replica_nodes"]


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


class InOrder:
    """Lets operation `seq` through once 0 .. seq - 1 have been through. The primary numbers its writes in the order
    its one worker thread takes them; Ray does not promise that an async actor starts calls in the order they were
    sent, and two writes applied in different orders leave different FIFO rings."""

    def __init__(self) -> None:
        self.next = 0
        self._waiting: dict[int, asyncio.Future] = {}

    async def wait(self, seq: int) -> None:
        if seq < self.next or seq in self._waiting:
            raise ValueError(f"replica: operation {seq} was already delivered (next expected: {self.next})")
        if seq != self.next:
            self._waiting[seq] = asyncio.get_running_loop().create_future()
            await self._waiting[seq]

    def advance(self) -> None:
        """The current operation is queued: let the next one through."""
        self.next += 1
        fut = self._waiting.pop(self.next, None)
        if fut is not None and not fut.done():
            fut.set_result(None)


class Readers:
    """The actor each shard's search goes to: per call, the next of the shard's replicas on the caller's node; any of
    its replicas when that node has none (a node that joined after they were made); the primary when it has none."""

    def __init__(self, primaries: Sequence[Any], replicas: Sequence[Sequence[tuple[str, Any]]]):
        self.primaries, self.replicas = list(primaries), [list(r) for r in replicas]
        self._choices: list[list[Any]] | None = None
        self._turn = 0

    def pick(self) -> list[Any]:
        if self._choices is None:  # on first use: a client is built on one node and unpickled on another
            node = _this_node()
            self._choices = [
                [h for n, h in reps if n == node] or [h for _, h in reps] or [primary]
                for primary, reps in zip(self.primaries, self.replicas)
            ]
        self._turn += 1
        return [hs[self._turn % len(hs)] for hs in self._choices]
