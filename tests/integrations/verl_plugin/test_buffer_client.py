"""The verl step buffer's client (rapo_fast/integrations/verl/buffer_actor.py), in-process (no ray, no verl): a
StepBufferClient over StepBufferActors through buffer_requests.LocalHandle.

Caller-side encoding: histories encoded in the client's process, keys sent to the actors, give exactly what the text
path of StepTraces gives (retrieve and add_steps on the same traces), for one and two shards, with coalesced
concurrent calls; a pickled client encodes alike.
Bad requests must not hang or fail a shared server: one batch mixes good requests with one bad request of each kind
(NaN/inf/str min_score, past-int64/bool/float exclude group, a lone surrogate, a history the encoder refuses inside the
client's shared encoding); every call is bounded by a timeout. Only the bad callers fail, the good ones get exactly the
rows they get alone, and client and actor keep serving. The actor refuses bad keys (wrong type, shape, dim, NaN)
naming them. A hypothesis property does the same over arbitrary thresholds and group ids.
Not here: replicas (test_buffer_replicas.py), Ray actors (test_verl_buffer_actor.py).
"""

from __future__ import annotations

import asyncio
import math
import pickle
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.integrations.verl.buffer_actor import StepBufferActor
from rapo_fast.integrations.verl.buffer_client import StepBufferClient
from rapo_fast.integrations.verl.buffer_requests import LocalHandle
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import write_jsonl
from rapo_fast.retrieval.step_traces import StepTraces

WORDS = [f"w{i}" for i in range(200)]
DIM = 32
TIMEOUT_S = 30.0  # a hang fails the test instead of stalling the suite


class _PoisonEncoder:
    """HashedNgramEncoder that refuses one history ("poison"): an error raised inside a shared encoding."""

    def __init__(self):
        self.inner = HashedNgramEncoder(DIM)
        self.dim = DIM

    def __call__(self, texts):
        if any("poison" in t for t in texts):
            raise RuntimeError("encoder refuses 'poison'")
        return self.inner(texts)


def _buffer(window_s: float = 0.05) -> StepBufferClient:
    enc = _PoisonEncoder()
    a = StepBufferActor(None, WordTokenizer(WORDS), enc, capacity=32, window_s=window_s)
    client = StepBufferClient([LocalHandle(a)], enc, window_s=window_s)
    client.actor = a
    hist = [" ".join(WORDS[i : i + 4]) for i in range(0, 24, 3)]
    steps = [" ".join(WORDS[i + 4 : i + 6]) for i in range(0, 24, 3)]
    asyncio.run(client.add_steps(hist, steps, list(range(len(hist)))))
    return client


GOOD = [
    (["w1 w2 w3", "w7 w8"], None, None),
    (["w10 w11 w12"], [3], None),
    (["w4 w5 w6"], [-1], None),
    (["w13 w14", "w20 w21"], [0, 5], None),
]
BAD = [
    (["w1 w2"], None, float("nan")),
    (["w1 w2"], None, float("inf")),
    (["w1 w2"], None, float("-inf")),
    (["w1 w2"], None, "0.5"),
    (["w1 w2"], None, 2**2000),
    (["w1 w2"], [2**70], None),
    (["w1 w2"], [-(2**63) - 1], None),
    (["w1 w2"], [True], None),
    (["w1 w2"], [1.0], None),
    (["w1 w2", "w3"], [1], None),  # one group id for two histories
    (["w1 \ud800 w2"], None, None),  # a lone surrogate
    (["w1 poison"], None, None),  # passes every check, fails inside the shared encoding
    ("w1 w2", None, None),
]


async def _call(client, hist, excl, ms):
    return await asyncio.wait_for(client.retrieve(hist, excl, ms), TIMEOUT_S)


def _idle(client) -> bool:
    return client._retrieves._pending == [] and client.actor._searches._pending == []


def test_mixed_batch_only_bad_callers_fail():
    client = _buffer()

    async def alone():
        return [await _call(client, *g) for g in GOOD]

    want = asyncio.run(alone())

    async def mixed():
        reqs = [x for pair in zip(BAD, GOOD * 4) for x in pair]  # interleaved: bad requests inside good batches
        return reqs, await asyncio.wait_for(
            asyncio.gather(*(_call(client, *r) for r in reqs), return_exceptions=True), TIMEOUT_S
        )

    reqs, got = asyncio.run(mixed())
    for req, res in zip(reqs, got):
        if req in BAD:
            assert isinstance(res, (ValueError, TypeError, RuntimeError)), (req, res)
            assert not isinstance(res, asyncio.TimeoutError), req
        else:
            assert res == want[GOOD.index(req)], (req, res)
    # both still serve, and the poisoned encoding did not leave anything queued
    assert asyncio.run(alone()) == want
    assert _idle(client)


def test_bad_values_name_the_argument():
    client = _buffer(window_s=0)
    cases = [
        ((["w1"], None, float("nan")), "min_score"),
        ((["w1"], [2**70], None), "exclude_groups[0]"),
        ((["w1 \ud800"], None, None), "histories[0]"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
            asyncio.run(_call(client, *args))
    for groups, name in (([2**64], "group_ids"), ([-1], "group_ids")):
        with pytest.raises(ValueError, match=name):
            asyncio.run(client.add_steps(["w1"], ["w2"], groups))
    with pytest.raises(ValueError, match=r"scores\[0\]"):
        asyncio.run(client.add_steps(["w1"], ["w2"], [1], [float("nan")]))


def test_actor_refuses_bad_keys_naming_them():
    """Keys come from other processes now: the actor checks them before they join a search or the buffer."""
    actor = _buffer(window_s=0).actor
    good = torch.ones(2, DIM)
    bad = [
        ([[0.0] * DIM], TypeError),  # not a tensor
        (torch.ones(2, DIM, dtype=torch.int64), TypeError),
        (torch.ones(DIM), ValueError),  # 1-D
        (torch.ones(2, DIM + 1), ValueError),  # another encoder's dim
        (torch.full((2, DIM), float("nan")), ValueError),
    ]
    for keys, err in bad:
        with pytest.raises(err, match="keys"):
            asyncio.run(actor.retrieve(keys))
        with pytest.raises(err, match="keys"):
            asyncio.run(actor.add_steps(keys, ["w1", "w2"], [1, 1]))
    with pytest.raises(ValueError, match="keys"):
        asyncio.run(actor.add_steps(good, ["w1"], [1]))  # two keys, one step
    assert asyncio.run(actor.stats())["steps_added"] == 8  # the fill only: nothing refused was stored
    segs, pids, scores = asyncio.run(actor.retrieve(good, [-1, 0]))
    assert len(segs) == 2 and pids[0] >= 0


@pytest.fixture(scope="module")
def shared():
    """One buffer for every hypothesis example, and what the good request gets from it alone."""
    client = _buffer(window_s=0.001)
    return client, asyncio.run(client.retrieve(["w1 w2 w3"], [0], None))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ms=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**80), 2**80)),
    groups=st.lists(st.integers(-(2**70), 2**70), min_size=2, max_size=2),
)
def test_any_threshold_and_groups_settle_and_spare_the_good_caller(shared, ms, groups):
    client, good_alone = shared
    good = (["w1 w2 w3"], [0], None)

    async def go():
        return await asyncio.wait_for(
            asyncio.gather(_call(client, ["w4 w5", "w6"], groups, ms), _call(client, *good), return_exceptions=True),
            TIMEOUT_S,
        )

    res, good_res = asyncio.run(go())
    assert good_res == good_alone
    finite = ms is None or (isinstance(ms, float) and math.isfinite(ms)) or (isinstance(ms, int) and abs(ms) < 2**1000)
    in_range = all(-(2**63) <= g < 2**63 for g in groups)
    if finite and in_range:
        assert isinstance(res, list) and len(res) == 2
    else:
        assert isinstance(res, ValueError), res
    assert _idle(client)


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _data(tmp_path):
    rng = random.Random(0)
    recs = [
        {
            "query_id": q,
            "prompt": _text(rng, 30),
            "steps": [_text(rng, 8) for _ in range(3)],
            "answer": "a",
            "reward": 1,
        }
        for q in range(6)
    ]
    adds = ([_text(rng, 700) for _ in range(5)], [_text(rng, 4) for _ in range(5)], [0, 1, 2, 3, 4])  # past the window
    queries = [_text(rng, rng.choice([5, 40, 900])) + " <retrieve> w1 </retrieve>" for _ in range(30)]
    return write_jsonl(recs, tmp_path / "t.jsonl"), adds, queries


def test_keys_in_equal_text_in(tmp_path):
    jsonl, adds, queries = _data(tmp_path)
    tok, spec = WordTokenizer(WORDS), f"hashed:{DIM}"
    ref = StepTraces.from_jsonl(jsonl, StepBufferClient([object()], spec).encode, tok, top_k=5, capacity=64)
    ref.add_steps(*adds)
    excl = [random.Random(i).choice([-1, 0, 2]) for i in range(len(queries))]
    segs, pids, scores = ref.retrieve(queries, excl)
    want = list(zip(segs, pids.tolist(), scores.tolist()))
    for shards in (1, 2):
        actors = [
            StepBufferActor(str(jsonl), tok, spec, shard=i, num_shards=shards, top_k=5, capacity=64)
            for i in range(shards)
        ]
        client = StepBufferClient([LocalHandle(a) for a in actors], spec)

        async def go(client=client):
            assert await client.add_steps(*adds) == len(adds[0])
            return await asyncio.gather(*(client.retrieve([q], [e]) for q, e in zip(queries, excl)))

        got = [r[0] for r in asyncio.run(go())]
        assert sum(a.counters["requests"] for a in actors) < len(queries) * shards  # coalesced per client
        if shards == 1:
            assert got == want
        else:  # payload ids are per shard: compare the steps and scores
            assert [(s, round(x, 5)) for s, _, x in got] == [(s, round(x, 5)) for s, _, x in want]
    shipped = pickle.loads(pickle.dumps(StepBufferClient(["handle"], spec)))  # as Ray ships it to a worker
    assert torch.equal(shipped.encode(queries), ref.encode(queries))  # the same keys, markers stripped alike
