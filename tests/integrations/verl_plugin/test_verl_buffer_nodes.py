"""The step buffer's read replicas across Ray nodes, several nodes on this one machine (ray.cluster_utils.Cluster: a
head without CPUs, where this process runs, and two 1-CPU worker nodes): one replica per worker node; while this
process searches (6 callers) and adds, a worker node is removed and later a new one joins (place_replicas gives it a
replica). No search or add fails, every add is reported stored and stored once, the lost replica is counted, the new
one is caught up from its primary and found by the client, and every serving replica answers as the primary.

Skipped without ray. What this is not: a measure of speed (bench/bench_buffer_actor.py's nodes rows).
"""

from __future__ import annotations

import asyncio
import random

import pytest

ray = pytest.importorskip("ray")

from helpers.ray_local import SLOW_MACHINE  # noqa: E402

from rapo_fast.demo.tiny_policy import WordTokenizer  # noqa: E402
from rapo_fast.integrations.verl.buffer_actor import (  # noqa: E402
    get_or_create_step_buffer,
    get_step_buffer,
    place_replicas,
)
from rapo_fast.retrieval.encoders import HashedNgramEncoder  # noqa: E402
from rapo_fast.retrieval.jsonl import write_jsonl  # noqa: E402

WORDS = [f"w{i}" for i in range(300)]
DIM, CAP = 64, 64


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # a removed node (its processes gone: each check fails at once) is noticed within ~5 s (the defaults take ~15 s);
    # a live but starved one has 5 s per check, 5 checks in a row, before it is declared dead
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 5000, "health_check_failure_threshold": 5}
    config = {**SLOW_MACHINE, **health}
    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": config}
    )
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        c.wait_for_nodes()
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _poll(cond, timeout_s: float = 45.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached in time"
        await asyncio.sleep(0.1)


def test_a_node_removed_and_one_added_under_traffic(cluster, tmp_path):
    c, workers = cluster
    rng = random.Random(0)
    recs = [
        {"query_id": q, "prompt": _text(rng, 6), "steps": [_text(rng, 5)], "answer": "a", "reward": 1} for q in range(6)
    ]
    adds = [([_text(rng, 8) for _ in range(6)], [_text(rng, 4) for _ in range(6)], [b] * 6) for b in range(8)]
    qs = [_text(rng, 8) for _ in range(24)]
    name = "rapo_test_nodes"
    get_or_create_step_buffer(
        name,
        write_jsonl(recs, tmp_path / "t.jsonl"),
        tokenizer=WordTokenizer(WORDS),
        encoder=f"hashed:{DIM}",
        capacity=CAP,
        replicas_per_node=1,
        num_cpus=0,
        replica_timeout_s=5.0,
        ready_timeout_s=120,
    )
    client = get_step_buffer(name, timeout_s=10.0, refresh_s=0.5)
    assert sorted(n for n, _ in client.replicas[0]) == sorted(w.node_id for w in workers)  # the head has no CPUs
    primary = client.handles[0]
    victim = next(w for w in workers if w.node_id != ray.get(primary.stats.remote())["node"])

    async def go():
        loop, stop = asyncio.get_running_loop(), asyncio.Event()

        async def searcher(i: int) -> int:
            n = 0
            while not stop.is_set():
                (row,) = await client.retrieve([qs[(i + n) % len(qs)]])
                assert row[1] >= 0
                n += 1
            return n

        async def adder() -> tuple[list[int], object]:
            out, new = [], None
            for k, (hs, steps, groups) in enumerate(adds):
                if k == 2:
                    await loop.run_in_executor(None, c.remove_node, victim)
                if k == 5:
                    # on the loop's thread: Ray's Node sets a SIGTERM handler, which only the main thread may; the
                    # searchers wait out the node's start and go on after it
                    new = c.add_node(num_cpus=1)
                    assert await loop.run_in_executor(None, place_replicas, name) == 1
                out.append(await client.add_steps(hs, steps, groups))
            stop.set()
            return out, new

        *served, (stored, new) = await asyncio.gather(*(searcher(i) for i in range(6)), adder())
        assert stored == [6] * len(adds) and min(served) >= 1

        async def settled() -> bool:
            st = await primary.stats.remote()
            return st["replicas_lost"] == 1 and st["replicas_stale"] == 0 and st["replica_resyncs"] >= 1

        await _poll(settled)

        async def found() -> bool:  # the client re-reads the primary's serving replicas every refresh_s
            await client.retrieve(qs[:1])
            return new.node_id in {n for n, _ in client._readers.replicas[0]}

        await _poll(found)
        return new

    new = asyncio.run(go())
    st, *replica_stats = client.stats()
    assert st["steps_added"] == 48 and st["add_calls"] == 8 and st["repeated_adds"] == 0
    assert sorted(s["node"] for s in replica_stats) == sorted(
        {w.node_id for w in workers} - {victim.node_id} | {new.node_id}
    )
    assert all(s["replicas_serving"] == 1 and s["size"] == st["size"] for s in replica_stats)
    keys = HashedNgramEncoder(DIM)(qs)
    want = ray.get(primary.retrieve.remote(keys))
    assert ray.get([h.retrieve.remote(keys) for _, h in ray.get(primary.replicas.remote(True))]) == [want, want]
