"""Property tests of `StepTraces` (hypothesis; budget in tests/helpers/strategies.py), with the hashed n-gram encoder
and a word tokenizer, on random histories and steps.

Properties: retrieve returns, per history, the step whose key scores best in a float64 brute force over the stored
keys (up to ties within rounding), with that step's own token segment; save then load retrieves identically; bad
arguments get a ValueError/TypeError naming them. Not here: JSONL reading and K/V (tests/retrieval/test_step_traces.py).
"""

from __future__ import annotations

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
