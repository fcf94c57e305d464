"""Read replicas of the verl step buffer (rapo_fast/integrations/verl/buffer_replicas.py and the actor's replica role),
in-process (buffer_requests.LocalHandle: no ray, no verl): after a mixed sequence of concurrent adds and searches that
wraps the ring, every replica answers every search exactly as its primary; replicas apply writes delivered out of order
in the primary's order (and applying them in another order would differ); a load reaches the replicas; writes to a
replica, a diverging replica and bad replicas_per_node values are refused by name. Placement on Ray nodes and the
checkpoint save: tests/integrations/verl_plugin/test_verl_buffer_actor.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.integrations.verl.buffer_actor import StepBufferActor, StepBufferReplicaError
from rapo_fast.integrations.verl.buffer_client import StepBufferClient
from rapo_fast.integrations.verl.buffer_replicas import check_replicas_per_node
from rapo_fast.integrations.verl.buffer_requests import LocalHandle
from rapo_fast.retrieval.jsonl import write_jsonl

WORDS = [f"w{i}" for i in range(200)]
SPEC, TOK = "hashed:32", WordTokenizer(WORDS)
CAP = 32  # 18 pinned off-policy steps: the on-policy ones take turns in 14 slots


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = random.Random(0)
    recs = [
        {
            "query_id": q,
            "prompt": _text(rng, 12),
            "steps": [_text(rng, 5) for _ in range(3)],
            "answer": "a",
            "reward": 1,
        }
        for q in range(6)
    ]
    jsonl = write_jsonl(recs, tmp_path_factory.mktemp("traces") / "t.jsonl")
    adds = [
        ([_text(rng, 10) for _ in range(5)], [_text(rng, 4) for _ in range(5)], [b, b, b + 1, 2, 3]) for b in range(8)
    ]
    queries = [_text(rng, 10) for _ in range(24)] + [r["prompt"] for r in recs]
    excl = [rng.choice([-1, 2, 3, 5]) for _ in queries]
    return {"jsonl": str(jsonl), "adds": adds, "queries": queries, "excl": excl}


def _actor(data, replica: bool = False, capacity: int = CAP) -> StepBufferActor:
    return StepBufferActor(data["jsonl"], TOK, SPEC, top_k=5, capacity=capacity, replica=replica)


async def _primary_with(data, replicas: list[StepBufferActor]) -> StepBufferActor:
    primary = _actor(data)
    await primary.attach_replicas([("node-a", LocalHandle(r)) for r in replicas])
    return primary


async def _assert_same(primary, replicas, keys, excl) -> None:
    """Every replica answers the searches as the primary does (segments, payload ids, scores: exactly)."""
    want = await primary.retrieve(keys, excl)
    held = {k: v for k, v in (await primary.stats()).items() if k in ("size", "payloads", "steps_added")}
    for r in replicas:
        assert await r.retrieve(keys, excl) == want
        assert {k: v for k, v in (await r.stats()).items() if k in held} == held


def test_every_replica_answers_as_the_primary_after_mixed_adds_and_searches(data):
    async def go():
        replicas = [_actor(data, replica=True) for _ in range(2)]
        primary = await _primary_with(data, replicas)
        client = StepBufferClient(
            [LocalHandle(primary)], SPEC, replicas=[[("node-a", LocalHandle(r)) for r in replicas]]
        )
        keys = client.encode(data["queries"])
        qs, ex = data["queries"], data["excl"]
        for hs, steps, groups in data["adds"]:
            # two callers' adds in flight together, searches of many callers between them
            adds = [client.add_steps(hs[:2], steps[:2], groups[:2]), client.add_steps(hs[2:], steps[2:], groups[2:])]
            searches = [client.retrieve([q], [e]) for q, e in zip(qs, ex)]
            stored, *_ = await asyncio.gather(asyncio.gather(*adds), *searches)
            assert sum(stored) == len(hs)
            await _assert_same(primary, replicas, keys, ex)
        return primary, replicas

    primary, replicas = asyncio.run(go())
    assert primary.counters["steps_added"] == 40 > CAP - 18  # the ring wrapped
    assert primary.counters["requests"] == len(data["adds"])  # only _assert_same's: the client searched the replicas
    assert all(r.counters["requests"] > len(data["adds"]) for r in replicas)  # round robin: both served


def test_writes_delivered_out_of_order_are_applied_in_the_primarys_order(data):
    async def go():
        primary, in_order, swapped = _actor(data), _actor(data, replica=True), _actor(data, replica=True)
        enc = StepBufferClient([primary], SPEC).encode
        writes = [(enc(hs), steps, groups, None) for hs, steps, groups in data["adds"][:4]]
        for w in writes:
            await primary.add_steps(*w)
        late = [asyncio.ensure_future(in_order.replay(i, "add", *writes[i])) for i in (3, 2, 1)]
        await asyncio.sleep(0.05)
        assert in_order.counters["add_calls"] == 0  # writes 3, 2, 1 arrived first: they wait for write 0
        await in_order.replay(0, "add", *writes[0])
        await asyncio.gather(*late)
        for i, w in enumerate(reversed(writes)):  # the control: the same writes applied in another order
            await swapped.replay(i, "add", *w)
        keys = enc(data["queries"])
        await _assert_same(primary, [in_order], keys, data["excl"])
        assert await swapped.retrieve(keys, data["excl"]) != await primary.retrieve(keys, data["excl"])
        with pytest.raises(ValueError, match="already delivered"):
            await in_order.replay(1, "add", *writes[1])

    asyncio.run(go())


def test_a_load_reaches_the_replicas(data, tmp_path):
    async def go():
        replica = _actor(data, replica=True)
        primary = await _primary_with(data, [replica])
        client = StepBufferClient([LocalHandle(primary)], SPEC, replicas=[[("node-a", LocalHandle(replica))]])
        keys = client.encode(data["queries"])
        await client.add_steps(*data["adds"][0])
        await primary.save(str(tmp_path / "saved"))
        saved = await primary.retrieve(keys, data["excl"])
        for hs, steps, groups in data["adds"][1:]:
            await client.add_steps(hs, steps, groups)
        assert await replica.retrieve(keys, data["excl"]) != saved
        await primary.load(str(tmp_path / "saved"))
        assert await replica.retrieve(keys, data["excl"]) == saved
        await _assert_same(primary, [replica], keys, data["excl"])

    asyncio.run(go())


def test_refused_writes_and_a_diverging_replica_are_named(data, tmp_path):
    async def go():
        replica, keys = _actor(data, replica=True), StepBufferClient(["h"], SPEC).encode(data["adds"][0][0])
        add = (keys, data["adds"][0][1], data["adds"][0][2])
        for call in (replica.add_steps(*add), replica.save(str(tmp_path / "s")), replica.load(str(tmp_path / "s"))):
            with pytest.raises(StepBufferReplicaError, match="read replica"):
                await call
        primary = _actor(data)
        with pytest.raises(StepBufferReplicaError, match="only a replica"):
            await primary.replay(0, "add", *add, None)
        full = _actor(data, replica=True, capacity=18)  # every slot pinned: it stores none of what the primary does
        await primary.attach_replicas([("node-b", LocalHandle(full))])
        with pytest.raises(StepBufferReplicaError, match="node-b returned 0, the primary 5"):
            await primary.add_steps(*add)
        with pytest.raises(StepBufferReplicaError, match="before its first write"):
            await primary.attach_replicas([])

    asyncio.run(go())
    assert check_replicas_per_node(0) == 0 and check_replicas_per_node(3) == 3
    for bad, exc in ((-1, ValueError), (True, TypeError), ("2", TypeError), (1.0, TypeError)):
        with pytest.raises(exc, match=r"rapo\.step_buffer\.replicas_per_node"):
            check_replicas_per_node(bad)
    with pytest.raises(ValueError, match="one entry per shard"):
        StepBufferClient(["h0", "h1"], SPEC, replicas=[[]])
