"""The RAPO step buffer served by Ray actors to verl's agent-loop workers, saved and restored with verl's checkpoints.

What this is: `StepBufferActor` (an async Ray actor holding one StepTraces; it searches and stores keys, concurrent
retrieves gathered into one search), `StepBufferClient` (what an agent loop or reward worker holds; picklable, async,
sharded over several actors; it encodes the histories where they are, coalescing its process's concurrent calls),
`get_or_create_step_buffer` / `get_step_buffer`, and `build_step_buffer_from_jsonl` (the one-time build; its command
line, the config keys and verl's checkpoint hook are in buffer_setup.py). Batching, sharding and the save layout are
in docs/verl.md section 4.
What it is not: the nearest-neighbour search (rapo_fast.retrieval.buffer), the agent loop that inserts the steps
(agent_loop.py), or an approximate index. Importing it imports neither ray nor verl (they are imported when an actor
or client is made), so it is importable anywhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rapo_fast._atomic import FormatError, VersionWriter, read_version
from rapo_fast._checks import check_field, check_float, check_int, check_min_score
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
    "StepBufferClient",
    "StepBufferSaveError",
    "get_or_create_step_buffer",
    "get_step_buffer",
    "build_step_buffer_from_jsonl",
    "register",
]

DEFAULT_NAME = "rapo_step_buffer"
CHECKPOINT_SUBDIR = "rapo_step_buffer"  # inside verl's global_step_N/
SAVE_FORMAT, SAVE_VERSION, _PREFIX = "rapo_fast.verl.StepBuffer", 1, "stepbuf"


class StepBufferSaveError(FormatError):
    """A saved step buffer (this module's sharded layout) is missing, corrupt or does not fit the actors."""


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


def _is_bare_traces(path: Path) -> bool:
    """A directory saved by StepTraces.save itself (one shard), rather than this module's sharded layout."""
    try:
        return (path / "CURRENT").read_text().startswith("traces-")
    except OSError:
        return False


class StepBufferActor:
    """One shard of the step buffer (made a Ray actor by `get_or_create_step_buffer`; usable in-process too).

    Args: source (a .jsonl of off-policy traces, a directory saved by StepTraces.save, or None for an empty buffer of
    `capacity`), tokenizer (HF path or an object with encode), encoder (see make_encoder: it encodes a JSONL source;
    the clients make the same one from `encoder_spec()` and send keys), shard / num_shards (which part of a JSONL this
    shard keeps), window_s (how long a search waits for more requests), max_batch (most queries per search), build
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
                raise ValueError("StepBufferActor: an empty buffer (source=None) needs capacity=<int>")
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
        return {**self.counters, "size": len(self.traces.buffer), "payloads": len(self.traces), "device": self.device}

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
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._search, batch)

    def _search(self, batch: list) -> list[tuple[list, list[int], list[float]]]:
        keys = torch.cat([req[0] for req in batch])
        excl = [g for req in batch for g in req[1]]
        segs, pids, scores = self.traces.search(keys, excl, batch[0][2])
        self.counters["search_calls"] += 1
        self.counters["queries"] += len(keys)
        pids, scores = pids.tolist(), scores.tolist()
        out, i = [], 0
        for req in batch:
            j = i + len(req[0])
            out.append((segs[i:j], pids[i:j], scores[i:j]))
            i = j
        return out

    async def add_steps(
        self, keys: torch.Tensor, steps: list[str], group_ids: list[int], scores: list[float] | None = None
    ) -> int:
        """The policy's own steps under their prompts' group ids (StepTraces.add_encoded; keys: their histories
        encoded by the caller); returns how many the buffer stored (a buffer whose every slot holds a pinned
        off-policy step drops new ones: counted in steps_dropped). group_ids in [0, 2^63 - 1], scores None or finite;
        a refused call changes nothing."""
        steps = check_histories(steps, "add_steps", "steps")
        keys = self.traces.check_keys(keys, len(steps), "add_steps: keys")
        group_ids = check_groups(group_ids, len(steps), "group_ids", "add_steps", lo=0)
        scores = check_scores(scores, len(steps))
        fut = self._pool.submit(self.traces.add_encoded, keys, steps, group_ids, scores, return_slots=True)
        _, slots = await asyncio.wrap_future(fut)
        stored = int((slots >= 0).sum())
        self.counters["add_calls"] += 1
        self.counters["steps_added"] += stored
        self.counters["steps_dropped"] += len(steps) - stored
        return stored

    async def save(self, path: str) -> None:
        """StepTraces.save (atomic, versioned) on the thread that adds, so never beside an add."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self.traces.save, path)

    async def load(self, path: str) -> None:
        traces = await asyncio.get_running_loop().run_in_executor(self._pool, self._load_traces, path)
        self.traces = traces


def _gpu_ids() -> list:
    try:
        import ray

        return ray.get_gpu_ids() if ray.is_initialized() else []
    except ImportError:
        return []


def _shard_name(name: str, i: int) -> str:
    return name if i == 0 else f"{name}.{i}"


class StepBufferClient:
    """The agent loop's view of the buffer: async retrieve/add_steps, sync save/load/stats (driver side).

    It encodes the histories in the caller's process (with `encoder`, the spec the actors were built with) and sends
    keys; a process's retrieves that arrive while a call is being served (or within window_s of the first one, when
    window_s > 0), up to max_batch histories, share the next encoding and call per shard. Picklable: a copy holds the
    handles and settings, and makes its encoder when first used."""

    def __init__(
        self,
        handles: Sequence[Any],
        encoder: str | Callable = "hashed",
        *,
        window_s: float = 0.0,
        max_batch: int = 1024,
    ):
        if not handles:
            raise ValueError("StepBufferClient: handles must hold at least one actor handle, got none")
        window_s = check_float("StepBufferClient: window_s", window_s, min_value=0.0, max_value=10.0)
        max_batch = check_int("StepBufferClient: max_batch", max_batch, lo=1)
        self.handles, self.encoder_spec = list(handles), encoder
        self.window_s, self.max_batch = float(window_s), max_batch
        self._encoder: Callable | None = None
        self._lock = threading.Lock()
        self._retrieves = Coalescer(self._serve_retrieve, self.window_s, max_batch)

    def __getstate__(self) -> dict:
        return {
            "handles": self.handles,
            "encoder": self.encoder_spec,
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
        """One encoding and one call per shard for the batch's histories; each request gets its rows."""
        hist = [h for req in batch for h in req[0]]
        excl = [g for req in batch for g in req[1]]
        keys = await asyncio.get_running_loop().run_in_executor(None, self.encode, hist)
        parts = await asyncio.gather(*(h.retrieve.remote(keys, excl, batch[0][2]) for h in self.handles))
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
        histories are encoded here; each shard gets the keys of its groups."""
        histories = check_histories(histories, "add_steps")
        group_ids = check_groups(group_ids, len(histories), "group_ids", "add_steps", lo=0)
        steps = check_histories(steps, "add_steps", "steps")
        if len(steps) != len(histories):
            raise ValueError(f"add_steps: steps must be a list of {len(histories)} str, got {len(steps)} entries")
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
        """Save every shard into one versioned directory (rapo_fast._atomic): shard_i/ are StepTraces saves, listed
        with their checksums in one manifest that CURRENT switches to atomically. `path` must be reachable from the
        actors' nodes (a shared filesystem on a multi-node cluster)."""
        import ray

        with VersionWriter(path, _PREFIX, SAVE_FORMAT, SAVE_VERSION) as w:
            ray.get([h.save.remote(str(w.path / f"shard_{i}")) for i, h in enumerate(self.handles)])
            for i in range(self.num_shards):
                w.add_nested(f"shard_{i}")
            w.commit({"num_shards": self.num_shards})

    def load(self, path: str | os.PathLike) -> None:
        """Replace every shard's state by a save of `save` (or, with one shard, of StepTraces.save)."""
        import ray

        path = Path(path)
        if _is_bare_traces(path):
            if self.num_shards != 1:
                raise StepBufferSaveError(f"{path}: a one-shard StepTraces save, the buffer has {self.num_shards}")
            ray.get(self.handles[0].load.remote(str(path)))
            return
        with read_version(path, _PREFIX, SAVE_FORMAT, SAVE_VERSION, StepBufferSaveError) as v:
            n = check_field(v.meta, "num_shards", v.path / "meta.json", StepBufferSaveError, check_int, lo=1)
            if n != self.num_shards:
                raise StepBufferSaveError(f"{v.path}: field 'num_shards' is {n}, the buffer has {self.num_shards}")
            ray.get([h.load.remote(str(v.path / f"shard_{i}")) for i, h in enumerate(self.handles)])

    def stats(self) -> list[dict]:
        import ray

        return ray.get([h.stats.remote() for h in self.handles])


def get_step_buffer(name: str = DEFAULT_NAME, namespace: str | None = None) -> StepBufferClient:
    """A client for the existing actor(s) `name` (ValueError when there is none)."""
    import ray

    first = ray.get_actor(name, namespace=namespace)
    n, encoder = ray.get([first.ready.remote(), first.encoder_spec.remote()])
    handles = [first] + [ray.get_actor(_shard_name(name, i), namespace=namespace) for i in range(1, n)]
    return StepBufferClient(handles, encoder)


def get_or_create_step_buffer(
    name: str = DEFAULT_NAME,
    source: str | os.PathLike | None = None,
    *,
    tokenizer: Any = None,
    encoder: str | Callable = "hashed",
    num_shards: int = 1,
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
    ready_timeout_s: how long to wait for the actors to be placed and built (then ray's GetTimeoutError).
    options: window_s, max_batch, trust_remote_code, top_k, capacity, metric, eviction, dtype."""
    import ray

    with contextlib.suppress(ValueError):
        return get_step_buffer(name, namespace)
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"get_or_create_step_buffer: num_shards must be a positive int, got {num_shards!r}")
    if tokenizer is None:
        raise ValueError(f"get_or_create_step_buffer: no actor {name!r} exists, and creating one needs tokenizer=")
    actor_cls = ray.remote(StepBufferActor)
    opts = {"num_cpus": num_cpus, "num_gpus": num_gpus, "get_if_exists": True, "lifetime": lifetime}
    opts = {**opts, "namespace": namespace, "max_concurrency": 1000}
    src = None if source is None else Path(source)

    def create(paths: list[str | None]) -> StepBufferClient:
        handles = [
            actor_cls.options(name=_shard_name(name, i), **opts).remote(
                p, tokenizer, encoder, shard=i, num_shards=num_shards, **options
            )
            for i, p in enumerate(paths)
        ]
        ray.get([h.ready.remote() for h in handles], timeout=ready_timeout_s)  # a failed constructor raises here
        return StepBufferClient(handles, encoder)

    if src is not None and not src.exists():
        raise ValueError(f"get_or_create_step_buffer: source must be a .jsonl file or a saved buffer, got {str(src)!r}")
    if src is None or str(src).endswith(".jsonl") or _is_bare_traces(src):
        if src is not None and _is_bare_traces(src) and num_shards != 1:
            raise ValueError(f"get_or_create_step_buffer: {src} is a one-shard save, num_shards={num_shards} given")
        return create([None if src is None else str(src)] * num_shards)
    with read_version(src, _PREFIX, SAVE_FORMAT, SAVE_VERSION, StepBufferSaveError) as v:
        n = check_field(v.meta, "num_shards", v.path / "meta.json", StepBufferSaveError, check_int, lo=1)
        if n != num_shards:
            raise ValueError(f"get_or_create_step_buffer: {src} holds {n} shards, num_shards={num_shards} given")
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
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"build_step_buffer_from_jsonl: num_shards must be a positive int, got {num_shards!r}")
    if not Path(jsonl).is_file():
        raise ValueError(f"build_step_buffer_from_jsonl: jsonl must be an existing file, got {str(jsonl)!r}")
    enc, tok = make_encoder(encoder), _load_tokenizer(tokenizer, trust_remote_code)
    with VersionWriter(out_dir, _PREFIX, SAVE_FORMAT, SAVE_VERSION) as w:
        sizes = []
        for i in range(num_shards):
            traces = _build_shard(jsonl, tok, enc, i, num_shards, "cpu", **build)
            traces.save(w.path / f"shard_{i}")
            w.add_nested(f"shard_{i}")
            sizes.append(len(traces))
        w.commit({"num_shards": num_shards, "steps_per_shard": sizes})
    return Path(out_dir)
