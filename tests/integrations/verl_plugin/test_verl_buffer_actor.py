"""The step buffer as Ray actors (rapo_fast/integrations/verl/buffer_actor.py, buffer_setup.py) under Ray's local
CPU cluster: several clients searching while one adds (past the ring's wrap), every result equal to a float64 brute
force (rapo_fast.reference.retrieval.search_ref) of one of the states the buffer held; concurrent requests coalesced
into fewer requests and searches; save -> new actor -> load identical; two shards against the brute force over their
union; read replicas (2 on the one node) answering every search as their primary after concurrent adds from two
processes, and the clients' searches served by them; two replicas killed under traffic, one for good and one
restarted by Ray (no search or add fails, adds stored once, the restarted one caught up and found again); verl's
checkpoint callback saving into global_step_N/ from the primary and a new job restoring from it, both with a replica.
Several nodes: test_verl_buffer_nodes.py.

Skipped without ray (the main environment); the callback test also needs verl.
"""

from __future__ import annotations

import asyncio
import random
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers.ray_local import local_ray  # noqa: E402

from rapo_fast.demo.tiny_policy import WordTokenizer  # noqa: E402
from rapo_fast.integrations.verl.buffer_actor import (  # noqa: E402
    build_step_buffer_from_jsonl,
    get_or_create_step_buffer,
    get_step_buffer,
)
from rapo_fast.integrations.verl.buffer_setup import main, onpolicy_steps  # noqa: E402
from rapo_fast.reference.retrieval import scores_ref  # noqa: E402
from rapo_fast.retrieval.encoders import HashedNgramEncoder  # noqa: E402
from rapo_fast.retrieval.jsonl import write_jsonl  # noqa: E402
from rapo_fast.retrieval.step_traces import (  # noqa: E402
    OFFPOLICY_GROUP_BASE,
    RETRIEVE_CLOSE,
    RETRIEVE_OPEN,
    StepTraces,
    strip_retrieve_markers,
)

WORDS = [f"w{i}" for i in range(300)]
DIM, TOP_K, CAP = 64, 2, 64
TOL = 1e-5
CALLBACK = "rapo_fast.integrations.verl.buffer_setup.StepBufferCheckpointCallback"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    # The remote functions below live in this test module, which Ray's workers cannot import by name.
    with local_ray(pickle_by_value=sys.modules[__name__]):
        yield


@pytest.fixture(autouse=True)
def _kill_actors():
    """Every test's actors go at its end (each holds its CPU share while it lives)."""
    yield
    for c in _CREATED:
        for h in c.handles + [h for reps in c.replicas for _, h in reps]:
            ray.kill(h)
    _CREATED.clear()


_CREATED: list = []


def _make(name: str, source, **kw):
    """A buffer of this test: no CPU held (2 CPUs in all), a timeout instead of a hang when it cannot be placed."""
    c = get_or_create_step_buffer(name, source, num_cpus=0, ready_timeout_s=120, encoder=f"hashed:{DIM}", **kw)
    _CREATED.append(c)
    return c


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Off-policy traces (6 queries x 3 trajectories x 3 steps; top-2 kept: 36 steps) and 8 batches of 6 on-policy
    steps (48: 36 + 48 > CAP = 64, so the ring wraps), plus the tokenizer and encoder the actors get."""
    rng = random.Random(0)
    recs = [
        {"query_id": q, "prompt": _text(rng, 6), "steps": [_text(rng, 5) for _ in range(3)], "answer": "a", "reward": r}
        for q in range(6)
        for r in (0.0, 1.0, 0.5)
    ]
    path = write_jsonl(recs, tmp_path_factory.mktemp("traces") / "t.jsonl")
    adds = [
        ([_text(rng, 8) for _ in range(6)], [_text(rng, 4) for _ in range(6)], [b, b, b + 1, 2, 3, b]) for b in range(8)
    ]
    queries = [_text(rng, 8) for _ in range(40)] + [r["prompt"] for r in recs[:6]]
    tok = WordTokenizer(WORDS)
    return {"jsonl": path, "adds": adds, "queries": queries, "tok": tok, "enc": HashedNgramEncoder(DIM)}


def _all_steps(data) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Keys, group ids and segments of every step in insertion (= payload id) order: the off-policy ones as
    StepTraces.from_jsonl stores them, then the on-policy batches."""
    off = StepTraces.from_jsonl(data["jsonl"], data["enc"], data["tok"], top_k=TOP_K, capacity=CAP)
    hs = [h for b in data["adds"] for h in b[0]]
    steps = [s for b in data["adds"] for s in b[1]]
    keys = torch.cat([off.buffer.embeddings.float(), data["enc"]([strip_retrieve_markers(h) for h in hs])])
    groups = torch.cat([off.buffer.group_ids, torch.tensor([g for b in data["adds"] for g in b[2]])])
    new = [data["tok"].encode(f"{RETRIEVE_OPEN} {s} {RETRIEVE_CLOSE}") for s in steps]
    segs = list(off.payloads.values()) + new  # every off-policy step is live (36 < CAP), in id order
    return keys, groups, segs


def _state(n: int, n_off: int, cap: int) -> torch.Tensor:
    """The payload ids held after n steps were added to `cap` slots, the first n_off being the off-policy source's:
    those are pinned (StepTraces' default), so the on-policy steps take turns in the other cap - n_off slots (fifo)."""
    assert n_off < cap
    return torch.tensor(list(range(n_off)) + list(range(max(n_off, n - (cap - n_off)), n)))


def _matches(res, q: torch.Tensor, excl: int, keys, groups, segs, ids: torch.Tensor) -> bool:
    """res = (segment, payload id, score) is a float64 brute-force top-1 of the steps `ids` (ties within TOL)."""
    seg, pid, score = res
    s = scores_ref(keys[ids], q[None], "cosine")[0]
    s = torch.where(groups[ids] == excl, torch.full_like(s, float("-inf")), s) if excl >= 0 else s
    top = float(s.max())
    if pid < 0:
        return top == float("-inf") and seg is None
    where = (ids == pid).nonzero().flatten()
    return len(where) == 1 and abs(score - top) <= TOL and float(s[where[0]]) >= top - TOL and seg == segs[pid]


@ray.remote(num_cpus=0)
def _searcher(name: str, queries: list[str], excls: list[int], rounds: int) -> list:
    client = get_step_buffer(name)

    async def go():
        out = []
        for _ in range(rounds):  # each round: one request per query, all in flight at once
            rows = await asyncio.gather(*(client.retrieve([h], [e]) for h, e in zip(queries, excls)))
            out.extend((h, e, r[0]) for h, e, r in zip(queries, excls, rows))
            await asyncio.sleep(0.01)
        return out

    return asyncio.run(go())


@ray.remote(num_cpus=0)
def _adder(name: str, adds: list) -> int:
    client = get_step_buffer(name)

    async def go():
        for hs, steps, groups in adds:
            await client.add_steps(hs, steps, groups)
            await asyncio.sleep(0.02)

    asyncio.run(go())
    return len(adds)


def _excls(queries: list[str], seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([-1, 2, 3, OFFPOLICY_GROUP_BASE + 1, OFFPOLICY_GROUP_BASE + 4]) for _ in queries]


def test_concurrent_search_while_adding_matches_a_held_state(data):
    name = "rapo_test_concurrent"
    client = _make(name, data["jsonl"], tokenizer=data["tok"], top_k=TOP_K, capacity=CAP, window_s=0.005)
    qs = data["queries"]
    searchers = [_searcher.remote(name, qs, _excls(qs, i), 4) for i in range(2)]
    adder = _adder.remote(name, data["adds"])

    async def local():  # a third client, in this process, through the same handles
        rows = await asyncio.gather(*(client.retrieve([h, h], [e, -1]) for h, e in zip(qs, _excls(qs, 9))))
        return [(h, e, r[0]) for h, e, r in zip(qs, _excls(qs, 9), rows)]

    results = asyncio.run(local())
    assert ray.get(adder) == len(data["adds"])
    for s in ray.get(searchers):
        results.extend(s)
    results.extend(asyncio.run(local()))  # after every add: the final, wrapped state

    keys, groups, segs = _all_steps(data)
    n_off = keys.shape[0] - sum(len(b[0]) for b in data["adds"])
    states = [_state(n_off + 6 * j, n_off, CAP) for j in range(len(data["adds"]) + 1)]
    assert keys.shape[0] > CAP  # the ring wrapped
    qkeys = dict(zip(qs, data["enc"](qs)))
    for h, e, res in results:
        assert any(_matches(res, qkeys[h], e, keys, groups, segs, ids) for ids in states), (h, e, res)
    # the last round ran on the final state
    assert all(_matches(res, qkeys[h], e, keys, groups, segs, states[-1]) for h, e, res in results[-len(qs) :])
    (st,) = client.stats()
    # the payloads held are the live steps' (docs/retrieval.md, "Memory bounds"), not all keys.shape[0] ever added
    assert st["steps_added"] == 48 and st["size"] == CAP and st["payloads"] == CAP
    # each process's concurrent retrieves reached the actor as a few coalesced requests, searched in <= as many calls
    assert st["search_calls"] <= st["requests"] < len(results) // 4, st
    assert st["queries"] == sum(2 if i < len(qs) or i >= len(results) - len(qs) else 1 for i in range(len(results)))


def test_replicas_answer_every_search_as_the_primary(data):
    """Two replicas on the node; two processes add concurrently (the primary numbers the writes, the replicas apply
    them in that order) while two search; then every replica answers every query as the primary does."""
    name = "rapo_test_replicas"
    client = _make(name, data["jsonl"], tokenizer=data["tok"], top_k=TOP_K, capacity=CAP, replicas_per_node=2)
    (reps,) = client.replicas
    assert [n for n, _ in reps] == [ray.get_runtime_context().get_node_id()] * 2
    assert len(get_step_buffer(name).replicas[0]) == 2  # the workers' lookup finds them through the primary
    qs, half = data["queries"], len(data["adds"]) // 2
    searchers = [_searcher.remote(name, qs, _excls(qs, i), 2) for i in range(2)]
    adders = [_adder.remote(name, data["adds"][:half]), _adder.remote(name, data["adds"][half:])]
    assert sum(ray.get(adders)) == len(data["adds"])
    ray.get(searchers)
    keys, ex = data["enc"](qs), _excls(qs, 11)
    want = ray.get(client.handles[0].retrieve.remote(keys, ex))
    assert ray.get([h.retrieve.remote(keys, ex) for _, h in reps]) == [want, want]
    primary, *replica_stats = client.stats()
    assert primary["steps_added"] == 48 and primary["size"] == CAP  # the ring wrapped
    for st in replica_stats:
        assert st["role"] == "replica" and {k: st[k] for k in ("size", "payloads", "steps_added")} == {
            k: primary[k] for k in ("size", "payloads", "steps_added")
        }
    # the searchers' retrieves went to the replicas; the primary served only the comparison above
    assert primary["requests"] == 1 and sum(st["requests"] for st in replica_stats) >= 2 + 2


def test_save_new_actor_load_gives_identical_results(data, tmp_path):
    a = _make("rapo_test_save", data["jsonl"], tokenizer=data["tok"], top_k=TOP_K, capacity=CAP)
    for hs, steps, groups in data["adds"][:5]:
        asyncio.run(a.add_steps(hs, steps, groups))
    a.save(tmp_path / "ckpt")
    qs, ex = data["queries"], _excls(data["queries"], 3)
    want = asyncio.run(a.retrieve(qs, ex))
    # a new actor built from the JSONL alone, then loaded; and one created from the save directly
    b = _make("rapo_test_load", data["jsonl"], tokenizer=data["tok"], top_k=TOP_K, capacity=CAP)
    assert asyncio.run(b.retrieve(qs, ex)) != want
    b.load(tmp_path / "ckpt")
    c = _make("rapo_test_restore", tmp_path / "ckpt", tokenizer=data["tok"])
    assert asyncio.run(b.retrieve(qs, ex)) == want
    assert asyncio.run(c.retrieve(qs, ex)) == want
    assert [s["payloads"] for s in (a.stats() + b.stats() + c.stats())] == [min(36 + 30, CAP)] * 3  # the live ones
    with pytest.raises(ValueError, match="exclude_groups"):
        asyncio.run(a.retrieve(qs, [1]))
    with pytest.raises(ValueError, match="tokenizer: expected one"):
        get_or_create_step_buffer("rapo_test_absent", data["jsonl"])
    with pytest.raises(ValueError, match="source"):
        get_or_create_step_buffer("rapo_test_absent", tmp_path / "missing.jsonl", tokenizer=data["tok"])
    with pytest.raises(ValueError, match="num_shards"):
        _make("rapo_test_bad", tmp_path / "ckpt", tokenizer=data["tok"], num_shards=2)


def test_the_buffer_outlives_the_client_that_created_it(data):
    """The creator keeps only the name (as the e2e's driver and the bench do): the actors live on, found by name."""
    import gc
    import time

    get_or_create_step_buffer("rapo_test_owned", data["jsonl"], tokenizer=data["tok"], num_cpus=0, replicas_per_node=1)
    gc.collect()
    time.sleep(1.0)  # Ray kills an actor whose creator dropped every handle within this, when nothing holds it
    client = get_step_buffer("rapo_test_owned")
    _CREATED.append(client)
    assert asyncio.run(client.retrieve(data["queries"][:2]))[0][1] >= 0
    assert [s["role"] for s in client.stats()] == ["primary", "replica"]


def test_two_shards_equal_brute_force_over_their_union(data, tmp_path):
    build_step_buffer_from_jsonl(
        data["jsonl"], tmp_path / "built", data["tok"], encoder=f"hashed:{DIM}", num_shards=2, top_k=TOP_K, capacity=256
    )
    client = _make("rapo_test_shards", tmp_path / "built", tokenizer=data["tok"], num_shards=2)
    assert client.num_shards == 2 and get_step_buffer("rapo_test_shards").num_shards == 2
    for hs, steps, groups in data["adds"][:3]:
        asyncio.run(client.add_steps(hs, steps, groups))
    by_parity = [sum(g % 2 == p for b in data["adds"][:3] for g in b[2]) for p in (0, 1)]
    assert [s["steps_added"] for s in client.stats()] == by_parity  # shard = group id % 2
    keys, groups, segs = _all_steps(data)
    n = keys.shape[0] - 5 * 6  # off-policy + the 3 batches added: all held (no eviction at 128 slots per shard)
    qs, ex = data["queries"], _excls(data["queries"], 5)
    rows = asyncio.run(client.retrieve(qs, ex))
    qkeys = data["enc"](qs)
    for q, e, (seg, _gid, score) in zip(qkeys, ex, rows):
        # the global payload id is local * 2 + shard: check the segment and the score, not the id, against the union
        ids = torch.arange(n)
        match = [i for i in range(n) if segs[i] == seg]
        assert match and any(_matches((seg, i, score), q, e, keys, groups, segs, ids) for i in match)
    client.save(tmp_path / "saved")
    again = _make("rapo_test_shards2", tmp_path / "saved", tokenizer=data["tok"], num_shards=2)
    assert asyncio.run(again.retrieve(qs, ex)) == rows


def _hf_tokenizer_dir(path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<bos>", RETRIEVE_OPEN, RETRIEVE_CLOSE, *WORDS])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<bos>").save_pretrained(path)
    return str(path)


def test_verl_checkpoint_callback_saves_and_a_new_job_restores(data, tmp_path):
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

    tok_dir = _hf_tokenizer_dir(tmp_path / "tok")
    argv = ["--jsonl", str(data["jsonl"]), "--out", str(tmp_path / "built"), "--tokenizer", tok_dir]
    assert main([*argv, "--encoder", f"hashed:{DIM}", "--top-k", str(TOP_K)]) == 0  # the one-time build's CLI

    def config(name: str):
        return OmegaConf.create(
            {
                "trainer": {
                    "resume_mode": "auto",
                    "default_local_dir": str(tmp_path / "ckpts"),
                    "checkpoint_callback_class": CALLBACK,
                },
                "actor_rollout_ref": {"model": {"path": tok_dir, "tokenizer_path": None}},
                "rapo": {
                    "buffer_name": name,  # the agent loop's key names the buffer too
                    "step_buffer": {
                        "path": str(tmp_path / "built"),
                        "encoder": f"hashed:{DIM}",
                        "num_cpus": 0,
                        "replicas_per_node": 1,  # saved from the primary: a replica refuses save
                    },
                },
            }
        )

    cb = build_checkpoint_callback(config("rapo_test_job1"))  # verl's own loader, by the configured name
    _CREATED.append(cb.client)
    assert len(cb.client.replicas[0]) == 1
    asyncio.run(cb.client.add_steps(*data["adds"][0]))
    step_dir = tmp_path / "ckpts" / "global_step_3"
    step_dir.mkdir(parents=True)
    (tmp_path / "ckpts" / "latest_checkpointed_iteration.txt").write_text("3")  # verl writes it before on_save
    cb.on_save(trainer=None, global_step=3, checkpoint_dir=str(step_dir), async_save=False)
    qs, ex = data["queries"], _excls(data["queries"], 7)
    want = asyncio.run(cb.client.retrieve(qs, ex))
    assert want[0][0][0] == 2 and want[0][0][-1] == 3  # <retrieve> ... </retrieve>, no BOS: the HF path branch

    cb2 = build_checkpoint_callback(config("rapo_test_job2"))  # a resumed job: restored from global_step_3
    _CREATED.append(cb2.client)
    assert asyncio.run(cb2.client.retrieve(qs, ex)) == want  # searched on job 2's replica, built from the save
    assert [s["payloads"] for s in cb2.client.stats()] == [cb.client.stats()[0]["payloads"]] * 2

    (tmp_path / "ckpts" / "global_step_5").mkdir()
    (tmp_path / "ckpts" / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(FileNotFoundError, match="allow_missing_on_resume"):
        build_checkpoint_callback(config("rapo_test_job3"))


def test_onpolicy_steps_follow_the_trainers_rule():
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    prompt, resp = [1, 2], list(range(10, 20))
    spans, obs_end = [[0, 3], [5, 7], [8, 10]], [5, 8, 10]  # the last step is the answer (no tool response)
    hist, steps = onpolicy_steps(prompt, resp, spans, obs_end, 1.0, decode)
    assert hist == ["1 2", "1 2 10 11 12 13 14"]
    assert steps == ["10 11 12 13 14", "15 16 17"]
    assert onpolicy_steps(prompt, resp, spans, obs_end, 0.5, decode) == ([], [])  # not a success
    with pytest.raises(ValueError, match=r"step_spans: expected in the response, got \[0, 3\) obs_end 11"):
        onpolicy_steps(prompt, resp, [[0, 3]], [11], 1.0, decode)


def test_add_steps_counts_what_a_full_pinned_buffer_dropped(data):
    """A buffer its off-policy source fills (36 pinned steps, capacity 36) keeps the source and drops the
    policy's new steps: add_steps returns 0 stored and the actor's counters say steps_dropped, not steps_added."""
    c = _make("rapo_test_full_pinned", data["jsonl"], tokenizer=data["tok"], top_k=TOP_K, capacity=36)
    hs, steps, groups = data["adds"][0]
    assert asyncio.run(c.add_steps(hs, steps, groups)) == 0
    (st,) = c.stats()
    assert st["steps_added"] == 0 and st["steps_dropped"] == len(steps) and st["size"] == 36


async def _poll(cond, timeout_s: float = 45.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached in time"
        await asyncio.sleep(0.1)


def test_replicas_killed_under_traffic_one_for_good_one_restarted(data):
    """Two replicas; while this process searches (8 callers) and adds, one replica is killed for good and the other
    killed and restarted by Ray. No search and no add fails; each add is reported stored (6 steps) and stored once;
    the dead replica is counted lost, the restarted one caught up by its primary and found again by the client."""
    name = "rapo_test_replica_faults"
    _make(
        name,
        data["jsonl"],
        tokenizer=data["tok"],
        top_k=TOP_K,
        capacity=CAP,
        replicas_per_node=2,
        replica_timeout_s=5.0,
    )
    client = get_step_buffer(name, timeout_s=10.0, refresh_s=0.5)
    (reps,) = client.replicas
    (dead, _), (restarted, _) = [(h, n) for n, h in reps]
    qs, ex = data["queries"], _excls(data["queries"], 13)

    async def go():
        stop = asyncio.Event()

        async def searcher(i: int) -> int:
            n = 0
            while not stop.is_set():
                (row,) = await client.retrieve([qs[(i + n) % len(qs)]], [ex[(i + n) % len(qs)]])
                assert row[1] >= 0
                n += 1
            return n

        async def adder() -> list[int]:
            out = []
            for k, (hs, steps, groups) in enumerate(data["adds"]):
                if k == 2:
                    ray.kill(dead)
                    ray.kill(restarted, no_restart=False)
                out.append(await client.add_steps(hs, steps, groups))
            stop.set()
            return out

        *served, stored = await asyncio.gather(*(searcher(i) for i in range(8)), adder())
        assert stored == [6] * len(data["adds"]) and min(served) >= 1

        async def settled() -> bool:
            st = await client.handles[0].stats.remote()
            return st["replicas_lost"] == 1 and st["replicas_stale"] == 0 and st["replica_resyncs"] >= 1

        await _poll(settled)

        async def found_again() -> bool:  # the client re-reads the primary's serving replicas every refresh_s
            await client.retrieve(qs[:1], ex[:1])
            return any(h._actor_id == restarted._actor_id for h in client._readers.order(0)[:-1])

        await _poll(found_again)
        return await asyncio.gather(*(client.retrieve([q], [e]) for q, e in zip(qs, ex)))

    rows = asyncio.run(go())
    primary, *replica_stats = client.stats()
    assert primary["steps_added"] == 48 and primary["add_calls"] == 8 and primary["repeated_adds"] == 0
    assert [s["replicas_serving"] for s in replica_stats] == [1]  # the restarted one, in step again
    keys = data["enc"](qs)
    want = ray.get(client.handles[0].retrieve.remote(keys, ex))
    assert ray.get(restarted.retrieve.remote(keys, ex)) == want
    assert [r[0] for r in rows] == [tuple(x) for x in zip(*want)]
