"""The RAPO step buffer served by Ray actors to verl's agent-loop workers, saved and restored with verl's checkpoints.

What this is: `StepBufferActor`, `get_or_create_step_buffer` / `get_step_buffer` (the actors, their replicas and a
StepBufferClient over them) and `build_step_buffer_from_jsonl` (the one-time build; its command line and config keys
are in buffer_setup.py). Batching, sharding, replicas and the save layout: docs/verl.md section 4.
What it is not: the nearest-neighbour search (rapo_fast.retrieval.buffer), the agent loop that inserts the steps
(agent_loop.py), or an approximate index. Importing it imports neither ray nor verl.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rapo_fast._atomic import VersionWriter, read_version
from rapo_fast._checks import check_field, check_int, check_min_score
from rapo_fast.integrations.verl.buffer_client import (
    SAVE_FORMAT,
    SAVE_PREFIX,
    SAVE_VERSION,
    StepBufferClient,
    StepBufferSaveError,
    is_bare_traces,
)
from rapo_fast.integrations.verl.buffer_replicas import InOrder, check_replicas_per_node, on_node, replica_nodes
from rapo_fast.integrations.verl.buffer_requests import (
    Coalescer,
    check_groups,
    check_histories,
    check_scores,
)
from rapo_fast.retrieval.encoders import make_encoder
from rapo_fast.retrieval.jsonl import read_jsonl, write_jsonl
from rapo_fast.retrieval.step_traces import StepTraces

__all__ = [
    "StepBufferActor",
    "StepBufferReplicaError",
    "get_or_create_step_buffer",
    "get_step_buffer",
    "build_step_buffer_from_jsonl",
    "register",
]

DEFAULT_NAME = "rapo_step_buffer"
CHECKPOINT_SUBDIR = "rapo_step_buffer"  # inside verl's global_step_N/


class StepBufferReplicaError(RuntimeError):
    """A write was sent to a read replica, or a replica failed or stored otherwise than its primary."""


def register() -> None:
    """Nothing to register into verl's registries: the buffer is an actor, the checkpoint hook a config key
    (`trainer.checkpoint_callback_class`). Kept so that plugin.py can treat every part alike; idempotent."""


class _NoSpecialsTokenizer:
    """A HF tokenizer whose encode adds no BOS/EOS: a retrieved segment is inserted mid-sequence."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


def _load_tokenizer(spec: Any, trust_remote_code: bool = False) -> Any:
    if isinstance(spec, (str, os.PathLike)):
        return _NoSpecialsTokenizer(str(spec), trust_remote_code)
    if not callable(getattr(spec, "encode", None)):
        raise TypeError(f"tokenizer: expected a HF tokenizer path or an object with encode(text), got {spec!r}")
    return spec


def _build_shard(
    jsonl: str | Path, tokenizer: Any, encoder: Callable, shard: int, num_shards: int, device: str, **build: Any
) -> StepTraces:
    """StepTraces.from_jsonl over the records with query_id % num_shards == shard (a query's records stay together,
    so the per-query top-K is the same as unsharded). A given capacity is split evenly between the shards."""
    cap = build.pop("capacity", None)
    if cap is not None and num_shards > 1:
        cap = max(1, math.ceil(cap / num_shards))
    if num_shards == 1:
        return StepTraces.from_jsonl(jsonl, encoder, tokenizer, capacity=cap, device=device, **build)
    recs = [r for r in read_jsonl(jsonl) if int(r["query_id"]) % num_shards == shard]
    with tempfile.TemporaryDirectory() as tmp:
        part = write_jsonl(recs, Path(tmp) / "shard.jsonl")
        return StepTraces.from_jsonl(part, encoder, tokenizer, capacity=cap, device=device, **build)


class StepBufferActor:
    """One shard of the step buffer (made a Ray actor by `get_or_create_step_buffer`; usable in-process too).

    Args: source (a .jsonl of off-policy traces, a directory saved by StepTraces.save, or None for an empty buffer of
    `capacity`), tokenizer (HF path or an object with encode), encoder (see make_encoder: it encodes a JSONL source;
    the clients make the same one from `encoder_spec()` and send keys), shard / num_shards (which part of a JSONL this
    shard keeps), window_s (how long a search waits for more requests), max_batch (most queries per search), replica
    (a read replica: built from its primary's source, it takes writes only as `replay` from the primary), build
    (top_k, capacity, metric, eviction, dtype: StepTraces.from_jsonl's options).
    """

    def __init__(
        self,
        source: str | None,
        tokenizer: Any,
        encoder: str | Callable = "hashed",
        *,
        shard: int = 0,
        num_shards: int = 1,
        window_s: float = 0.002,
        max_batch: int = 4096,
        trust_remote_code: bool = False,
        replica: bool = False,
        **build: Any,
    ):
        self.device = "cuda" if _gpu_ids() else "cpu"
        self._encoder_spec = encoder
        self.encoder = make_encoder(encoder, self.device)
        self.tokenizer = _load_tokenizer(tokenizer, trust_remote_code)
        self.shard, self.num_shards, self.window_s, self.max_batch = shard, num_shards, window_s, max_batch
        if isinstance(build.get("dtype"), str):  # from a YAML config: "float32", "float16", "bfloat16"
            build["dtype"] = getattr(torch, build["dtype"])
        if source is None:
            from rapo_fast.retrieval.buffer import StepBuffer

            if build.get("capacity") is None:
                raise ValueError("StepBufferActor: capacity: expected an int (source=None: an empty buffer), got None")
            dim = int(getattr(self.encoder, "dim", 0)) or int(self.encoder(["probe"]).shape[-1])
            b = {k: build[k] for k in ("metric", "eviction", "dtype") if k in build}
            buf = StepBuffer(
                build["capacity"], dim, device=self.device, **{"metric": "cosine", "dtype": torch.float32, **b}
            )
            self.traces = StepTraces(buf, self.encoder, self.tokenizer)
        elif str(source).endswith(".jsonl"):
            self.traces = _build_shard(source, self.tokenizer, self.encoder, shard, num_shards, self.device, **build)
        else:
            self.traces = self._load_traces(source)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rapo-step-buffer")
        self._searches = Coalescer(self._serve, window_s, max_batch)
        names = ("requests", "queries", "search_calls", "add_calls", "steps_added", "steps_dropped")
        self.counters = dict.fromkeys(names, 0)
        self._window = _new_window()
        self.replica = bool(replica)
        self._replicas: list[tuple[str, Any]] = []  # a primary's (node id, handle): where its writes are replayed
        self._next_write = 0  # a primary's: the sequence number of its next add or load
        self._in_order = InOrder()  # a replica's: its primary's writes, applied by sequence number

    def _load_traces(self, path: str) -> StepTraces:
        traces = StepTraces.load(path, self.encoder, self.tokenizer)
        if self.device != "cpu":  # StepTraces.load builds the buffer on the CPU: move it through its own save/load
            from rapo_fast.retrieval.buffer import StepBuffer

            with tempfile.TemporaryDirectory() as tmp:
                traces.buffer.save(tmp)
                traces.buffer = StepBuffer.load(tmp, device=self.device)
            traces.pin_offpolicy_steps()  # pins are not part of a buffer snapshot: the off-policy source's again
        return traces

    async def ready(self) -> int:
        """The shard count (also: the constructor finished, or its error is raised here)."""
        return self.num_shards

    async def stats(self) -> dict:
        """The counters (cumulative), and since the previous stats() call (verl's metrics route calls it once a step):
        step_queries (queries searched), search_ms_sum / search_ms_max (over those queries, the duration of the search
        that answered each: one search answers a batch), pending_max (most retrieve requests waiting for a search at
        once); pending: those waiting now. role: "primary" or "replica"."""
        window, self._window = self._window, _new_window()
        queue = {"pending": self._searches.pending, "pending_max": self._searches.take_peak()}
        state = {"size": len(self.traces.buffer), "payloads": len(self.traces), "device": self.device}
        return {**self.counters, **window, **queue, **state, "role": "replica" if self.replica else "primary"}

    async def attach_replicas(self, replicas: list[tuple[str, Any]]) -> None:
        """(node id, handle) of this primary's replicas, built from its source: from now on every add and load is
        replayed on them in this actor's order. Before the first write only (they must hold this state)."""
        if self.replica or self._next_write:
            raise StepBufferReplicaError("attach_replicas: a primary's replicas are attached before its first write")
        self._replicas = list(replicas)

    async def replicas(self) -> list[tuple[str, Any]]:
        return list(self._replicas)

    async def encoder_spec(self) -> str | Callable:
        """The encoder this buffer's keys were made with, as given (a make_encoder spec or a callable): the clients
        encode their histories with it."""
        return self._encoder_spec

    async def retrieve(
        self, keys: torch.Tensor, exclude_groups: list[int] | None = None, min_score: float | None = None
    ) -> tuple[list[list[int] | None], list[int], list[float]]:
        """Top-1 step per key (segment token ids or None, local payload id or -1, score or -inf). keys: [Q, D] fp32,
        the histories encoded by the caller (StepBufferClient.encode).

        Every argument is checked here, before the request joins a shared search: keys (a float tensor [Q, D] of the
        buffer's dim, finite), exclude_groups (ints in int64's range; negative: exclude nothing), min_score (None or
        finite). A request that still fails inside a search fails alone (Coalescer), so the other callers get their
        rows."""
        keys = self.traces.check_keys(keys, name="retrieve: keys")
        n = len(keys)
        excl = [-1] * n if exclude_groups is None else check_groups(exclude_groups, n, "exclude_groups", "retrieve")
        min_score = check_min_score("retrieve: min_score", min_score)
        self.counters["requests"] += 1
        return await self._searches.submit((keys, excl, min_score), n, min_score)

    async def _serve(self, batch: list) -> list:
        out, seconds = await asyncio.get_running_loop().run_in_executor(self._pool, self._search, batch)
        q, ms, w = sum(len(req[0]) for req in batch), 1000.0 * seconds, self._window
        self.counters["search_calls"] += 1  # counted on the event loop: stats() reads and resets them there
        self.counters["queries"] += q
        w["step_queries"] += q
        w["search_ms_sum"] += ms * q
        w["search_ms_max"] = max(w["search_ms_max"], ms)
        return out

    def _search(self, batch: list) -> tuple[list[tuple[list, list[int], list[float]]], float]:
        keys = torch.cat([req[0] for req in batch])
        excl = [g for req in batch for g in req[1]]
        t0 = time.perf_counter()
        segs, pids, scores = self.traces.search(keys, excl, batch[0][2])
        seconds = time.perf_counter() - t0
        pids, scores = pids.tolist(), scores.tolist()
        out, i = [], 0
        for req in batch:
            j = i + len(req[0])
            out.append((segs[i:j], pids[i:j], scores[i:j]))
            i = j
        return out, seconds

    async def add_steps(
        self, keys: torch.Tensor, steps: list[str], group_ids: list[int], scores: list[float] | None = None
    ) -> int:
        """The policy's own steps under their prompts' group ids (StepTraces.add_encoded; keys: their histories
        encoded by the caller); returns how many the buffer stored (a buffer whose every slot holds a pinned
        off-policy step drops new ones: counted in steps_dropped). group_ids in [0, 2^63 - 1], scores None or finite;
        a refused call changes nothing. Returns once the replicas stored it too."""
        self._refuse_on_replica("add_steps")
        steps = check_histories(steps, "add_steps", "steps")
        keys = self.traces.check_keys(keys, len(steps), "add_steps: keys")
        group_ids = check_groups(group_ids, len(steps), "group_ids", "add_steps", lo=0)
        scores = check_scores(scores, len(steps))
        return await self._write("add", keys, steps, group_ids, scores)

    async def save(self, path: str) -> None:
        """StepTraces.save (atomic, versioned) on the thread that adds, so never beside an add. A primary's only: its
        replicas hold the same state."""
        self._refuse_on_replica("save")
        await asyncio.get_running_loop().run_in_executor(self._pool, self.traces.save, path)

    async def load(self, path: str) -> None:
        """Replace the state by a save (its replicas load it too, at the same point of the write order)."""
        self._refuse_on_replica("load")
        await self._write("load", path)

    async def replay(self, seq: int, op: str, *args: Any) -> Any:
        """A replica's: its primary's write number `seq` (checked there), applied after writes 0 .. seq - 1."""
        if not self.replica:
            raise StepBufferReplicaError("replay: only a replica replays its primary's writes")
        await self._in_order.wait(seq)
        try:
            fut = self._pool.submit(self._apply, op, args)  # the one worker thread keeps the submission order
        finally:
            self._in_order.advance()
        return self._count(op, args, await asyncio.wrap_future(fut))

    def _refuse_on_replica(self, what: str) -> None:
        if self.replica:
            raise StepBufferReplicaError(f"{what}: this actor is a read replica; writes and saves go to its primary")

    async def _write(self, op: str, *args: Any) -> Any:
        """Apply an add or load here and replay it on every replica. Its number is taken and its work queued on the
        one worker thread with no await between, so the numbers follow the order this actor applies its writes in."""
        seq, self._next_write = self._next_write, self._next_write + 1
        here = asyncio.wrap_future(self._pool.submit(self._apply, op, args))
        there = [h.replay.remote(seq, op, *args) for _, h in self._replicas]
        out, *theirs = await asyncio.gather(here, *there, return_exceptions=True)
        if isinstance(out, BaseException):
            raise out
        out = self._count(op, args, out)
        for (node, _), got in zip(self._replicas, theirs):
            if isinstance(got, BaseException):
                raise StepBufferReplicaError(f"{op}: the replica on node {node} failed: {got!r}") from got
            if got != out:
                raise StepBufferReplicaError(f"{op}: the replica on node {node} returned {got!r}, the primary {out!r}")
        return out

    def _apply(self, op: str, args: tuple) -> Any:
        """One write on the worker thread: an add (returns the steps stored) or a load."""
        if op == "add":
            _, slots = self.traces.add_encoded(*args, return_slots=True)
            return int((slots >= 0).sum())
        if op == "load":
            self.traces = self._load_traces(args[0])
            return None
        raise ValueError(f"StepBufferActor: op: expected a known write, got {op!r}")

    def _count(self, op: str, args: tuple, stored: Any) -> Any:
        if op == "add":
            self.counters["add_calls"] += 1
            self.counters["steps_added"] += stored
            self.counters["steps_dropped"] += len(args[1]) - stored
        return stored


def _new_window() -> dict:
    return {"step_queries": 0, "search_ms_sum": 0.0, "search_ms_max": 0.0}


def _gpu_ids() -> list:
    try:
        import ray

        return ray.get_gpu_ids() if ray.is_initialized() else []
    except ImportError:
        return []


def _shard_name(name: str, i: int) -> str:
    return name if i == 0 else f"{name}.{i}"


def get_step_buffer(name: str = DEFAULT_NAME, namespace: str | None = None) -> StepBufferClient:
    """A client for the existing actor(s) `name` (ValueError when there is none)."""
    import ray

    first = ray.get_actor(name, namespace=namespace)
    n, encoder = ray.get([first.ready.remote(), first.encoder_spec.remote()])
    handles = [first] + [ray.get_actor(_shard_name(name, i), namespace=namespace) for i in range(1, n)]
    return StepBufferClient(handles, encoder, replicas=ray.get([h.replicas.remote() for h in handles]))


def get_or_create_step_buffer(
    name: str = DEFAULT_NAME,
    source: str | os.PathLike | None = None,
    *,
    tokenizer: Any = None,
    encoder: str | Callable = "hashed",
    num_shards: int = 1,
    replicas_per_node: int = 0,
    num_cpus: float = 1,
    num_gpus: float = 0,
    lifetime: str | None = None,
    namespace: str | None = None,
    ready_timeout_s: float | None = 600.0,
    **options: Any,
) -> StepBufferClient:
    """The named buffer of this job, created when missing (an existing actor keeps its state; the arguments are then
    ignored). source: a .jsonl of off-policy traces, a directory saved by `StepBufferClient.save` /
    `build_step_buffer_from_jsonl` / StepTraces.save, or None (empty; needs capacity=). The creating process owns the
    actors (they die with it unless lifetime="detached"): create them from the driver, e.g. through the checkpoint
    callback. num_cpus / num_gpus are held for the actor's lifetime; num_gpus > 0 puts each shard's StepBuffer on CUDA.
    replicas_per_node: read replicas of every shard on each alive node with CPUs (0: none; each holds what its
    primary holds, with the same num_cpus / num_gpus; the clients search there). ready_timeout_s: how long to wait
    for the actors to be placed and built (then ray's GetTimeoutError).
    options: window_s, max_batch, trust_remote_code, top_k, capacity, metric, eviction, dtype."""
    import ray

    with contextlib.suppress(ValueError):
        return get_step_buffer(name, namespace)
    num_shards = check_int("get_or_create_step_buffer: num_shards", num_shards, lo=1)
    replicas_per_node = check_replicas_per_node(replicas_per_node)
    if tokenizer is None:
        raise ValueError(f"get_or_create_step_buffer: tokenizer: expected one (no actor {name!r} yet), got None")
    actor_cls = ray.remote(StepBufferActor)
    opts = {"num_cpus": num_cpus, "num_gpus": num_gpus, "get_if_exists": True, "lifetime": lifetime}
    opts = {**opts, "namespace": namespace, "max_concurrency": 1000}
    src = None if source is None else Path(source)
    nodes = replica_nodes() if replicas_per_node else []

    def create(paths: list[str | None]) -> StepBufferClient:
        def actor(i: int, path: str | None, replica: str = "", **placement: Any) -> Any:
            return actor_cls.options(name=_shard_name(name, i) + replica, **opts, **placement).remote(
                path, tokenizer, encoder, shard=i, num_shards=num_shards, replica=bool(replica), **options
            )

        handles = [actor(i, p) for i, p in enumerate(paths)]
        replicas = [
            [
                (node, actor(i, p, f".replica.{node}.{k}", scheduling_strategy=on_node(node)))
                for node in nodes
                for k in range(replicas_per_node)
            ]
            for i, p in enumerate(paths)
        ]
        every = handles + [h for reps in replicas for _, h in reps]
        ray.get([h.ready.remote() for h in every], timeout=ready_timeout_s)  # a failed constructor raises here
        ray.get([h.attach_replicas.remote(reps) for h, reps in zip(handles, replicas)])
        return StepBufferClient(handles, encoder, replicas=replicas)

    if src is not None and not src.exists():
        raise ValueError(f"get_or_create_step_buffer: source: expected a .jsonl file or saved buffer, got {str(src)!r}")
    if src is None or str(src).endswith(".jsonl") or is_bare_traces(src):
        if src is not None and is_bare_traces(src) and num_shards != 1:
            raise ValueError(f"get_or_create_step_buffer: num_shards: expected 1 ({src}: one shard), got {num_shards}")
        return create([None if src is None else str(src)] * num_shards)
    with read_version(src, SAVE_PREFIX, SAVE_FORMAT, SAVE_VERSION, StepBufferSaveError) as v:
        n = check_field(v.meta, "num_shards", v.path / "meta.json", StepBufferSaveError, check_int, lo=1)
        if n != num_shards:
            raise ValueError(f"get_or_create_step_buffer: num_shards: expected {n} ({src}'s shards), got {num_shards}")
        return create([str(v.path / f"shard_{i}") for i in range(n)])


def build_step_buffer_from_jsonl(
    jsonl: str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer: Any,
    *,
    encoder: str | Callable = "hashed",
    num_shards: int = 1,
    trust_remote_code: bool = False,
    **build: Any,
) -> Path:
    """One-time build, in this process (no Ray): read off-policy traces, keep the top-K per query, encode and save
    `num_shards` StepTraces (shard i: the queries with query_id % num_shards == i) in the layout `get_or_create_
    step_buffer(source=out_dir)` and `StepBufferClient.load` read. build: top_k, capacity, metric, eviction, dtype.
    The encoder is not saved: the actors must be given the same one. Returns out_dir."""
    num_shards = check_int("build_step_buffer_from_jsonl: num_shards", num_shards, lo=1)
    if not Path(jsonl).is_file():
        raise ValueError(f"build_step_buffer_from_jsonl: jsonl: expected an existing file, got {str(jsonl)!r}")
    enc, tok = make_encoder(encoder), _load_tokenizer(tokenizer, trust_remote_code)
    with VersionWriter(out_dir, SAVE_PREFIX, SAVE_FORMAT, SAVE_VERSION) as w:
        sizes = []
        for i in range(num_shards):
            traces = _build_shard(jsonl, tok, enc, i, num_shards, "cpu", **build)
            traces.save(w.path / f"shard_{i}")
            w.add_nested(f"shard_{i}")
            sizes.append(len(traces))
        w.commit({"num_shards": num_shards, "steps_per_shard": sizes})
    return Path(out_dir)
