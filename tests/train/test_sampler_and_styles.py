"""Two of the trainer's extension points: RAPOTrainer's `task_sampler` (each step's env and problems from a callable,
e.g. fresh facts per step) and sft_examples' retrieve style (a callable deciding what a retrieved block shows).
Not here: the trainer's step itself (test_trainer.py).
"""

import random

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.rollouts.batch import KIND_GEN, KIND_RET
from rapo_fast.train.sft import hint_step, replace_step, sft_examples
from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig


class _Env(ChainArithmeticTask):
    """Counts the verifier's calls, so a test can tell which env a step scored its rollouts in."""

    def __init__(self):
        super().__init__()
        self.verified = 0

    def verify(self, problem, completion):
        self.verified += 1
        return super().verify(problem, completion)


def test_task_sampler_gives_each_step_its_env_and_problems(monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    base = _Env()
    tok = base.tokenizer()
    envs = [_Env() for _ in range(3)]
    asked: list[int] = []

    def sampler(step: int):
        asked.append(step)
        return envs[step], envs[step].make_problems(2, seed=step, start_qid=1000 * step)

    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    cfg = TrainerConfig.GRPO({"rollout.group_size": 2, "rollout.max_steps": 2, "prompts_per_step": 4})
    trainer = RAPOTrainer(model, tok, base, None, cfg, base.make_problems(8, seed=0), task_sampler=sampler)
    for step in range(3):
        trainer.step()
        assert trainer.env is envs[step]
        assert {p.qid // 1000 for p in trainer.last_problems} == {step} and len(trainer.last_problems) == 2
    assert asked == [0, 1, 2]
    assert base.verified == 0 and [e.verified for e in envs] == [4, 4, 4]  # 2 problems x G=2 in each step's env


def test_task_sampler_must_be_callable():
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    with pytest.raises(TypeError, match="task_sampler: expected a callable or None, got list"):
        RAPOTrainer(model, tok, task, None, TrainerConfig.GRPO(), task.make_problems(2, seed=0), task_sampler=[])


def _kinds(style, frac=1.0):
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    problems = [p for p in task.make_problems(16, seed=0) if len(task.solution(p)) >= 4][:2]
    assert problems
    return task, problems, sft_examples(task, tok, problems, frac, random.Random(0), style)


def test_retrieve_styles_replace_or_precede_the_policy_step():
    task, problems, replaced = _kinds(replace_step)
    _, _, hinted = _kinds(hint_step)
    (open_id,) = task.tokenizer().encode("<retrieve>")
    for p, (ids_r, kinds_r), (ids_h, kinds_h) in zip(problems, replaced, hinted):
        n_retrievable = len(task.solution(p)) - 2  # neither the first step nor the answer
        assert ids_r.count(open_id) == ids_h.count(open_id) == n_retrievable
        # the hint style keeps the policy's own copy of each retrieved step: more trained tokens, longer rows
        assert sum(k == KIND_GEN for k in kinds_h) > sum(k == KIND_GEN for k in kinds_r)
        assert len(ids_h) > len(ids_r)


def test_refused_steps_are_never_shown_retrieved():
    def only_k1(problem, k, solution):
        return replace_step(problem, k, solution) if k == 1 else None

    task, problems, got = _kinds(only_k1)
    tok = task.tokenizer()
    for p, (ids, kinds) in zip(problems, got):
        ret = torch.tensor(kinds) == KIND_RET
        shown = tok.decode(torch.tensor(ids)[ret].tolist())
        assert shown.count("<retrieve>") == 1 and task.solution(p)[1].split()[0] in shown
    with pytest.raises(TypeError, match="style: expected a callable"):
        sft_examples(task, tok, problems, 1.0, random.Random(0), "replace")
