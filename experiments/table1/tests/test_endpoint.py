"""table1's continuous endpoint (experiments/table1/endpoint.py) against a hand computation on a tiny policy: the
log-probability of the correct hops read token by token from one unbatched forward, duplicates counted once, the
same number whatever the batch, no weights or mode changed."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.table1.endpoint import correct_tokens, distinct_questions, heldout_logp, question_logprobs
from experiments.table1.families import RL_CHAINS
from experiments.table1.kb_alias import AliasKBTask
from rapo_fast.demo.tiny_policy import build_tiny_policy


@pytest.fixture(scope="module")
def setup():
    task = AliasKBTask(chains=RL_CHAINS)
    tok = task.tokenizer()
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0)
    return task, tok, model


def _by_hand(model, tok, task, p) -> float:
    """One unbatched forward over the whole text; the policy's tokens are every token after the prompt that is not
    inside <obs> ... </obs> (the tool's observation, brackets included)."""
    words = (p.prompt + " " + " ".join(task.solution(p))).split()
    ids = tok.encode(" ".join(words))
    assert ids[0] == tok.bos_token_id  # the prompt carries its <bos>
    n_prompt = len(p.prompt.split())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    total, in_obs = 0.0, False
    for t in range(n_prompt, len(ids)):
        w = words[t]
        if w == "<obs>":
            in_obs = True
        if not in_obs:
            total += float(logp[t - 1, ids[t]])
        if w == "</obs>":
            in_obs = False
    return total


def test_matches_the_sum_of_log_softmax_at_the_targets(setup):
    task, tok, model = setup
    probs = task.make_problems(6, seed=3)
    got = question_logprobs(model, tok, task, probs, batch_size=4)  # two batches, padded rows
    assert set(got) == {p.prompt for p in probs}
    for p in probs:
        assert got[p.prompt] == pytest.approx(_by_hand(model, tok, task, p), abs=1e-4)
        assert got[p.prompt] < 0.0
    # a 3-hop question: 3 x (<think> r <tool> search r e </tool>: 7 tokens) + <answer> e <eos>: 24 policy tokens;
    # the prompt (<bos> ask alias e: 4) and 3 observations (<obs> e </obs>: 3 each) are given
    ids, scored = correct_tokens(task, tok, probs[0])
    assert len(probs[0].relations) == 3 and sum(scored) == 24 and len(ids) - sum(scored) == 4 + 9


def test_each_distinct_question_counts_once(setup):
    task, tok, model = setup
    a, b = task.make_problems(2, seed=11)
    assert a.prompt != b.prompt
    per = question_logprobs(model, tok, task, [a, b])
    assert per[a.prompt] != pytest.approx(per[b.prompt])  # else the weighting below could not show
    repeated = [a, a, a, b, a]  # the evaluation draws repeat questions: a five times would weigh 4 to 1
    assert distinct_questions(repeated) == [a, b]
    assert heldout_logp(model, tok, task, repeated) == pytest.approx((per[a.prompt] + per[b.prompt]) / 2)
    weighted = (4 * per[a.prompt] + per[b.prompt]) / 5
    assert heldout_logp(model, tok, task, repeated) != pytest.approx(weighted)
    # a copy of a question under another qid is the same question
    twin = type(a)(a.qid + 1000, a.start, a.relations, a.path, a.alias, a.hints)
    assert len(question_logprobs(model, tok, task, [a, twin, b])) == 2


def test_deterministic_whatever_the_batch_and_leaves_the_model_as_it_was(setup):
    task, tok, model = setup
    probs = task.make_problems(20, seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    x1 = heldout_logp(model, tok, task, probs, batch_size=1)
    x64 = heldout_logp(model, tok, task, probs, batch_size=64)
    assert x64 == heldout_logp(model, tok, task, probs, batch_size=64)  # no sampling: bit for bit
    assert x1 == pytest.approx(x64, abs=1e-4) and math.isfinite(x64)
    assert model.training  # its mode is restored
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_input_is_refused(setup):
    task, tok, model = setup
    with pytest.raises(ValueError, match="problems is empty"):
        heldout_logp(model, tok, task, [])
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        question_logprobs(model, tok, task, task.make_problems(2, seed=0), batch_size=0)
