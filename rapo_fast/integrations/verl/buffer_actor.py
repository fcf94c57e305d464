"""The RAPO step buffer served by Ray actors to verl's agent-loop workers, saved and restored with verl's checkpoints.

What this is: `StepBufferActor`, `get_or_create_step_buffer` / `get_step_buffer` (the actors, their replicas and a
StepBufferClient over them) and `build_step_buffer_from_jsonl` (the one-time build; its command line and config keys
are in buffer_setup.py). Batching, sharding, replicas and the save layout: docs/verl.md section 4.
What it is not: the nearest-neighbour search (rapo_fast.retrieval.buffer), the agent loop that inserts the steps
(agent_loop.py), or an approximate index. Importing it imports neither ray nor verl.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
import os
import sys
import tempfile
import time
import uuid
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
from rapo_fast.integrations.verl.buffer_replicas import (
    StepBufferReplicaError,
    StepBufferStaleError,
    check_replicas_per_node,
    keep_owned,
    on_node,
    replica_nodes,
)
from rapo_fast.integrations.verl.buffer_requests import (
    Coalescer,
    check_groups,
    check_histories,
    check_scores,
)
from rapo_fast.integrations.verl.buffer_sync import InOrder, PrimaryRole, ReplicaRole, ReplicaSet
from rapo_fast.retrieval.encoders import make_encoder
from rapo_fast.retrieval.jsonl import read_jsonl, write_jsonl
from rapo_fast.retrieval.step_traces import StepTraces

__all__ = [
    "StepBufferActor",
    "StepBufferReplicaError",
    "StepBufferStaleError",
    "get_or_create_step_buffer",
    "place_replicas",
    "get_step_buffer",
    "build_step_buffer_from_jsonl",
    "register",
]

DEFAULT_NAME = "rapo_step_buffer"
CHECKPOINT_SUBDIR = "rapo_step_buffer"  # inside verl's global_step_N/


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


class StepBufferActor(PrimaryRole, ReplicaRole):
    """One shard of the step buffer (made a Ray actor by `get_or_create_step_buffer`; usable in-process too).

    Args: source (a .jsonl of off-policy traces, a directory saved by StepTraces.save, or None for an empty buffer of
    `capacity`), tokenizer (HF path or an object with encode), encoder (see make_encoder: it encodes a JSONL source;
    the clients make the same one from `encoder_spec()` and send keys), shard / num_shards (which part of a JSONL this
    shard keeps), window_s (how long a search waits for more requests), max_batch (most queries per search), replica
    (a read replica: built from its primary's source, it takes writes only as `replay` from the primary and serves
    searches only while in step with it), replica_timeout_s (a primary's: how long a replica may take to answer before
    it is marked stale), log_writes (a primary's: recent writes kept to catch a stale replica up without a snapshot),
    build (top_k, capacity, metric, eviction, dtype: StepTraces.from_jsonl's options).
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
        replica_timeout_s: float = 30.0,
        log_writes: int = 256,
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
        names = ("requests", "queries", "search_calls", "add_calls", "steps_added", "steps_dropped", "repeated_adds")
        self.counters = dict.fromkeys(names, 0)
        self._window = _new_window()
        self.replica = bool(replica)
        # a primary's: its replicas and write log, the number of its next add or load, its recent adds' write ids
        self._set = ReplicaSet(self._snapshot, replica_timeout_s, log_writes)
        self._next_write = 0
        self._done: collections.OrderedDict[str, asyncio.Task] = collections.OrderedDict()
        self._spec: dict | None = None  # how its replicas were made (place_replicas makes more alike)
        # a replica's: its primary's writes applied by sequence number; serving only when told it is in step
        self._in_order, self._incarnation = InOrder(), uuid.uuid4().hex
        self._serving = self._broken = False

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
        once); pending: those waiting now. role: "primary" or "replica"; node: its Ray node. A primary's:
        replicas_stale (not in step now), replicas_lost, replica_resyncs, replica_write_failures, read_failovers
        (reported by clients), repeated_adds (write ids seen before); a replica's: replicas_serving (1 or 0)."""
        window, self._window = self._window, _new_window()
        queue = {"pending": self._searches.pending, "pending_max": self._searches.take_peak()}
        state = {"size": len(self.traces.buffer), "payloads": len(self.traces), "device": self.device}
        state["node"] = _node_id()
        role = {"role": "replica", "replicas_serving": int(self._readable())} if self.replica else self._set.stats()
        return {**self.counters, **window, **queue, **state, **({"role": "primary"} | role)}

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
        self._check_readable()
        out = await self._searches.submit((keys, excl, min_score), n, min_score)
        self._check_readable()  # told to stop while it searched: the caller asks another copy
        return out

    def _readable(self) -> bool:
        return not self.replica or (self._serving and not self._broken)

    def _check_readable(self) -> None:
        if not self._readable():
            raise StepBufferStaleError("retrieve: this replica is not in step with its primary; ask another copy")

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
        self,
        keys: torch.Tensor,
        steps: list[str],
        group_ids: list[int],
        scores: list[float] | None = None,
        write_id: str | None = None,
    ) -> int:
        """The policy's own steps under their prompts' group ids (StepTraces.add_encoded; keys: their histories
        encoded by the caller); returns how many the buffer stored (a buffer whose every slot holds a pinned
        off-policy step drops new ones: counted in steps_dropped). group_ids in [0, 2^63 - 1], scores None or finite;
        a refused call changes nothing. Returns once every live replica stored it too (one that did not is stale:
        it serves nothing until it has caught up). write_id: a repeat of a recent add with this id (a retry) stores
        nothing again and returns the first one's result."""
        self._refuse_on_replica("add_steps")
        if write_id is not None and write_id in self._done:
            self.counters["repeated_adds"] += 1
            return await asyncio.shield(self._done[write_id])
        steps = check_histories(steps, "add_steps", "steps")
        keys = self.traces.check_keys(keys, len(steps), "add_steps: keys")
        group_ids = check_groups(group_ids, len(steps), "group_ids", "add_steps", lo=0)
        scores = check_scores(scores, len(steps))
        return await asyncio.shield(self._remember(write_id, self._write("add", keys, steps, group_ids, scores)))

    async def save(self, path: str) -> None:
        """StepTraces.save (atomic, versioned) on the thread that adds, so never beside an add. A primary's only: its
        replicas hold the same state."""
        self._refuse_on_replica("save")
        await asyncio.get_running_loop().run_in_executor(self._pool, self.traces.save, path)

    async def load(self, path: str) -> None:
        """Replace the state by a save (its replicas load it too, at the same point of the write order)."""
        self._refuse_on_replica("load")
        await asyncio.shield(self._write("load", path))

    def _apply(self, op: str, args: tuple) -> Any:
        """One write on the worker thread; returns its fingerprint (a replica's must equal its primary's): an add's
        (steps stored, buffer size, slots), a load's (buffer size, payloads)."""
        if op == "add":
            _, slots = self.traces.add_encoded(*args, return_slots=True)
            return int((slots >= 0).sum()), len(self.traces.buffer), tuple(slots.tolist())
        if op == "load":
            self.traces = self._load_traces(args[0])
            return len(self.traces.buffer), len(self.traces)
        if op == "skip":  # a write its primary failed
            return "skip"
        raise ValueError(f"StepBufferActor: op: expected a known write, got {op!r}")

    def _count(self, op: str, args: tuple, out: Any) -> Any:
        if op == "add":
            self.counters["add_calls"] += 1
            self.counters["steps_added"] += out[0]
            self.counters["steps_dropped"] += len(args[1]) - out[0]
            return out[0]
        return None


def _new_window() -> dict:
    return {"step_queries": 0, "search_ms_sum": 0.0, "search_ms_max": 0.0}


def _node_id() -> str | None:
    """The Ray node this actor runs on (None in-process)."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None


def _gpu_ids() -> list:
    try:
        import ray

        return ray.get_gpu_ids() if ray.is_initialized() else []
    except ImportError:
        return []


def _shard_name(name: str, i: int) -> str:
    return name if i == 0 else f"{name}.{i}"


def get_step_buffer(name: str = DEFAULT_NAME, namespace: str | None = None, **client: Any) -> StepBufferClient:
    """A client for the existing actor(s) `name` (ValueError when there is none), over the replicas serving now.
    client: StepBufferClient's options (window_s, max_batch, timeout_s, refresh_s)."""
    import ray

    first = ray.get_actor(name, namespace=namespace)
    n, encoder = ray.get([first.ready.remote(), first.encoder_spec.remote()])
    handles = [first] + [ray.get_actor(_shard_name(name, i), namespace=namespace) for i in range(1, n)]
    return StepBufferClient(handles, encoder, replicas=ray.get([h.replicas.remote(True) for h in handles]), **client)


def _new_replica(spec: dict, node: str, suffix: str) -> Any:
    """A replica of the shard `spec` describes (replica_spec()), pinned to `node`; Ray restarts a crashed one (on
    that node), which its primary then catches up."""
    import ray

    opts = {**spec["opts"], "name": f"{spec['name']}.replica.{node}.{suffix}", "scheduling_strategy": on_node(node)}
    return ray.remote(StepBufferActor).options(**opts, max_restarts=2).remote(*spec["args"], **spec["kwargs"])


def place_replicas(name: str = DEFAULT_NAME, namespace: str | None = None, ready_timeout_s: float = 600.0) -> int:
    """Make the replicas each alive node lacks (a node that joined, one whose replicas died): `replicas_per_node` of
    every shard per node, made as get_or_create_step_buffer made the first ones (from the same source), then caught
    up by their primary in the background before they serve (clients find them within their refresh_s). Call it from
    the process that owns the buffer (the driver). Returns how many it made."""
    import ray

    client = get_step_buffer(name, namespace)
    made = []
    for primary, spec, reps in zip(
        client.handles,
        ray.get([h.replica_spec.remote() for h in client.handles]),
        ray.get([h.replicas.remote() for h in client.handles]),
    ):
        if not spec:
            continue
        have = [n for n, _ in reps]
        for node in replica_nodes():
            for _ in range(spec["per_node"] - have.count(node)):
                made.append((primary, node, _new_replica(spec, node, uuid.uuid4().hex[:8])))
    keep_owned(name, namespace, [h for _, _, h in made], more=True)
    ray.get([h.ready.remote() for _, _, h in made], timeout=ready_timeout_s)
    ray.get([p.add_replica.remote(node, h) for p, node, h in made])
    return len(made)


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
    callback; they outlive the returned client (get_step_buffer(name) finds them). num_cpus / num_gpus are held for
    the actor's lifetime; num_gpus > 0 puts each shard's StepBuffer on CUDA.
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
        def spec(i: int, path: str | None) -> dict:  # how shard i's replicas are made (place_replicas: more alike)
            kwargs = {**options, "shard": i, "num_shards": num_shards, "replica": True}
            args = (path, tokenizer, encoder)
            return {
                "name": _shard_name(name, i),
                "opts": opts,
                "per_node": replicas_per_node,
                "args": args,
                "kwargs": kwargs,
            }

        def primary(i: int, path: str | None) -> Any:
            kw = {**options, "shard": i, "num_shards": num_shards}
            return actor_cls.options(name=_shard_name(name, i), **opts).remote(path, tokenizer, encoder, **kw)

        specs = [spec(i, p) for i, p in enumerate(paths)]
        handles = [primary(i, p) for i, p in enumerate(paths)]
        replicas = [[(n, _new_replica(s, n, str(k))) for n in nodes for k in range(replicas_per_node)] for s in specs]
        every = handles + [h for reps in replicas for _, h in reps]
        keep_owned(name, namespace, every)  # they live as long as this process's Ray session, as documented
        ray.get([h.ready.remote() for h in every], timeout=ready_timeout_s)  # a failed constructor raises here
        ray.get([h.attach_replicas.remote(reps, s) for h, reps, s in zip(handles, replicas, specs)])
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
