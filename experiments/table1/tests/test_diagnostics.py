"""Tests of experiments/table1/diagnostics.py: completions read against hand-written cases, the leak and
shortcut fractions, the kept-trace statistics and the go/no-go logic on constructed figures."""

from __future__ import annotations

import math
import random

import pytest

from experiments.table1 import diagnostics as D
from experiments.table1.kb import KnowledgeBaseTask, kb_solver_trajectories


@pytest.fixture(scope="module")
def task_and_problem():
    task = KnowledgeBaseTask(min_hops=3, max_hops=3)
    return task, task.make_problems(1, seed=3)[0]


def _ret(step: str) -> str:
    return f"<retrieve> {step} </retrieve>"


def test_read_completion_own_solution(task_and_problem):
    task, p = task_and_problem
    r = D.read_completion(p, " ".join(task.solution(p)))
    assert r["success"] and D.signature(r) == "SSSA" and r["observed"] == list(p.path) and r["retrieved_obs"] == []


def test_read_completion_retrieved_hop_and_leak(task_and_problem):
    task, p = task_and_problem
    s = task.solution(p)
    # own hop 0, the last hop retrieved, then the answer copied from it: a leak
    leak = D.read_completion(p, " ".join([s[0], s[1], _ret(s[2]), s[3]]))
    assert D.signature(leak) == "SSRA" and leak["retrieved_obs"] == [p.answer]
    # a middle hop retrieved as a hint, then the policy's own copy of it and the last hop: no leak
    hint = D.read_completion(p, " ".join([s[0], _ret(s[1]), s[1], s[2], s[3]]))
    assert D.signature(hint) == "SRSSA"  # the own copy of the hinted hop counts as an own correct step
    assert D.leak_frac([leak]) == 1.0 and D.leak_frac([hint]) == 0.0 and D.leak_frac([leak, hint]) == 0.5
    # successes without any retrieval do not count; none at all: NaN
    own = D.read_completion(p, " ".join(s))
    assert D.leak_frac([own, hint]) == 0.0 and math.isnan(D.leak_frac([own]))


def test_read_completion_malformed_and_guessed(task_and_problem):
    task, p = task_and_problem
    junk = D.read_completion(p, "e3 <think> x <obs> <tool> search nope e1 </tool> <obs> error </obs> <answer> <tool>")
    assert D.signature(junk) == "sa" and not junk["success"]
    assert D.signature(D.read_completion(p, "<think> a <tool> search x y </tool> <obs> none </obs>")) == "s-"
    guess = D.read_completion(p, f"<answer> {p.answer} <eos>")
    assert guess["success"] and D.signature(guess) == "A"
    wrong = D.read_completion(p, "<answer> e0 <eos>" if p.answer != "e0" else "<answer> e1 <eos>")
    assert D.unobserved_success([guess, wrong]) == 0.5
    assert D.unobserved_success([D.read_completion(p, " ".join(task.solution(p)))]) == 0.0


def test_chance_level_and_bound(task_and_problem):
    task, _ = task_and_problem
    probs = task.make_problems(50, seed=1)
    c = D.chance_level(task, probs)
    sizes = {len(task.entities[t]) for t in task.entities}
    assert min(1 / s for s in sizes) <= c <= max(1 / s for s in sizes)
    assert D.chance_bound(0.05, 625) == pytest.approx(0.05 + 3 * math.sqrt(0.05 * 0.95 / 625))


def test_kept_trace_stats_by_hand():
    recs = [
        {"query_id": 0, "steps": ["a"], "reward": 1.0},
        {"query_id": 0, "steps": ["a"], "reward": 1.0},
        {"query_id": 0, "steps": ["b"], "reward": 0.0},
        {"query_id": 1, "steps": ["c"], "reward": 0.0},
        {"query_id": 1, "steps": ["d"], "reward": 0.0},
    ]
    st = D.kept_trace_stats(recs, top_k=2)  # query 0 keeps the two correct copies; query 1 two wrong ones
    assert st == {"kept_trace_correct_frac": 0.5, "distinct_per_query": 1.5, "queries_without_correct": 0.5}


def test_step_dependent_solver_keeps_wrong_traces():
    task = KnowledgeBaseTask(min_hops=3, max_hops=3)
    probs = task.make_problems(40, seed=0)
    sloppy = D.kept_trace_stats(kb_solver_trajectories(task, probs, 16, [0.5, 0.05, 0.5], seed=0), 5)
    oracle = D.kept_trace_stats(kb_solver_trajectories(task, probs, 16, 0.05, seed=0), 5)
    assert sloppy["kept_trace_correct_frac"] < 0.8 < oracle["kept_trace_correct_frac"]


def test_go_no_go_constructed_cases():
    figures = {
        "unobserved_answer_success": {
            "a": {"value": 0.02, "chance": 0.03, "n": 625},
            "b": {"value": 0.20, "chance": 0.03, "n": 625},
        },
        "kept_trace_correct_frac": {"a": 0.6, "b": 0.99},
        "conditioning_probe": {
            "a": {"p_next_given_retrieved": 0.5, "p_next_given_own": 0.8},
            "b": {"p_next_given_retrieved": 0.1, "p_next_given_own": 0.8},
        },
        "leak_frac": {"a": 0.25, "b": 0.9, "c": math.nan},
    }
    c = D.go_no_go(figures)
    assert c["no_shortcut/a"]["pass"] and not c["no_shortcut/b"]["pass"]
    assert c["imperfect_source/a"]["pass"] and not c["imperfect_source/b"]["pass"]
    assert c["uses_retrieved_step/a"]["pass"] and not c["uses_retrieved_step/b"]["pass"]
    assert c["no_answer_leak/a"]["pass"] and not c["no_answer_leak/b"]["pass"] and c["no_answer_leak/c"]["pass"]
    # a policy that cannot even take its own next step is no evidence that it can use a retrieved one
    zero = D.go_no_go({"conditioning_probe": {"z": {"p_next_given_retrieved": 0.0, "p_next_given_own": 0.0}}})
    assert not zero["uses_retrieved_step/z"]["pass"]


def test_split_starts_and_fact_seed():
    task = KnowledgeBaseTask(min_hops=3, max_hops=3)
    train, held = task.split_starts(0.5, seed=0)
    assert not set(train) & set(held) and set(train) | set(held) == set(task.entity_type)
    a = task.make_problems(100, seed=0, starts=train)
    b = task.make_problems(100, seed=1, starts=held)
    assert {p.start for p in a} <= set(train) and {p.start for p in b} <= set(held)
    other = KnowledgeBaseTask(min_hops=3, max_hops=3, fact_seed=1000)
    assert other.entities == task.entities and other.facts != task.facts  # same types, other facts
    assert KnowledgeBaseTask(min_hops=3, max_hops=3, fact_seed=None).facts == task.facts  # default unchanged
    only = KnowledgeBaseTask(min_hops=3, max_hops=3, pattern_filter=lambda r: r[1] == "ceo")
    assert only.patterns and all(r[1] == "ceo" for r, _ in only.patterns)


def test_conditioning_probe_runs_on_a_policy():
    from rapo_fast.demo.tiny_policy import build_tiny_policy

    task = KnowledgeBaseTask(min_hops=3, max_hops=3)
    tok = task.tokenizer()
    model = build_tiny_policy(tok.vocab_size, seed=0, hidden_size=32, num_heads=2, num_kv_heads=1)
    pr = D.conditioning_probe(model, tok, task, task.make_problems(4, seed=random.Random(0).randrange(100)))
    assert pr["n"] == 4 * 2 and 0.0 <= pr["p_next_given_retrieved"] <= 1.0 and 0.0 <= pr["p_next_given_own"] <= 1.0
