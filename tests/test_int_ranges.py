"""No silent narrowing. Every integer argument is range-checked for the width it is cast to, with a
ValueError naming it; ids that collide with a sentinel are refused.

- `rapo_fast::kv_splice_` (rapo_fast/kv/splice.py) reads the block table as int32: an int64 table with a value past
  int32 (2^32 + 1 used to become block 1) is refused naming `block_table`, and nothing is written.
- Past-int64 Python ints in `exclude_groups` (StepTraces.retrieve), `group_ids` (StepTraces.add_steps) and
  `rope_positions` (splice_kv, insert_segment) raise ValueError naming the argument (not torch's "Overflow when
  unpacking long long"); hypothesis checks the boundary on both sides.
- `StepBuffer.add` refuses negative payload ids: -1 is the padding of search results.
- The extension's entry points (csrc/*_bindings.cpp) name the scalar argument a past-int64 value was given for.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from rapo_fast import _ext
from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.kv.splice import PagedKVCache, RopeSpec, StepKVStore, kv_splice_, splice_kv
from rapo_fast.retrieval.buffer import StepBuffer
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import write_jsonl
from rapo_fast.retrieval.step_traces import StepTraces

needs_splice_ext = pytest.mark.skipif(
    not (_ext.has_extension() and hasattr(_ext.extension(), "kv_splice_cpu")), reason="rapo_fast._C without kv_splice"
)
I64 = 2**63
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LAYERS, HEADS, D = 2, 2, 16


@needs_splice_ext
@pytest.mark.parametrize("bad", [2**32 + 1, 2**31, -(2**31) - 1, 2**40])
def test_kv_splice_op_refuses_int64_block_table_past_int32(bad):
    torch.manual_seed(0)
    k_pool, v_pool = torch.randn(LAYERS, 10, HEADS, D), torch.randn(LAYERS, 10, HEADS, D)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    keys = [torch.zeros(4, 4, HEADS, D) for _ in range(LAYERS)]
    values = [torch.zeros(4, 4, HEADS, D) for _ in range(LAYERS)]
    req = torch.tensor([[0, 4, 0, 0, 0]])  # row 0, slots 0..3: block_table[0, 0]
    bt = torch.tensor([[bad, 2], [3, 0]], dtype=torch.int64)
    with pytest.raises(ValueError, match="block_table"):
        kv_splice_(keys, values, k_pool, v_pool, req, inv, bt, False, 4)
    assert all(not k.any() for k in keys + values), "a refused call must write nothing"
    # the same table within int32 still works
    kv_splice_(keys, values, k_pool, v_pool, req, inv, torch.tensor([[1, 2], [3, 0]]), False, 4)
    assert torch.equal(values[0][1], v_pool[0, :4])


def test_splice_kv_paged_int64_block_table_past_int32_refused():
    """splice_kv itself: an unused entry past int32 in an int64 table is refused too (the whole table is narrowed)."""
    torch.manual_seed(0)
    store = StepKVStore(LAYERS, HEADS, D, dtype=torch.float32)
    store.add([7], [torch.randn(LAYERS, 3, HEADS, D)], [torch.randn(LAYERS, 3, HEADS, D)])
    ks = [torch.zeros(4, 4, HEADS, D) for _ in range(LAYERS)]
    vs = [torch.zeros(4, 4, HEADS, D) for _ in range(LAYERS)]
    cache = PagedKVCache(ks, vs, torch.tensor([[0, 1], [2, 2**32 + 3]], dtype=torch.int64))
    with pytest.raises(ValueError, match="block_table"):
        splice_kv(cache, store, [(7, 0, 0)], RopeSpec.from_theta(D), backend="reference")
    assert all(not k.any() for k in ks)


def _hf_setup():
    store = StepKVStore(LAYERS, HEADS, D, dtype=torch.float32, capacity_tokens=16)
    store.add([100], [torch.randn(LAYERS, 4, HEADS, D)], [torch.randn(LAYERS, 4, HEADS, D)])
    cache = DynamicCache(ddp_cache_data=[(torch.zeros(1, HEADS, 10, D), torch.zeros(1, HEADS, 10, D))] * LAYERS)
    return store, cache, RopeSpec.from_theta(D)


@SETTINGS
@given(delta=st.one_of(st.integers(I64 - 4, I64 + 4), st.integers(I64, 2**200)))
def test_rope_positions_past_int64_name_the_argument(delta):
    torch.manual_seed(0)
    store, cache, rope = _hf_setup()
    if delta < I64:
        splice_kv(cache, store, [(100, 0, 0)], rope, rope_positions=[delta], backend="reference")
        return
    with pytest.raises(ValueError, match=r"rope_positions\[0\]"):
        splice_kv(cache, store, [(100, 0, 0)], rope, rope_positions=[delta], backend="reference")


def test_insert_segment_rope_positions_past_int64():
    from rapo_fast.kv.splice import insert_segment

    class _Model(torch.nn.Module):  # never called: the check comes first
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

    store, cache, rope = _hf_setup()
    with pytest.raises(ValueError, match=r"rope_positions\[0\]"):
        insert_segment(
            _Model(), cache, [[1, 2]], [0], [0], store=store, payload_ids=[100], rope=rope, rope_positions=[2**70]
        )


@pytest.fixture(scope="module")
def traces_path(tmp_path_factory):
    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)]
    recs = [
        {
            "query_id": q,
            "prompt": " ".join(rng.choices(words, k=4)),
            "steps": ["w1 w2", "w3"],
            "answer": "",
            "reward": 1,
        }
        for q in range(3)
    ]
    return write_jsonl(recs, tmp_path_factory.mktemp("t") / "t.jsonl"), WordTokenizer(words)


@SETTINGS
@given(g=st.one_of(st.integers(I64 - 3, I64 + 3), st.integers(-I64 - 3, -I64 + 3), st.integers(2**64, 2**300)))
def test_exclude_groups_and_group_ids_past_int64(traces_path, g):
    torch.manual_seed(0)
    path, tok = traces_path
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(32), tok, top_k=2)
    if -I64 <= g < I64:
        traces.retrieve(["w1 w2"], [g])
    else:
        with pytest.raises(ValueError, match=r"exclude_groups\[0\]"):
            traces.retrieve(["w1 w2"], [g])
    n = len(traces)
    if 0 <= g < I64:
        traces.add_steps(["w1"], ["w2"], [g])
        assert len(traces) == n + 1
    else:
        with pytest.raises(ValueError, match=r"group_ids\[0\]"):
            traces.add_steps(["w1"], ["w2"], [g])
        assert len(traces) == n


@SETTINGS
@given(pid=st.integers(-(2**62), -1))
def test_step_buffer_refuses_negative_payload_ids(pid):
    torch.manual_seed(0)
    buf = StepBuffer(8, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="payload_ids"):
        buf.add(torch.randn(2, 4), torch.tensor([3, pid]), torch.tensor([0, 1]))
    assert len(buf) == 0
    buf.add(torch.randn(2, 4), torch.tensor([3, 0]), torch.tensor([0, 1]))
    _, pids = buf.search(torch.randn(1, 4), 4)
    assert sorted(pids[0, :2].tolist()) == [0, 3] and pids[0, 2:].tolist() == [-1, -1]


@pytest.mark.skipif(not _ext.has_extension(), reason="rapo_fast._C not built")
def test_extension_params_name_the_field():
    C = _ext.extension()
    t = torch.zeros(1, 2)
    i64 = torch.zeros(1, dtype=torch.int64)
    scalars = dict(metric=0, min_score=0.0, num_threads=1, isa=-1)
    with pytest.raises(TypeError, match=r"retrieval_search_cpu: k: expected an int that fits"):
        C.retrieval_search_cpu(t, t[0], i64, t, None, None, t, t, k=2**70, **scalars)
    if hasattr(C, "kv_splice_cpu"):
        pool = torch.zeros(1, 1, 1, 2)
        req = torch.zeros(0, 5, dtype=torch.int64)
        with pytest.raises(TypeError, match=r"kv_splice_cpu: max_tokens: expected an int that fits"):
            C.kv_splice_cpu([pool], [pool], pool, pool, req, torch.zeros(1), None, interleaved=False, max_tokens=2**64)
