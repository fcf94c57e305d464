"""Tests of the synthetic chain-arithmetic task, its tokenizer, the tiny policy and the scripted off-policy solver."""

import json

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask, read_jsonl, solver_trajectories, write_jsonl
from rapo_fast.demo.tasks.arith import apply_op
from rapo_fast.demo.tiny_policy import SPECIAL_TOKENS, WordTokenizer, build_tiny_policy, lm_head_weight


def test_problem_answer_follows_the_chain():
    task = ChainArithmeticTask()
    for p in task.make_problems(50, seed=1):
        assert task.min_ops <= len(p.ops) <= task.max_ops
        v = p.start
        for op, arg in p.ops:
            v = {"add": v + arg, "sub": v - arg, "mul": v * arg}[op] % 100
        assert p.answer == v
        assert task.verify(p, " ".join(task.solution(p))) == 1.0
        assert task.verify(p, task.answer_text((v + 1) % 100)) == 0.0
        assert task.verify(p, "<think> add 1") == 0.0  # no answer at all


def test_problems_are_deterministic_per_seed():
    task = ChainArithmeticTask()
    assert task.make_problems(10, seed=3) == task.make_problems(10, seed=3)
    assert task.make_problems(10, seed=3) != task.make_problems(10, seed=4)


def test_tool_executes_and_rejects_malformed_calls():
    task = ChainArithmeticTask()
    assert task.execute("7 + 5") == "<obs> 12 </obs>"
    assert task.execute("3 - 5") == f"<obs> {apply_op('sub', 3, 5)} </obs>"
    assert task.execute("<tool> 12 * 9 </tool>") == "<obs> 8 </obs>"
    for bad in ("7 +", "7 / 5", "x + 1", "7 + 5 + 1", "100 + 1"):
        assert task.execute(bad) == "<obs> error </obs>"


def test_tokenizer_round_trip_and_specials(tmp_path):
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    assert tok.vocab[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    text = " ".join([task.make_problems(1, 0)[0].prompt] + task.solution(task.make_problems(1, 0)[0]))
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("banana")[0] == tok.unk_token_id
    tok.save(tmp_path / "tok.json")
    assert WordTokenizer.load(tmp_path / "tok.json").vocab == tok.vocab
    with pytest.raises(ValueError, match="words"):
        WordTokenizer(["two words"])
    with pytest.raises(TypeError, match="text"):
        tok.encode(3)


def test_tiny_policy_builds_and_scores():
    tok = ChainArithmeticTask().tokenizer()
    model = build_tiny_policy(tok.vocab_size, seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 50_000 < n < 1_000_000
    ids = torch.tensor([tok.encode("<bos> calc 1 add 2")])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, tok.vocab_size)
    assert lm_head_weight(model).shape == (tok.vocab_size, 96)
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_policy(tok.vocab_size, hidden_size=90, num_heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_policy(0)


def test_solver_writes_jsonl_with_rewards_some_wrong(tmp_path):
    task = ChainArithmeticTask()
    problems = task.make_problems(8, seed=0)
    recs = solver_trajectories(task, problems, n_per_query=16, error_rate=0.2, seed=0)
    assert len(recs) == 8 * 16
    rewards = [r["reward"] for r in recs]
    assert 0 < sum(rewards) < len(rewards)  # some right, some wrong
    by_q = {p.qid: p for p in problems}
    for r in recs:
        p = by_q[r["query_id"]]
        # the reward is the verifier's, and every observation is what the tool returns for the call before it
        assert r["reward"] == task.verify(p, " ".join(r["steps"] + [r["answer"]]))
        for step in r["steps"]:
            call = step.split("<tool>")[1].split("</tool>")[0]
            assert step.endswith(task.execute(call))
    path = write_jsonl(recs, tmp_path / "traj.jsonl")
    assert read_jsonl(path) == json.loads(json.dumps(recs))
    (tmp_path / "bad.jsonl").write_text('{"query_id": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_jsonl(tmp_path / "bad.jsonl")


def test_task_rejects_bad_config():
    with pytest.raises(ValueError, match=r"max_ops: expected an int in \[3, 16\], got 2"):
        ChainArithmeticTask(min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="modulus"):
        ChainArithmeticTask(modulus=1)
    with pytest.raises(ValueError, match="error_rate"):
        solver_trajectories(ChainArithmeticTask(), [], error_rate=2.0)
