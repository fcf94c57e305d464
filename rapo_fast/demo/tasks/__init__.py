"""Synthetic multi-step tool tasks shipped with the package (no downloads), used by the demo and the tests.

`arith`: chain arithmetic with a calculator tool (generator, tool executor, verifier); `solver`: a scripted
off-policy solver writing JSONL trajectories with rewards (some wrong) that seed the step buffer.
"""

from rapo_fast.demo.tasks.arith import ChainArithmeticTask, Problem
from rapo_fast.demo.tasks.solver import read_jsonl, solver_trajectories, write_jsonl

__all__ = [
    "ChainArithmeticTask",
    "Problem",
    "read_jsonl",
    "solver_trajectories",
    "write_jsonl",
]
