"""Inputs that would cost far more than their size: each is refused, or loaded, at a cost bounded by its size.

A YAML alias bomb of a few hundred bytes (43 million items once expanded) given to each kind of config field is
refused in milliseconds with a short message (rapo_fast._checks.brief bounds every quoted value: a hypothesis
property checks it is repr(value) for small values and at most 100 characters always); a small snapshot
declaring 2^31 - 1 slots, or a key dimension of 2^31 - 1, and a K/V state declaring 2^31 - 1 tokens load within a
2 GB address-space limit (storage for what is stored, grown by later adds, which then behave as on a buffer never
saved); a trajectory of 900,000 steps is refused by the JSONL reader before any history is built.
Not here: malformed input of every other kind (test_loader_errors.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import reliability_states as rs
import torch
from helpers.strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from rapo_fast import StepBuffer
from rapo_fast._checks import brief
from rapo_fast.kv.store import StepKVStore
from rapo_fast.retrieval.io import write_snapshot
from rapo_fast.train.config import TrainerConfig

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
    max_leaves=30,
)


def _bomb(levels: int) -> str:
    """A YAML flow sequence of 9**levels items written in about 30 bytes a level (anchors, then aliases)."""
    parts = ["&l0 [x, x, x, x, x, x, x, x, x]"]
    parts += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize(
    "field", ["seed", "rollout.strategy", "optim.lr", "logging.log_csv", "loss.eps_high", "rollout.hybrid.n_hybrid"]
)
def test_a_yaml_alias_bomb_is_refused_cheaply(field):
    """8 levels: 43 million items once expanded (the repr of them all: hundreds of MB); refused within 1 s and 5 MB
    of Python allocations, with a message under 1 KB."""
    *parents, leaf = field.split(".")
    text = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents)) + f"{'  ' * len(parents)}{leaf}: {_bomb(8)}\n"
    assert len(text) < 600
    TrainerConfig.from_yaml("seed: 1\n")  # imports done before the measurements
    t0 = time.perf_counter()
    with pytest.raises((TypeError, ValueError)) as info:
        TrainerConfig.from_yaml(text)
    took = time.perf_counter() - t0
    tracemalloc.start()
    try:
        with pytest.raises((TypeError, ValueError)):
            TrainerConfig.from_yaml(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert field.split(".")[-1] in str(info.value) and len(str(info.value)) < 1000, str(info.value)[:300]
    assert took < 1.0 and peak < 5 * 2**20, (took, peak)


def test_brief_is_bounded_whatever_the_value():
    deep = [1]
    for _ in range(10_000):
        deep = [deep, deep]
    for v in (deep, {i: "x" * 10**6 for i in range(10)}, 10**10000, "y" * 10**7, b"z" * 10**7, set(range(10**5))):
        assert len(brief(v)) <= 100
    assert brief([1, "a", None]) == "[1, 'a', None]" and brief({"k": (1.5,)}) == "{'k': (1.5,)}"


def _small(v, depth: int = 3) -> bool:
    """Within brief's limits: no container of more than 4 items, none nested deeper than 3 levels, no str over 60
    characters, no int over 64 bits."""
    if isinstance(v, (list, dict)):
        items = list(v.values()) if isinstance(v, dict) else v
        return depth > 0 and len(items) <= 4 and all(_small(x, depth - 1) for x in items)
    if isinstance(v, int) and not isinstance(v, bool):
        return v.bit_length() <= 64
    return not isinstance(v, str) or len(v) <= 60


@fuzz_settings(60)
@given(v=json_values)
def test_brief_is_repr_when_small_and_bounded_always(v):
    out = brief(v)
    assert len(out) <= 100
    if _small(v) and len(repr(v)) <= 100:
        assert out == repr(v)


# Run in a fresh interpreter, not a fork: a process forked from pytest after torch started its threads can block
# forever on a lock one of them held.
_LIMITED = """
import os, resource, sys
from pathlib import Path
import torch
from rapo_fast import StepBuffer
from rapo_fast.kv.store import StepKVStore
d = Path(sys.argv[3])
exec(sys.argv[1])
vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
exec(sys.argv[2])
"""


def _under_memory_limit(setup: str, run: str, d: Path) -> None:
    """exec(setup), then exec(run) with the address space allowed to grow by 2 GB at most, in a new interpreter
    (`d`: the test's directory); fails with the child's error."""
    res = subprocess.run(
        [sys.executable, "-c", _LIMITED, setup, run, str(d)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert res.returncode == 0, f"under a 2 GB limit: {res.stderr[-2000:]}"


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc to set the memory limit")
def test_a_snapshot_declaring_huge_sizes_loads_in_what_it_stores(tmp_path):
    """capacity 2^31 - 1 (about 100 GB of slots if allocated) with 40 steps stored, and dim 2^31 - 1 with none."""
    buf = rs.buffer_case(capacity=64, n_old=40).obj
    buf.save(tmp_path / "cap")
    manifest_path = rs.live(tmp_path / "cap") / "meta.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["meta"]["capacity"] = 2**31 - 1
    manifest_path.write_text(json.dumps(manifest))
    rs.reseal(tmp_path / "cap")
    meta = {
        "capacity": 1,
        "dim": 2**31 - 1,
        "dtype": "float32",
        "metric": "ip",
        "eviction": "fifo",
        "size": 0,
        "head": 0,
        "next_seq": 0,
    }
    empty = {"keys": torch.empty(0, 2**31 - 1), "scores": torch.empty(0)}
    empty.update({k: torch.empty(0, dtype=torch.int64) for k in ("payload_ids", "group_ids", "seq")})
    write_snapshot(tmp_path / "dim", empty, meta)

    torch.save(buf.embeddings[:3].float(), tmp_path / "q.pt")
    run = """
big = StepBuffer.load(d / "cap")
assert big.capacity == 2**31 - 1 and len(big) == 40 and big.search(torch.load(d / "q.pt"), 5)
wide = StepBuffer.load(d / "dim")
assert wide.dim == 2**31 - 1 and len(wide) == 0
"""
    _under_memory_limit("", run, tmp_path)


def test_a_loaded_buffer_grows_as_one_never_saved(tmp_path):
    """The storage grown by adds after a load: the same slots, evictions and search results as the original's."""
    for eviction in ("fifo", "lowest_score"):
        g = torch.Generator().manual_seed(1)
        a = StepBuffer(64, 8, dtype=torch.float32, metric="l2", eviction=eviction)
        a.add(torch.randn(40, 8, generator=g), scores=torch.randn(40, generator=g))
        a.save(tmp_path / eviction)
        b = StepBuffer.load(tmp_path / eviction)
        for m in (3, 30, 50):
            keys, scores = torch.randn(m, 8, generator=g), torch.randn(m, generator=g)
            assert torch.equal(a.add(keys, scores=scores), b.add(keys, scores=scores))
            assert rs.buffer_fp(a) == rs.buffer_fp(b)
            q = torch.randn(5, 8, generator=g)
            assert all(torch.equal(x, y) for x, y in zip(a.search(q, 7), b.search(q, 7)))


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc to set the memory limit")
def test_a_kv_state_declaring_huge_capacity_loads_in_what_it_stores(tmp_path):
    """capacity_tokens 2^31 - 1 (64 GB of pools if allocated) with 10 tokens stored; adds after the load land where
    they land in the store that was saved."""
    src = rs.kv_store()
    src.evict([2])
    g = torch.Generator().manual_seed(1)
    state = src.state_dict()
    state["capacity_tokens"] = 2**31 - 1

    torch.save(state, tmp_path / "kv.pt")
    setup = 'state = torch.load(d / "kv.pt", weights_only=True); dst = StepKVStore(2, 1, 4, dtype=torch.float32)'
    run = "dst.load_state_dict(state); assert dst.capacity_tokens == 2**31 - 1 and dst.payload_ids() == [1, 7]"
    _under_memory_limit(setup, run, tmp_path)
    back = StepKVStore(2, 1, 4, dtype=torch.float32)
    back.load_state_dict(src.state_dict())
    more = [torch.randn(2, n, 1, 4, generator=g) for n in (4, 30)]
    for store in (src, back):
        store.add([3, 4], more, more, tokens=[[3] * 4, [4] * 30])
    for pid in (1, 3, 4, 7):
        assert src.locate(pid) == back.locate(pid) and torch.equal(src.get(pid)[0], back.get(pid)[0])
    assert src.capacity_tokens == back.capacity_tokens


def test_a_trajectory_of_900000_steps_is_refused_before_its_histories(tmp_path):
    """Its histories (prompt + the steps before, per step) would total about 10^12 characters."""
    from rapo_fast.retrieval.jsonl import read_jsonl
    from rapo_fast.retrieval.step_traces import StepTraces

    rec = {"query_id": 0, "prompt": "p", "steps": ["<think> s"] * 900_000, "answer": "a", "reward": 1.0}
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"long.jsonl:1: 'steps'.*900000"):
        read_jsonl(path)
    tok, enc = rs._tiny_world()
    with pytest.raises(ValueError, match=r"long.jsonl:1: 'steps'"):
        StepTraces.from_jsonl(path, enc, tok)
    assert time.perf_counter() - t0 < 10
