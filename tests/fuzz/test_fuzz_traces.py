"""Property tests of `StepTraces` (hypothesis; budget in tests/helpers/strategies.py), with the hashed n-gram encoder
and a word tokenizer, on random histories and steps.

Properties: retrieve returns, per history, the step whose key scores best in a float64 brute force over the stored
keys (up to ties within rounding), with that step's own token segment; save then load retrieves identically; bad
arguments get a ValueError/TypeError naming them; add_steps with arguments mixing good values and bad ones (negative,
past-int64, bool and float group ids, NaN/inf scores, non-str texts, an encoder that returns NaN) either succeeds or
raises ValueError/TypeError leaving the traces exactly as before, and after any call the traces save and load back to
the same state. Not here: JSONL reading and K/V (tests/retrieval/test_step_traces.py).
"""

from __future__ import annotations

import random
import tempfile

import pytest
import torch
from helpers.strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from rapo_fast import StepBuffer, StepTraces
from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.reference.retrieval import scores_ref
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import write_jsonl

WORDS = ["calc", "add", "mul", "1", "2", "3", "x", "y", "=", "tool"]


texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)


def _traces(capacity: int = 16) -> StepTraces:
    enc = HashedNgramEncoder(dim=16)
    return StepTraces(StepBuffer(capacity, 16, dtype=torch.float32, metric="cosine"), enc, WordTokenizer(WORDS))


@fuzz_settings(30)
@given(
    steps=st.lists(st.tuples(texts, texts, st.integers(0, 3)), min_size=1, max_size=8),
    queries=st.lists(texts, min_size=1, max_size=4),
    exclude=st.booleans(),
)
def test_retrieve_is_the_brute_force_best_and_survives_save_load(steps, queries, exclude):
    tr = _traces()
    pids = tr.add_steps([h for h, _, _ in steps], [s for _, s, _ in steps], [g for _, _, g in steps])
    assert pids.tolist() == list(range(len(steps)))
    excl = [i % 4 for i in range(len(queries))] if exclude else None
    segs, got, scores = tr.retrieve(queries, exclude_groups=excl)
    keys = tr.buffer.embeddings.double()
    q = tr.encoder(queries).double()
    S = scores_ref(keys, q, "cosine")
    if excl is not None:
        S = S.masked_fill(tr.buffer.group_ids.view(1, -1) == torch.tensor(excl).view(-1, 1), float("-inf"))
    best = S.max(dim=1).values
    for r in range(len(queries)):
        if best[r] == float("-inf"):
            assert got[r] == -1 and segs[r] is None
            continue
        slot = tr.buffer.payload_ids.tolist().index(int(got[r]))
        assert S[r, slot] >= best[r] - 1e-5, "not the best step (beyond rounding)"
        assert abs(float(scores[r]) - float(S[r, slot])) <= 1e-5
        assert segs[r] == tr.payloads[int(got[r])]
    with tempfile.TemporaryDirectory() as tmp:
        tr.save(tmp)
        back = StepTraces.load(tmp, tr.encoder, tr.tokenizer)
    segs2, got2, scores2 = back.retrieve(queries, exclude_groups=excl)
    assert segs2 == segs and torch.equal(got2, got) and torch.equal(scores2, scores)
    assert (back.num_offpolicy, back.num_onpolicy, len(back)) == (tr.num_offpolicy, tr.num_onpolicy, len(tr))


@fuzz_settings(20)
@given(n_hist=st.integers(0, 12), n_steps=st.integers(0, 12), n_groups=st.integers(0, 12))
def test_add_steps_with_mismatched_lengths_is_refused(n_hist, n_steps, n_groups):
    tr = _traces()
    args = (["calc 1"] * n_hist, ["add 2"] * n_steps, [0] * n_groups)
    if n_hist == n_steps == n_groups:
        assert len(tr.add_steps(*args)) == n_hist
    else:
        with pytest.raises(ValueError, match="histories|steps|group_ids"):
            tr.add_steps(*args)


@fuzz_settings(20)
@given(n_excl=st.integers(0, 40), k_queries=st.integers(1, 40))
def test_retrieve_with_a_wrong_exclude_list_is_refused(n_excl, k_queries):
    tr = _traces()
    tr.add_steps(["calc 1", "calc 2"], ["add 1", "mul 2"], [0, 1])
    if n_excl == k_queries:
        segs, _, _ = tr.retrieve(["calc 1"] * k_queries, exclude_groups=[5] * n_excl)
        assert len(segs) == k_queries
    else:
        with pytest.raises(ValueError, match="exclude_groups"):
            tr.retrieve(["calc 1"] * k_queries, exclude_groups=[5] * n_excl)


# ---- add_steps is all or nothing, and load reads back whatever was saved --------------------------------------------

AON_WORDS = [f"w{i}" for i in range(50)]


class _Encoder:
    """HashedNgramEncoder, except that a history holding "nanword" encodes to NaN (a key `load` would refuse)."""

    def __init__(self):
        self.inner, self.dim = HashedNgramEncoder(16), 16

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
            "prompt": " ".join(rng.choices(AON_WORDS, k=5)),
            "steps": [" ".join(rng.choices(AON_WORDS, k=3)) for _ in range(2)],
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


_text = st.lists(st.sampled_from(AON_WORDS + ["nanword"]), min_size=1, max_size=4).map(" ".join)
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


@fuzz_settings(40)
@given(calls=st.lists(_add_steps_args(), min_size=1, max_size=3))
def test_step_traces_add_steps_all_or_nothing(jsonl, tmp_path_factory, calls):
    torch.manual_seed(0)
    traces = StepTraces.from_jsonl(jsonl, _Encoder(), WordTokenizer(AON_WORDS), top_k=2, capacity=12, metric="cosine")
    for hist, steps, groups, scores in calls:
        before = _traces_state(traces)
        try:
            traces.add_steps(hist, steps, groups, scores)
        except (ValueError, TypeError):
            assert _same(_traces_state(traces), before)
        d = tmp_path_factory.mktemp("save")
        traces.save(d)
        back = StepTraces.load(d, _Encoder(), WordTokenizer(AON_WORDS))
        assert _same(_traces_state(back), _traces_state(traces))


def test_step_traces_refused_group_id_leaves_nothing_behind(jsonl, tmp_path):
    """A negative or past-int64 group id used to leave its payload appended (the object
    then saved but never loaded again)."""
    traces = StepTraces.from_jsonl(jsonl, _Encoder(), WordTokenizer(AON_WORDS), top_k=2)
    before = _traces_state(traces)
    for g, err in ((-1, ValueError), (2**63, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(err, match="group_ids"):
            traces.add_steps(["w1 w2"], ["w3"], [g])
        assert _same(_traces_state(traces), before)
    with pytest.raises(ValueError, match="encoder"):
        traces.add_steps(["w1 nanword"], ["w3"], [1])
    assert _same(_traces_state(traces), before)
    traces.save(tmp_path / "s")
    StepTraces.load(tmp_path / "s", _Encoder(), WordTokenizer(AON_WORDS))
