"""The verl step buffer's caller-side encoding (rapo_fast/integrations/verl/buffer_actor.py): histories encoded in the
client's process, keys sent to the actors, gives exactly what the text path of StepTraces gives (retrieve and
add_steps on the same traces), for one and for two shards, with coalesced concurrent calls; a pickled client encodes
alike. In-process (buffer_requests.LocalHandle): no ray, no verl.
"""

from __future__ import annotations

import asyncio
import pickle
import random

import torch

from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.integrations.verl.buffer_actor import StepBufferActor, StepBufferClient
from rapo_fast.integrations.verl.buffer_requests import LocalHandle
from rapo_fast.retrieval.jsonl import write_jsonl
from rapo_fast.retrieval.step_traces import StepTraces

WORDS = [f"w{i}" for i in range(200)]
DIM = 48


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
