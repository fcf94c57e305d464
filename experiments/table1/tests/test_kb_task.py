"""Tests of the knowledge-base (multi-hop search) task family: generation, search tool, verifier, scripted solver,
and that the rollout, the step buffer and the SFT warm-up run on it unchanged."""

import json
import random

import pytest
import torch

from experiments.table1.kb import RELATIONS, KnowledgeBaseTask, kb_solver_trajectories
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import read_jsonl, write_jsonl
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.batch import KIND_GEN, KIND_RET, KIND_TOOL
from rapo_fast.rollouts.config import RolloutConfig
from rapo_fast.rollouts.loop import rollout
from rapo_fast.train.sft import sft_examples, sft_warmup


@pytest.fixture(scope="module")
def task():
    return KnowledgeBaseTask()


def _wrong_variants(task, p):
    """Completions that must score 0: a wrong entity, stopping one hop early, the relations in written order, the
    answer of a single search on the prompt's entity, no answer at all."""
    inner_first = list(p.relations)
    yield task.answer_text(next(e for e in task.entity_type if e != p.answer))
    yield " ".join(task.solution(p)[:-2] + [task.answer_text(p.path[-2])])
    written = task.walk(p.start, list(reversed(inner_first)))
    if written[-1] != p.answer:
        yield task.answer_text(written[-1])
    for r in RELATIONS:
        yield task.answer_text(task.execute(f"search {r} {p.start}").split()[1])
    yield " ".join(task.solution(p)[:-1])


def test_solutions_verify_and_wrong_variants_do_not(task):
    problems = task.make_problems(200, seed=1)
    assert {len(p.relations) for p in problems} == {2, 3}
    for p in problems:
        sol = task.solution(p)
        assert len(sol) == len(p.relations) + 1 and sol[-1] == f"<answer> {p.answer} <eos>"
        assert task.verify(p, " ".join(sol)) == 1.0
        for bad in _wrong_variants(task, p):
            assert task.verify(p, bad) == 0.0, bad
        for step in sol[:-1]:  # every observation is what the tool returns for the call before it
            call = step.split("<tool>")[1].split("</tool>")[0]
            assert step.endswith(task.execute(call))


def test_search_tool_returns_the_fact_none_or_error(task):
    person = task.entities["person"][0]
    city = task.facts[("born_in", person)]
    assert task.execute(f"search born_in {person}") == f"<obs> {city} </obs>"
    assert task.execute(f"<tool> search born_in {person} </tool>") == f"<obs> {city} </obs>"
    country = task.facts[("located_in", city)]
    assert task.execute(f"search located_in {city}") == f"<obs> {country} </obs>"
    assert task.facts[("located_in", task.facts[("capital", country)])] == country
    assert task.execute(f"search capital {person}") == "<obs> none </obs>"  # a person has no capital
    assert task.execute("search born_in none") == "<obs> none </obs>"
    for bad in (f"born_in {person}", f"search {person}", f"search born_in {person} x", f"search likes {person}"):
        assert task.execute(bad) == "<obs> error </obs>"


def test_questions_need_more_than_one_search(task):
    for p in task.make_problems(300, seed=2):
        prompt = p.prompt.split()
        assert prompt[:2] == ["<bos>", "ask"] and prompt[-1] == p.start
        assert prompt[2:-1] == list(reversed(p.relations))  # written outermost first, applied innermost first
        assert not set(p.path) & set(prompt)  # no intermediate entity (nor the answer) is in the prompt
        one_search = {task.execute(f"search {r} {e}").split()[1] for r in RELATIONS for e in prompt}
        assert p.answer not in one_search
        assert len(set(p.path)) == len(p.path)


def test_kb_and_problems_are_deterministic_per_seed(task):
    assert KnowledgeBaseTask(kb_seed=0).facts == task.facts
    assert KnowledgeBaseTask(kb_seed=1).facts != task.facts
    assert task.make_problems(20, seed=3) == task.make_problems(20, seed=3)
    assert task.make_problems(20, seed=3) != task.make_problems(20, seed=4)
    assert [p.qid for p in task.make_problems(3, seed=0, start_qid=7)] == [7, 8, 9]
    assert kb_solver_trajectories(task, task.make_problems(4, 0), 4, 0.3, seed=1) == kb_solver_trajectories(
        task, task.make_problems(4, 0), 4, 0.3, seed=1
    )


def test_hop_variants_share_the_kb_and_vocabulary(task):
    two, three = KnowledgeBaseTask(max_hops=2), KnowledgeBaseTask(min_hops=3, max_hops=3)
    assert two.facts == three.facts == task.facts and two.words() == three.words() == task.words()
    assert {len(p.relations) for p in two.make_problems(50, 0)} == {2}
    assert {len(p.relations) for p in three.make_problems(50, 0)} == {3}


def test_vocabulary_is_small_and_round_trips(task):
    tok = task.tokenizer()
    assert tok.vocab_size < 200
    p = task.make_problems(1, seed=0)[0]
    text = " ".join([p.prompt] + task.solution(p))
    assert tok.decode(tok.encode(text)) == text and tok.unk_token_id not in tok.encode(text)


def test_solver_errors_give_some_wrong_records_that_round_trip(task, tmp_path):
    problems = task.make_problems(8, seed=0)
    recs = kb_solver_trajectories(task, problems, n_per_query=16, error_rate=0.3, seed=0)
    assert len(recs) == 8 * 16
    rewards = [r["reward"] for r in recs]
    assert 0 < sum(rewards) < len(rewards)
    assert all(r["reward"] == 1.0 for r in kb_solver_trajectories(task, problems, 2, 0.0, seed=0))
    by_q = {p.qid: p for p in problems}
    for r in recs:
        p = by_q[r["query_id"]]
        assert r["prompt"] == p.prompt
        assert r["reward"] == task.verify(p, " ".join(r["steps"] + [r["answer"]]))
        for step in r["steps"]:
            call = step.split("<tool>")[1].split("</tool>")[0]
            assert step.endswith(task.execute(call))
    path = write_jsonl(recs, tmp_path / "kb.jsonl")
    assert read_jsonl(path) == json.loads(json.dumps(recs))
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), task.tokenizer(), top_k=4)
    assert len(traces.payloads) == sum(len(p.relations) for p in problems for _ in range(4))
    with pytest.raises(ValueError, match="error_rate"):
        kb_solver_trajectories(task, problems, error_rate=1.5)


def test_task_rejects_bad_config():
    with pytest.raises(ValueError, match="min_hops"):
        KnowledgeBaseTask(min_hops=1)
    with pytest.raises(ValueError, match="n_countries"):
        KnowledgeBaseTask(n_countries=20, n_cities=10)
    with pytest.raises(ValueError, match=r"n_people: expected an int in \[2, 500\], got 1"):
        KnowledgeBaseTask(n_people=1)


def test_rollout_hybrid_and_sft_run_on_the_task(task, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        tok = task.tokenizer()
        model = build_tiny_policy(tok.vocab_size, hidden_size=64, seed=0)
        losses = sft_warmup(model, tok, task, task.make_problems(64, seed=5, start_qid=5000), steps=40, batch_size=16)
        assert len(losses) == 40 and losses[-1] < losses[0] and all(torch.isfinite(torch.tensor(losses)))
        ids, kinds = sft_examples(task, tok, task.make_problems(1, seed=0), 0.0, random.Random(0))[0]
        assert tok.decode([i for i, k in zip(ids, kinds) if k == KIND_TOOL]).split()[1] in task.entity_type
        problems = task.make_problems(3, seed=0)
        path = write_jsonl(kb_solver_trajectories(task, problems, 4, 0.2, seed=0), tmp_path / "t.jsonl")
        traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, top_k=3)
        g = torch.Generator().manual_seed(1)
        cfg = RolloutConfig(group_size=4, max_steps=4, max_step_tokens=12, hybrid={"n_hybrid": 2, "retrieve_prob": 1.0})
        b = rollout(model, tok, task, problems, cfg, traces=traces, generator=g)
        assert b.batch_size == 12 and len(b.completions) == 12
        assert int((b.kinds == KIND_GEN).sum()) > 0
        assert int((b.kinds == KIND_RET).sum()) > 0 and int((b.kinds == KIND_TOOL).sum()) > 0  # not vacuous
        rewards = [task.verify(problems[int(i)], c) for i, c in zip(b.prompt_index, b.completions)]
        assert all(r in (0.0, 1.0) for r in rewards)
    finally:
        torch.set_num_threads(threads)
