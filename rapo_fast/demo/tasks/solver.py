"""A scripted off-policy solver for the chain-arithmetic task, writing JSONL trajectories with rewards.

What this is: the "off-policy agent" whose trajectories seed the step buffer (docs/retrieval.md section 6: several
trajectories per query, some wrong). Each step of a trajectory goes wrong with probability `error_rate` (a wrong
argument, a stale value carried forward, or the wrong operation); the tool then executes the wrong call faithfully,
so the trajectory stays self-consistent and its final answer is wrong. Rewards come from the task's verifier.
What it is not: a policy; it reads the problem's ground truth.

JSONL record (one per trajectory): {"query_id": int, "prompt": str, "steps": [str, ...], "answer": str,
"reward": float}; `steps` are the (thought, tool call, observation) steps, `answer` the final answer step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rapo_fast._checks import check_float, check_int
from rapo_fast.demo.tasks.arith import OPS, ChainArithmeticTask, Problem, apply_op
from rapo_fast.retrieval.jsonl import read_jsonl, write_jsonl  # noqa: F401  (re-exported)


def solve(task: ChainArithmeticTask, problem: Problem, rng: random.Random, error_rate: float) -> dict:
    """One trajectory of the scripted solver on `problem` (see the module docstring for the record)."""
    steps, v, prev = [], problem.start, problem.start
    for op, arg in problem.ops:
        cur_op, cur_arg, cur_v = op, arg, v
        if rng.random() < error_rate:
            kind = rng.randrange(3)
            if kind == 0:
                cur_arg = arg % task.max_arg + 1  # a different argument in [1, max_arg]
            elif kind == 1:
                cur_v = prev  # carries a stale value forward
            else:
                cur_op = rng.choice([o for o in OPS if o != op])
        r = apply_op(cur_op, cur_v, cur_arg, task.modulus)
        steps.append(task.step_text(cur_op, cur_arg, cur_v, r))
        prev, v = v, r
    answer = task.answer_text(v)
    completion = " ".join(steps + [answer])
    return {
        "query_id": problem.qid,
        "prompt": problem.prompt,
        "steps": steps,
        "answer": answer,
        "reward": task.verify(problem, completion),
    }


def solver_trajectories(
    task: ChainArithmeticTask,
    problems: Sequence[Problem],
    n_per_query: int = 16,
    error_rate: float = 0.2,
    seed: int = 0,
) -> list[dict]:
    """`n_per_query` scripted trajectories for each problem (deterministic given `seed`)."""
    check_int("solver_trajectories: n_per_query", n_per_query, lo=1)
    error_rate = check_float("solver_trajectories: error_rate", error_rate, min_value=0.0, max_value=1.0)
    rng = random.Random(seed)
    return [solve(task, p, rng, float(error_rate)) for p in problems for _ in range(n_per_query)]
