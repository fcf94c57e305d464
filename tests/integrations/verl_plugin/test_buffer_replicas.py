"""Read replicas of the verl step buffer (rapo_fast/integrations/verl/buffer_replicas.py, buffer_sync.py and the
actor's roles), in-process (buffer_requests.LocalHandle: no ray, no verl): after a mixed sequence of concurrent adds and
searches that wraps the ring, every replica answers every search exactly as its primary; replicas apply writes
delivered out of order in the primary's order (another order is detected and the replica stops serving); a load
reaches the replicas. Faults: a replica killed under concurrent searches and adds (no caller sees an error, every add
stored once and reported as stored, the replica dropped and counted); a replica failing a write (stale, not read, then
caught up by snapshot and serving again); a diverging replica (caught up, not refused); a retried add (stored once);
a timed-out replica dropped and found again. Refused calls name themselves. Ray actors, restarts and nodes:
test_verl_buffer_actor.py, test_verl_buffer_nodes.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.integrations.verl.buffer_actor import StepBufferActor, StepBufferReplicaError, StepBufferStaleError
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


async def _primary_with(data, replicas: list[StepBufferActor], **kw) -> StepBufferActor:
    primary = StepBufferActor(data["jsonl"], TOK, SPEC, top_k=5, capacity=CAP, **kw)
    await primary.attach_replicas([("node-a", LocalHandle(r)) for r in replicas])
    return primary


async def _until(cond, timeout_s: float = 20.0) -> None:
    """Poll `cond()` (the background catch-up runs on this event loop) until true; fail after timeout_s."""
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _until_async(cond, timeout_s: float = 20.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _assert_same(primary, replicas, keys, excl, fields=("size", "payloads", "steps_added")) -> None:
    """Every replica answers the searches as the primary does (segments, payload ids, scores: exactly) and holds
    as much (a replica restored from a snapshot did not count the adds it holds from it: fields without steps_added)."""
    want = await primary.retrieve(keys, excl)
    held = {k: v for k, v in (await primary.stats()).items() if k in fields}
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
        for hs, steps, groups in data["adds"][:4]:
            await primary.add_steps(enc(hs), steps, groups)
        log = list(primary._set.log.items())  # (seq, (op, args, the primary's fingerprint))
        inc = (await in_order.sync_state())[1]
        late = [asyncio.ensure_future(in_order.replay(s, inc, exp, op, *args)) for s, (op, args, exp) in log[:0:-1]]
        await asyncio.sleep(0.05)
        assert in_order.counters["add_calls"] == 0  # writes 3, 2, 1 arrived first: they wait for write 0
        s, (op, args, exp) = log[0]
        await in_order.replay(s, inc, exp, op, *args)
        await asyncio.gather(*late)
        assert await in_order.replay(s, inc, exp, op, *args) is None  # a repeat: held already, nothing applied
        await in_order.serve(4)
        keys = enc(data["queries"])
        await _assert_same(primary, [in_order], keys, data["excl"])
        # the same writes in another order store elsewhere: the replica sees it (fingerprints) and stops serving
        inc2 = (await swapped.sync_state())[1]
        await swapped.serve(0)
        with pytest.raises(StepBufferStaleError, match="stored"):
            for i, (_, (op, args, exp)) in enumerate(reversed(log)):
                await swapped.replay(i, inc2, exp, op, *args)
        with pytest.raises(StepBufferStaleError, match="not in step"):
            await swapped.retrieve(keys, data["excl"])
        assert (await swapped.sync_state())[0] == -1  # broken: it needs a snapshot

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


def test_a_replica_killed_under_traffic_costs_no_caller_an_error_and_no_add_twice(data):
    """Two replicas; one is killed while 8 callers search and another adds; every search answers, every add returns
    its full count; the dead replica is dropped (by the client, by the primary: replicas_lost), and the survivor and
    the primary hold exactly the 40 steps added, once."""

    async def go():
        replicas = [_actor(data, replica=True) for _ in range(2)]
        primary = await _primary_with(data, replicas)
        handles = [("node-a", LocalHandle(r)) for r in replicas]
        client = StepBufferClient([LocalHandle(primary)], SPEC, replicas=[handles], timeout_s=5.0)
        qs, ex = data["queries"], data["excl"]
        killed = asyncio.Event()

        async def searcher(i: int) -> int:
            n = 0
            while not killed.is_set() or n < 6:
                rows = await client.retrieve([qs[(i + n) % len(qs)]], [ex[(i + n) % len(qs)]])
                assert len(rows) == 1 and rows[0][1] >= 0
                n += 1
                await asyncio.sleep(0)
            return n

        async def adder() -> list[int]:
            out = []
            for k, (hs, steps, groups) in enumerate(data["adds"]):
                if k == 3:
                    handles[0][1].kill()
                    killed.set()
                out.append(await client.add_steps(hs, steps, groups))
            return out

        *served, stored = await asyncio.gather(*(searcher(i) for i in range(8)), adder())
        assert stored == [5] * len(data["adds"]) and all(n >= 6 for n in served)
        await _until(lambda: primary._set.counters["replicas_lost"] == 1)
        st = await primary.stats()
        assert st["steps_added"] == 40 and st["replicas_stale"] == 0 and st["replica_write_failures"] == 1
        assert [n for n, _ in await primary.replicas(True)] == ["node-a"]
        assert client._readers.failovers <= 1 and all(h is not handles[0][1] for h in client._readers.order(0))
        await _assert_same(primary, [replicas[1]], client.encode(qs), ex)
        assert replicas[1].counters["steps_added"] == 40  # replayed once each

    asyncio.run(go())


def test_a_replica_failing_a_write_is_stale_unread_then_caught_up(data):
    """A replica's add raises once: the caller's add still returns (the primary and the other replica stored it), the
    failed replica serves no search (clients go to the other copy) until its primary has restored it from a snapshot
    and replayed the writes since; then it answers as the primary."""

    async def go():
        bad, good = _actor(data, replica=True), _actor(data, replica=True)
        primary = await _primary_with(data, [bad, good])
        client = StepBufferClient(
            [LocalHandle(primary)], SPEC, replicas=[[("node-a", LocalHandle(r)) for r in (bad, good)]]
        )
        qs, ex = data["queries"], data["excl"]
        keys = client.encode(qs)
        add, restore, gate = bad.traces.add_encoded, bad.restore, asyncio.Event()

        def fail_once(*a, **k):
            bad.traces.add_encoded = add
            raise RuntimeError("disk full")

        async def held_restore(*a):
            await gate.wait()  # the catch-up waits here: the stale replica can be looked at
            return await restore(*a)

        bad.traces.add_encoded, bad.restore = fail_once, held_restore
        await client.add_steps(*data["adds"][0])
        assert await client.add_steps(*data["adds"][1]) == 5
        assert (await primary.stats())["replicas_stale"] == 1 and (await bad.stats())["replicas_serving"] == 0
        with pytest.raises(StepBufferStaleError):
            await bad.retrieve(keys, ex)
        before = bad.counters["requests"]
        rows = await asyncio.gather(*(client.retrieve([q], [e]) for q, e in zip(qs, ex)))
        assert [r[0] for r in rows] == [tuple(x) for x in zip(*await primary.retrieve(keys, ex))]
        assert bad.counters["requests"] - before <= 1  # at most the one search that found it stale
        for hs, steps, groups in data["adds"][
            2:
        ]:  # writes while it is stale: caught up from the log after the snapshot
            await client.add_steps(hs, steps, groups)
        gate.set()
        await _until(lambda: primary._set.counters["replica_resyncs"] == 1)
        assert (await primary.stats())["replicas_stale"] == 0 and (await bad.stats())["replicas_serving"] == 1
        await _assert_same(primary, [good], keys, ex)
        await _assert_same(primary, [bad], keys, ex, fields=("size", "payloads"))

    asyncio.run(go())


def test_a_diverging_replica_is_caught_up_and_a_retried_add_is_stored_once(data):
    async def go():
        full = _actor(data, replica=True, capacity=18)  # every slot pinned: it stores none of what the primary does
        primary = await _primary_with(data, [full])
        client = StepBufferClient([LocalHandle(primary)], SPEC, replicas=[[("node-b", LocalHandle(full))]])
        hs, steps, groups = data["adds"][0]
        assert await client.add_steps(hs, steps, groups, write_id="w1") == 5  # the replica's count differs: stale
        await _until(lambda: primary._set.counters["replica_resyncs"] == 1)
        assert primary._set.counters["replica_write_failures"] == 1
        keys = client.encode(data["queries"])
        # restored from the primary's snapshot
        await _assert_same(primary, [full], keys, data["excl"], fields=("size", "payloads"))
        assert await client.add_steps(hs, steps, groups, write_id="w1") == 5  # a retry: nothing stored again
        st = await primary.stats()
        assert st["steps_added"] == 5 and st["add_calls"] == 1 and st["repeated_adds"] == 1
        assert await client.add_steps(hs, steps, groups, write_id="w2") == 5 and primary.counters["steps_added"] == 10

    asyncio.run(go())


def test_a_timed_out_replica_is_dropped_then_found_again(data):
    """A replica whose searches hang is dropped after the client's timeout_s (its calls answered elsewhere) and
    reported to its primary, which finds it answering and keeps it; once it answers again, the client's next refresh
    of the primary's list brings it back and it serves searches."""

    async def go():
        slow, other = _actor(data, replica=True), _actor(data, replica=True)
        primary = await _primary_with(data, [slow, other])
        reps = [("node-a", LocalHandle(r)) for r in (slow, other)]
        client = StepBufferClient([LocalHandle(primary)], SPEC, replicas=[reps], timeout_s=2.0, refresh_s=3600.0)
        qs, ex = data["queries"], data["excl"]
        search, stall = slow._searches.submit, asyncio.Event()

        async def stalled(*a):
            await stall.wait()
            return await search(*a)

        slow._searches.submit = stalled
        for q, e in zip(qs[:6], ex[:6]):
            assert len(await client.retrieve([q], [e])) == 1  # every call answered, one after a 2 s wait
        assert client._readers.failovers == 1 and all(h._actor is not slow for h in client._readers.order(0))
        await _until(lambda: primary._set.counters["read_failovers"] == 1)
        assert (await primary.stats())["replicas_stale"] == 0  # it answers its primary: still in step
        stall.set()
        slow._searches.submit = search
        before = slow.counters["queries"]
        client._readers.refresh_s = 0.0  # the next call re-reads the primary's list

        async def found() -> bool:
            await client.retrieve(qs[:1], ex[:1])
            return any(h._actor is slow for h in client._readers.order(0))

        await _until_async(found)
        for q, e in zip(qs, ex):
            await client.retrieve([q], [e])
        assert slow.counters["queries"] > before

    asyncio.run(go())


def test_refused_calls_are_named(data, tmp_path):
    async def go():
        replica, keys = _actor(data, replica=True), StepBufferClient(["h"], SPEC).encode(data["adds"][0][0])
        add = (keys, data["adds"][0][1], data["adds"][0][2])
        calls = (replica.add_steps(*add), replica.save(str(tmp_path / "s")), replica.load(str(tmp_path / "s")))
        for call in (*calls, replica.add_replica("n", None)):
            with pytest.raises(StepBufferReplicaError, match="read replica"):
                await call
        with pytest.raises(StepBufferStaleError, match="not in step"):  # never told to serve
            await replica.retrieve(keys)
        primary = _actor(data)
        for call in (primary.replay(0, "x", None, "add", *add), primary.sync_state(), primary.serve(0)):
            with pytest.raises(StepBufferReplicaError, match="only a replica"):
                await call
        with pytest.raises(StepBufferStaleError, match="restarted"):
            await replica.replay(0, "another process", None, "add", *add)
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
    with pytest.raises(ValueError, match="timeout_s"):
        StepBufferClient(["h0"], SPEC, timeout_s=0)
