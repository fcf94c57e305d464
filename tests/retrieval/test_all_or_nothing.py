"""Mutations are all or nothing, and what `add` accepts its own loader accepts.

Hypothesis drives `StepTraces.add_steps` (rapo_fast/retrieval/step_traces.py) and `StepKVStore.add`
(rapo_fast/kv/store.py) with arguments mixing good values and bad ones (negative, past-int64, bool and float ids,
NaN/inf scores and K/V, negative or non-int token ids, non-str texts, an encoder that returns NaN). Property: a refused
call raises ValueError/TypeError and leaves the state exactly as before; after any call, refused or not, the object
saves and its own loader reads the save back to the same state.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.kv.store import StepKVStore
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import write_jsonl
from rapo_fast.retrieval.step_traces import StepTraces

WORDS = [f"w{i}" for i in range(50)]
DIM = 16
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class _Encoder:
    """HashedNgramEncoder, except that a history holding "nanword" encodes to NaN (a key `load` would refuse)."""

    def __init__(self):
        self.inner, self.dim = HashedNgramEncoder(DIM), DIM

    def __call__(self, texts):
        out = self.inner(texts)
        bad = torch.tensor(["nanword" in t for t in texts])
        out[bad] = float("nan")
        return out


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    rng = random.Random(0)
    recs = [
        {
            "query_id": q,
            "prompt": " ".join(rng.choices(WORDS, k=5)),
            "steps": [" ".join(rng.choices(WORDS, k=3)) for _ in range(2)],
            "answer": "a",
            "reward": 1.0,
        }
        for q in range(4)
    ]
    return write_jsonl(recs, tmp_path_factory.mktemp("t") / "t.jsonl")


def _traces_state(t: StepTraces) -> tuple:
    b = t.buffer
    return (
        {p: list(s) for p, s in t.payloads.items()},
        t.num_offpolicy,
        t.num_onpolicy,
        len(b),
        b.embeddings.clone(),
        b.payload_ids.clone(),
        b.group_ids.clone(),
        b.scores.clone(),
    )


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


_text = st.lists(st.sampled_from(WORDS + ["nanword"]), min_size=1, max_size=4).map(" ".join)
_bad_text = st.one_of(_text, st.none(), st.integers())
_group = st.one_of(
    st.integers(0, 2**63 - 1), st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=True), st.none()
)
_score = st.one_of(st.floats(-10, 10), st.floats(allow_nan=True, allow_infinity=True), st.booleans())


@st.composite
def _add_steps_args(draw):
    n = draw(st.integers(0, 4))
    hist = draw(st.lists(st.one_of(_text, _text, _bad_text), min_size=n, max_size=n))
    steps = draw(st.lists(st.one_of(_text, _text, _bad_text), min_size=n, max_size=n + draw(st.integers(0, 1))))
    groups = draw(st.lists(st.one_of(st.integers(0, 99), _group), min_size=n, max_size=n))
    scores = draw(st.one_of(st.none(), st.lists(_score, min_size=n, max_size=n)))
    return hist, steps, groups, scores


@SETTINGS
@given(calls=st.lists(_add_steps_args(), min_size=1, max_size=3))
def test_step_traces_add_steps_all_or_nothing(jsonl, tmp_path_factory, calls):
    torch.manual_seed(0)
    traces = StepTraces.from_jsonl(jsonl, _Encoder(), WordTokenizer(WORDS), top_k=2, capacity=12, metric="cosine")
    for hist, steps, groups, scores in calls:
        before = _traces_state(traces)
        try:
            traces.add_steps(hist, steps, groups, scores)
        except (ValueError, TypeError):
            assert _same(_traces_state(traces), before)
        d = tmp_path_factory.mktemp("save")
        traces.save(d)
        back = StepTraces.load(d, _Encoder(), WordTokenizer(WORDS))
        assert _same(_traces_state(back), _traces_state(traces))


def test_step_traces_refused_group_id_leaves_nothing_behind(jsonl, tmp_path):
    """A negative or past-int64 group id used to leave its payload appended (the object
    then saved but never loaded again)."""
    traces = StepTraces.from_jsonl(jsonl, _Encoder(), WordTokenizer(WORDS), top_k=2)
    before = _traces_state(traces)
    for g, err in ((-1, ValueError), (2**63, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(err, match="group_ids"):
            traces.add_steps(["w1 w2"], ["w3"], [g])
        assert _same(_traces_state(traces), before)
    with pytest.raises(ValueError, match="encoder"):
        traces.add_steps(["w1 nanword"], ["w3"], [1])
    assert _same(_traces_state(traces), before)
    traces.save(tmp_path / "s")
    StepTraces.load(tmp_path / "s", _Encoder(), WordTokenizer(WORDS))


L, H, D = 2, 2, 4


def _kv(n: int, bad: str | None = None) -> torch.Tensor:
    t = torch.randn(L, n, H, D)
    if bad == "nan" and n:
        t[0, 0, 0, 0] = float("nan")
    if bad == "inf" and n:
        t[-1, -1, -1, -1] = float("inf")
    if bad == "big" and n:  # finite in fp32, inf once cast to the store's fp16
        t[0, 0, 0, 0] = 1e6
    return t


_pid = st.one_of(
    st.integers(0, 20), st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=True), st.just(3.0)
)
_tok = st.one_of(st.integers(0, 1000), st.integers(-5, -1), st.floats(0, 5), st.booleans(), st.just(2**70))


@st.composite
def _store_add_args(draw):
    n = draw(st.integers(0, 3))
    pids = draw(st.lists(st.one_of(st.integers(0, 20), _pid), min_size=n, max_size=n))
    lens = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    bads = draw(st.lists(st.sampled_from([None, None, None, "nan", "inf", "big"]), min_size=n, max_size=n))
    keys = [_kv(m, b) for m, b in zip(lens, bads)]
    values = [_kv(m, draw(st.sampled_from([None, None, "nan"]))) for m in lens]
    tokens = draw(
        st.one_of(
            st.none(),
            st.tuples(*[st.lists(st.one_of(st.integers(0, 99), _tok), min_size=m, max_size=m) for m in lens]).map(list),
        )
    )
    return pids, keys, values, tokens, draw(st.booleans())


def _store_state(s: StepKVStore) -> dict:
    return s.state_dict()


def _same_state(a: dict, b: dict) -> bool:
    return (
        a["where"] == b["where"]
        and a["tokens"] == b["tokens"]
        and a["capacity_tokens"] == b["capacity_tokens"]
        and torch.equal(a["keys"], b["keys"])
        and torch.equal(a["values"], b["values"])
    )


@SETTINGS
@given(calls=st.lists(_store_add_args(), min_size=1, max_size=4))
def test_kv_store_add_all_or_nothing(calls):
    torch.manual_seed(0)
    store = StepKVStore(L, H, D, dtype=torch.float16, capacity_tokens=4)
    for pids, keys, values, tokens, replace in calls:
        before = _store_state(store)
        try:
            store.add(pids, keys, values, tokens=tokens, replace=replace)
        except (ValueError, TypeError):
            assert _same_state(_store_state(store), before)
        # whatever add accepted, the loader accepts
        fresh = StepKVStore(L, H, D, dtype=torch.float16)
        fresh.load_state_dict(store.state_dict())
        assert _same_state(_store_state(fresh), _store_state(store))


def test_kv_store_add_refuses_what_load_refuses():
    torch.manual_seed(0)
    store = StepKVStore(L, H, D, dtype=torch.float32)
    k = torch.randn(L, 2, H, D)
    for args, kw, err, name in (
        (([1.7], [k], [k]), {}, TypeError, r"payload_ids\[0\]"),
        (([True], [k], [k]), {}, TypeError, r"payload_ids\[0\]"),
        (([-1], [k], [k]), {}, ValueError, r"payload_ids\[0\]"),
        (([2**64], [k], [k]), {}, ValueError, r"payload_ids\[0\]"),
        (([1], [_kv(2, "nan")], [k]), {}, ValueError, r"keys\[0\]"),
        (([1], [k], [_kv(2, "inf")]), {}, ValueError, r"values\[0\]"),
        (([1], [k], [k]), {"tokens": [[3, -1]]}, ValueError, r"tokens\[0\]\[1\]"),
        (([1], [k], [k]), {"tokens": [[3, 2.0]]}, TypeError, r"tokens\[0\]\[1\]"),
    ):
        with pytest.raises(err, match=name):
            store.add(*args, **kw)
        assert len(store) == 0
