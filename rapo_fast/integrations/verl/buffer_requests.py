"""The checks a request to the verl step buffer passes before it joins a shared search, and `Coalescer`, which serves
the requests of a short window with one call (the actor's searches, the client's encodings and remote calls).

Rule: a value that could fail or misbehave inside a search shared by several callers (NaN/inf thresholds, ids past
int64, text no encoder can encode) is refused here, naming the caller's argument and entry; a request that still fails
inside a shared call fails alone. What this is not: the actor or client (buffer_actor.py), or the buffer's own checks.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rapo_fast._checks import INT64_MAX, INT64_MIN, brief, check_float, check_int_list, check_str_list

__all__ = ["Coalescer", "LocalHandle", "check_groups", "check_histories", "check_scores", "settle"]


def check_histories(histories: Any, who: str, name: str = "histories") -> list[str]:
    """A list of str, each encodable as UTF-8 (a lone surrogate would fail in the encoder or the tokenizer, inside a
    shared search: it is refused here, naming the caller's entry)."""
    histories = check_str_list(f"{who}: {name}", histories)
    for i, h in enumerate(histories):
        try:
            h.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{who}: {name}[{i}]: expected valid Unicode, got {exc.reason} at {exc.start}") from None
    return histories


def check_groups(groups: Any, n: int, name: str, who: str, lo: int = INT64_MIN) -> list[int]:
    """`n` ints in [lo, 2^63 - 1] (the int64 the buffer stores them in; bool refused)."""
    return check_int_list(f"{who}: {name}", groups, n, lo=lo, hi=INT64_MAX)


def check_scores(scores: Any, n: int) -> list[float] | None:
    if scores is None:
        return None
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence) or len(scores) != n:
        raise ValueError(f"add_steps: scores: expected None or a list of {n} floats, got {brief(scores)}")
    return [check_float(f"add_steps: scores[{i}]", s) for i, s in enumerate(scores)]


def settle(fut: asyncio.Future, row: Any = None, exc: BaseException | None = None) -> None:
    """Hand a caller its rows or its error, unless it has gone (a cancelled caller)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(row)


class Coalescer:
    """Requests submitted within `window_s` of the first pending one are served together: `serve(payloads)` gets the
    payloads of requests with one `key` (e.g. a min_score: one search takes one threshold), at most `max_rows` rows in
    all, and returns one result per payload. A served call that raises is retried request by request, so only the
    failing caller gets the error; a cancelled caller is not served. One drain task runs per event loop at a time.
    `pending` is how many requests wait for a call now, `take_peak()` the most that waited at once since it was last
    taken (the actor's queue length in verl's metrics)."""

    def __init__(self, serve: Callable[[list[Any]], Awaitable[list[Any]]], window_s: float, max_rows: int):
        self.serve, self.window_s, self.max_rows = serve, window_s, max_rows
        self._pending: list[tuple[Any, int, Any, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._peak = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take_peak(self) -> int:
        peak, self._peak = self._peak, len(self._pending)
        return peak

    async def submit(self, payload: Any, rows: int, key: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((payload, rows, key, fut))
        self._peak = max(self._peak, len(self._pending))
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        return await fut

    def _take_batch(self) -> list[tuple[Any, int, Any, asyncio.Future]]:
        """The first pending request and the others of its key, up to max_rows rows. The first is always taken
        (whatever its key compares as), so every call removes at least one request."""
        first = self._pending[0]
        batch, rest, n = [first], [], first[1]
        for req in self._pending[1:]:
            if req[2] == first[2] and n + req[1] <= self.max_rows:
                batch.append(req)
                n += req[1]
            else:
                rest.append(req)
        self._pending = rest
        return batch

    async def _drain(self) -> None:
        """Serve the queue until it is empty; each pass settles every request it took, so it never spins."""
        while self._pending:
            if self.window_s > 0:  # let concurrent callers join this call
                await asyncio.sleep(self.window_s)
            batch = [req for req in self._take_batch() if not req[3].done()]
            if not batch:
                continue
            try:
                results = await self.serve([req[0] for req in batch])
            except Exception as exc:
                if len(batch) == 1:
                    settle(batch[0][3], exc=exc)
                    continue
                for req in batch:  # one caller's request may be what failed: each alone
                    try:
                        (one,) = await self.serve([req[0]])
                    except Exception as one_exc:
                        settle(req[3], exc=one_exc)
                    else:
                        settle(req[3], one)
                continue
            for req, res in zip(batch, results):
                settle(req[3], res)


_KILLED: weakref.WeakSet = weakref.WeakSet()


class LocalHandle:
    """An in-process stand-in for a Ray actor handle: `handle.method.remote(*args)` is a task running
    `actor.method(*args)` on the caller's event loop, so a StepBufferClient can serve from StepBufferActors without
    Ray (tests, benchmarks, one-process jobs). Only the async methods: the client's sync save/load/stats need Ray.
    `kill()`: from then on every call to the actor, through any of its handles, fails as a dead actor's would
    (ConnectionAbortedError: buffer_replicas.gone)."""

    def __init__(self, actor: Any):
        self._actor = actor

    def kill(self) -> None:
        _KILLED.add(self._actor)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._actor, name)

        async def call(*a: Any, **k: Any) -> Any:
            if self._actor in _KILLED:
                raise ConnectionAbortedError(f"{name}: the actor behind this LocalHandle was killed")
            return await method(*a, **k)

        return _Remote(lambda *a, **k: asyncio.ensure_future(call(*a, **k)))


class _Remote:
    def __init__(self, call: Callable[..., asyncio.Future]):
        self.remote = call
