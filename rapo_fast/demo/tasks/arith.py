"""Chain arithmetic with a calculator tool: the synthetic multi-step tool task of the demo and the tests.

A problem is a start value and a chain of 2-4 operations, e.g. `calc 7 add 5 mul 3 sub 4`; values live modulo 100.
The agent solves it one step per operation, each step a (thought, tool call, observation) triple:

    <think> add 5 <tool> 7 + 5 </tool> <obs> 12 </obs>

and ends with `<answer> 32 <eos>`. The policy never does arithmetic itself (the tool does); it must pick the next
operation in order and carry the last observed value forward, so steps of one problem are informative for others
with a similar history (the same chain prefix). What this is not: a benchmark of reasoning; it is small enough that
a ~200k-parameter policy learns it on a CPU in minutes.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rapo_fast._checks import check_int
from rapo_fast.demo.tiny_policy import WordTokenizer

OPS: dict[str, str] = {"add": "+", "sub": "-", "mul": "*"}
_SYMBOL_TO_OP = {v: k for k, v in OPS.items()}


@dataclass(frozen=True)
class Problem:
    """One query: `qid` (its prompt-group id), the start value and the chain of (operation, argument) pairs."""

    qid: int
    start: int
    ops: tuple[tuple[str, int], ...]
    modulus: int = 100

    def values(self) -> list[int]:
        """The running values after each operation (the last one is the answer)."""
        out, v = [], self.start
        for op, arg in self.ops:
            v = apply_op(op, v, arg, self.modulus)
            out.append(v)
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    @property
    def prompt(self) -> str:
        return "<bos> calc " + str(self.start) + " " + " ".join(f"{op} {arg}" for op, arg in self.ops)


def apply_op(op: str, a: int, b: int, modulus: int = 100) -> int:
    if op == "add":
        return (a + b) % modulus
    if op == "sub":
        return (a - b) % modulus
    if op == "mul":
        return (a * b) % modulus
    raise ValueError(f"apply_op: op: expected one of {sorted(OPS)}, got {op!r}")


class ChainArithmeticTask:
    """Generator, tool executor and verifier of the chain-arithmetic task.

    Args: modulus (values are in [0, modulus), each a single token), min_ops..max_ops operations per problem,
    arguments in [1, max_arg].
    """

    tool_end = "</tool>"
    answer_start = "<answer>"

    def __init__(self, modulus: int = 100, min_ops: int = 2, max_ops: int = 4, max_arg: int = 9):
        check_int("ChainArithmeticTask: modulus", modulus, lo=2, hi=1000)
        check_int("ChainArithmeticTask: min_ops", min_ops, lo=1, hi=16)
        check_int("ChainArithmeticTask: max_ops", max_ops, lo=min_ops, hi=16)
        check_int("ChainArithmeticTask: max_arg", max_arg, lo=1, hi=modulus - 1)
        self.modulus, self.min_ops, self.max_ops, self.max_arg = modulus, min_ops, max_ops, max_arg

    # -- vocabulary -------------------------------------------------------------------------------------------------
    def words(self) -> list[str]:
        return ["calc", "error", *OPS, *OPS.values(), *(str(i) for i in range(self.modulus))]

    def tokenizer(self) -> WordTokenizer:
        return WordTokenizer(self.words())

    # -- generation -------------------------------------------------------------------------------------------------
    def make_problems(self, n: int, seed: int, start_qid: int = 0) -> list[Problem]:
        """`n` random problems from `seed` (deterministic), with qids start_qid .. start_qid + n - 1."""
        check_int("make_problems: n", n, lo=0)
        rng = random.Random(seed)
        out = []
        for i in range(n):
            k = rng.randint(self.min_ops, self.max_ops)
            ops = tuple((rng.choice(list(OPS)), rng.randint(1, self.max_arg)) for _ in range(k))
            out.append(Problem(start_qid + i, rng.randrange(self.modulus), ops, self.modulus))
        return out

    @staticmethod
    def step_text(op: str, arg: int, current: int, result: int) -> str:
        """One step: thought (the operation to do), tool call, observation."""
        return f"<think> {op} {arg} <tool> {current} {OPS[op]} {arg} </tool> <obs> {result} </obs>"

    @staticmethod
    def answer_text(value: int | str) -> str:
        return f"<answer> {value} <eos>"

    def solution(self, problem: Problem) -> list[str]:
        """The correct steps followed by the answer step."""
        steps, v = [], problem.start
        for op, arg in problem.ops:
            r = apply_op(op, v, arg, self.modulus)
            steps.append(self.step_text(op, arg, v, r))
            v = r
        return steps + [self.answer_text(v)]

    # -- tool and verifier ------------------------------------------------------------------------------------------
    def execute(self, call: str) -> str:
        """The calculator: the text between <tool> and </tool> (e.g. `7 + 5`) -> the observation `<obs> 12 </obs>`.

        A malformed call (wrong arity, unknown operator, a non-number) observes `error`.
        """
        parts = call.replace("<tool>", " ").replace("</tool>", " ").split()
        if len(parts) == 3 and parts[1] in _SYMBOL_TO_OP and parts[0].isdigit() and parts[2].isdigit():
            a, b = int(parts[0]), int(parts[2])
            if a < self.modulus and b < self.modulus:
                return f"<obs> {apply_op(_SYMBOL_TO_OP[parts[1]], a, b, self.modulus)} </obs>"
        return "<obs> error </obs>"

    def verify(self, problem: Problem, completion: str) -> float:
        """Outcome reward: 1.0 when the completion's first `<answer> X` has X == the problem's answer, else 0.0."""
        m = re.search(r"<answer>\s+(\S+)", completion)
        return 1.0 if m is not None and m.group(1) == str(problem.answer) else 0.0
