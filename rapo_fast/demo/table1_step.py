"""The third round of table1's fair setting: the family `kb_alias_step` (`rapo-fast table1 --families kb_alias_step`).

What this is: `StepFamily`, the aliased knowledge base of AliasFamily with three changes (docs/table1_fair_design.md,
section "kb_alias_step"): (1) the facts are drawn again for every RL step (same entities and types, `fact_seed`), the
tool answering from that step's draw, and the held-out questions ask a draw of their own, so recalling a fact never
pays; (2) retrieval in the paper's form (rapo_fast/demo/tasks/kb_step.py AdvancingTraces: the retrieved step takes
the hop for this row), with a warm-up of 3-hop demonstrations showing such steps ("advance" blocks); (3) no retrieval
of the last hop or after it. `StepFactsTrainer` is the trainer that switches the draw per step. `StepHintFamily`
("kb_alias_step_hint") keeps kb_alias's hint form of retrieval on the same facts: the named variant.
What this is not: the runner (table1.py), the diagnostics it records (table1_step_checks.py), or kb_alias, which
stays as it was (its recorded run is quoted in the README).
"""

from __future__ import annotations

from functools import lru_cache

from rapo_fast.demo.table1_families import (
    HELD_OUT_FRAC,
    RL_CHAINS,
    SFT_DRAWS,
    SFT_PER_DRAW,
    AliasFamily,
    _Family,
)
from rapo_fast.train.trainer import RAPOTrainer

# Fact seeds, disjoint ranges: the warm-up's draws (10_000 + 100 seed + d, d < SFT_DRAWS, as AliasFamily), RAPO's
# source (20_000 + seed), the held-out draw (EVAL_FACTS + seed), the RL steps' (STEP_FACTS + 10_000 seed + step).
EVAL_FACTS, STEP_FACTS = 30_000, 1_000_000
STEP_QID = 1_000_000  # qids of step k's questions: STEP_QID + 1000 k + i (distinct over a run)
SFT_RETRIEVE_FRAC = 0.5  # the share of demonstrations whose middle hop is shown retrieved


@lru_cache(maxsize=256)
def _draw(fact_seed: int):
    from rapo_fast.demo.tasks.kb_alias import AliasKBTask

    return AliasKBTask(chains=RL_CHAINS, fact_seed=fact_seed)


class StepFactsTrainer(RAPOTrainer):
    """RAPOTrainer whose step k asks `step_problems(k)`'s questions in their own draw of the facts: `env` (the tool
    and the verifier) and the step buffer's `task` (the facts an advancing retrieved step is read from) follow."""

    def __init__(self, *args, step_problems, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_problems = step_problems

    def sample_problems(self) -> list:
        task, problems = self.step_problems(self.step_count)
        self.env = task
        if hasattr(self.buffer, "task"):
            self.buffer.task = task
        return problems


class StepFamily(AliasFamily):
    """kb_alias_step (module docstring)."""

    name = "kb_alias_step"
    retrieve_style = "advance"
    sft_retrieve_frac = SFT_RETRIEVE_FRAC
    gates_table = True  # a failing check withholds table1.md
    step_seeds = True  # the methods of a seed start each step from the same sampler state (table1_crn.py)

    def data(self, seed: int, s: dict) -> dict:
        """The held-out draw (fact seed EVAL_FACTS + seed) is `task`: held-out questions over held-out start
        entities, and `train`, questions over training start entities in the same draw (the warm-up diagnostics and
        the with-retrieval evaluation read them; no RL step asks them). `step(k)`: step k's (task, questions)."""
        task = _draw(EVAL_FACTS + seed)
        train_starts, held = task.split_starts(HELD_OUT_FRAC, seed=seed)  # by entity types only: every draw agrees
        train = task.make_problems(s["n_train"], seed=seed, starts=train_starts)
        evals = task.make_problems(s["n_eval"], seed=seed + 1, starts=held, start_qid=100_000)
        n = s["prompts_per_step"]

        def step(k: int):
            t = _draw(STEP_FACTS + 10_000 * seed + k)
            return t, t.make_problems(n, seed=10_000 * seed + k, starts=train_starts, start_qid=STEP_QID + 1000 * k)

        return {"task": task, "tok": task.tokenizer(), "train": train, "evals": evals, "step": step}

    def sft_pool(self, seed: int) -> list:
        """3-hop questions only (a policy shown 2-hop ones stops after two): by alias for the 6 non-RL 3-hop chains,
        explicitly for all 10; each draw of the facts its own (the seeds of AliasFamily.sft_pool)."""
        from rapo_fast.demo.tasks.kb_alias import chain_split

        sft_chains = [c for c in chain_split(RL_CHAINS)[0] if len(c) == 3]
        three = sft_chains + list(RL_CHAINS)
        pool: list = []
        for d in range(SFT_DRAWS):
            fs = 10_000 + 100 * seed + d
            pool += self.task(fs, sft_chains).make_problems(SFT_PER_DRAW, seed=d)
            pool += self.task(fs, three, by_alias=False).make_problems(SFT_PER_DRAW, seed=d + 777)
        return pool

    def offpolicy_source(self, data: dict, s: dict, seed: int) -> list[dict]:
        """The solver on every RL step's questions, each in its step's draw (OFFPOLICY_TRAJ's demonstrations of the
        same prompts, as AliasFamily's)."""
        from rapo_fast.demo.table1_families import SOLVER_ERROR_BY_HOP
        from rapo_fast.demo.tasks import kb_solver_trajectories

        out: list[dict] = []
        for k in range(s["rl_steps"]):
            t, qs = data["step"](k)
            out += kb_solver_trajectories(t, qs, s["solver_traces"], SOLVER_ERROR_BY_HOP, seed=seed + 7919 * k)
        return out

    def step_traces(self, jsonl, encoder, tok, top_k: int):
        from rapo_fast.demo.tasks.kb_step import AdvancingTraces

        return AdvancingTraces.from_jsonl(jsonl, encoder, tok, top_k=top_k)

    def trainer(self, data: dict, model, traces, cfg, offpolicy) -> RAPOTrainer:
        return StepFactsTrainer(
            model,
            data["tok"],
            data["task"],
            traces,
            cfg,
            data["train"],
            offpolicy=offpolicy,
            step_problems=data["step"],
        )


class StepHintFamily(StepFamily):
    """kb_alias_step_hint: the same per-step facts, with kb_alias's retrieval form instead of the paper's (a foreign
    step of the same relation as a hint, after which the policy takes the hop itself; retrieved at any hop, as in
    kb_alias; warm-up blocks "foreign" at 30%, as kb_alias's): the named variant to compare the tested form with."""

    name = "kb_alias_step_hint"
    retrieve_style = "foreign"
    step_traces = _Family.step_traces

    sft_retrieve_frac = 0.3


__all__ = ["StepFamily", "StepHintFamily", "StepFactsTrainer", "EVAL_FACTS", "STEP_FACTS"]
