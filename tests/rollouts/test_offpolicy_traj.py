"""Trajectory-level off-policy (LUFFY-style, the baseline): whole solver trajectories rendered in the rollout's
token format (model tokens KIND_OFF, tool output KIND_TOOL), placed as n_offpolicy members of each group by
`rollout(strategy="offpolicy_traj")`, and the trainer's loss on such a batch equal to a hand computation of the shaped
objective: on-policy tokens -A r (r = 1 at the first update), off-policy tokens -A p / (p + gamma), seq-mean-token-mean.
Not here: the shaped weight's own kernel tests (tests/loss) or step-level retrieval (test_rollout.py)."""

from __future__ import annotations

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy, final_hidden, lm_head_weight
from rapo_fast.rollouts.batch import KIND_GEN, KIND_OFF, KIND_PROMPT, KIND_TOOL
from rapo_fast.rollouts.config import RolloutConfig
from rapo_fast.rollouts.loop import rollout
from rapo_fast.rollouts.offpolicy import OffPolicyTrajectories, trajectory_tokens
from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig, default_rewards


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    problems = task.make_problems(3, seed=0)
    path = write_jsonl(
        solver_trajectories(task, problems[:2], 4, 0.2, seed=0), tmp_path_factory.mktemp("t") / "t.jsonl"
    )
    yield task, tok, problems, path
    torch.set_num_threads(n)


def test_trajectory_tokens_by_hand(world):
    _, tok, _, _ = world
    rec = {"steps": ["<think> sub 1 <tool> 38 - 1 </tool> <obs> 37 </obs>"], "answer": "<answer> 37 <eos>"}
    ids, kinds, steps = trajectory_tokens(rec, tok)
    model = tok.encode("<think> sub 1 <tool> 38 - 1 </tool>")
    obs = tok.encode("<obs> 37 </obs>")
    answer = tok.encode("<answer> 37 <eos>")
    assert ids == model + obs + answer
    assert kinds == [KIND_OFF] * len(model) + [KIND_TOOL] * len(obs) + [KIND_OFF] * len(answer)
    n1 = len(model) + len(obs)
    assert steps == [[0, len(model), n1], [n1, n1 + len(answer), n1 + len(answer)]]


def test_rollout_places_whole_trajectories_in_each_group(world):
    task, tok, problems, path = world
    off = OffPolicyTrajectories.from_jsonl(path, top_k=3)
    assert sorted(off.by_query) == [int(p.qid) for p in problems[:2]]  # problem 3 has no trajectory
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, seed=0)
    gen = torch.Generator().manual_seed(0)
    cfg = RolloutConfig(
        group_size=4,
        strategy="offpolicy_traj",
        hybrid={"n_hybrid": 0},
        offpolicy_traj={"n_offpolicy": 2},
        max_step_tokens=6,
        max_steps=2,
    )
    b = rollout(model, tok, task, problems, cfg, offpolicy=off, generator=gen, seed=3)
    per_group = {int(q): int(n) for q, n in zip(*torch.unique(b.group_ids, return_counts=True))}
    assert per_group == {int(p.qid): 4 for p in problems}  # G members per group, off-policy ones included
    offq = b.group_ids[b.offpolicy_rows].tolist()
    assert sorted(offq) == sorted([int(problems[0].qid)] * 2 + [int(problems[1].qid)] * 2)  # none for problem 3
    for i in torch.nonzero(b.offpolicy_rows).squeeze(1).tolist():
        k = b.kinds[i]
        assert not (k == KIND_GEN).any() and (k[: int(b.prompt_len[i])] == KIND_PROMPT).all()
        assert b.loss_mask[i].sum() == (k == KIND_OFF).sum() and b.retrieved_mask[i].sum() == (k == KIND_OFF).sum()
        assert b.retrieved_fraction()[i] == 0  # no retrieved step: F = 0
        assert (b.behav_logp[i] == 0).all() and not b.hybrid[i]
        assert b.completions[i] in {" ".join(r["steps"] + [r["answer"]]) for r in off.by_query[int(b.group_ids[i])]}
    assert (default_rewards(task, problems, b)[b.offpolicy_rows] == 1).all()  # the solver's top trajectories


def test_bad_offpolicy_arguments(world):
    task, tok, problems, path = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, seed=0)
    off = OffPolicyTrajectories.from_jsonl(path)
    kw = dict(group_size=4, strategy="offpolicy_traj", hybrid={"n_hybrid": 0})
    with pytest.raises(ValueError, match="offpolicy"):
        rollout(model, tok, task, problems, RolloutConfig(**kw))
    for bad, err in ((0, ValueError), (4, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(err, match="n_offpolicy"):
            rollout(model, tok, task, problems, RolloutConfig(**kw, offpolicy_traj={"n_offpolicy": bad}), offpolicy=off)
    with pytest.raises(ValueError, match="top_k"):
        OffPolicyTrajectories([], top_k=0)
    with pytest.raises(ValueError, match="n_offpolicy"):
        TrainerConfig.OFFPOLICY_TRAJ({"rollout.group_size": 2, "rollout.offpolicy_traj.n_offpolicy": 2})
    with pytest.raises(ValueError, match="offpolicy"):
        RAPOTrainer(model, tok, task, None, TrainerConfig.OFFPOLICY_TRAJ({"rollout.group_size": 4}), problems)


def test_trainer_loss_equals_the_shaped_objective_by_hand(world, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    task, tok, problems, path = world
    off = OffPolicyTrajectories.from_jsonl(path, top_k=3)
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, seed=1)
    cfg = TrainerConfig.OFFPOLICY_TRAJ(
        {
            "rollout.group_size": 4,
            "rollout.offpolicy_traj.n_offpolicy": 1,
            "prompts_per_step": 2,
            "rollout.max_step_tokens": 6,
            "rollout.max_steps": 2,
            "optim.lr": 1e-3,
            "seed": 0,
        }
    )
    fixed = rollout(
        model, tok, task, problems[:2], cfg.rollout, offpolicy=off, generator=torch.Generator().manual_seed(1), seed=1
    )
    rewards = default_rewards(task, problems[:2], fixed)
    assert rewards[fixed.offpolicy_rows].eq(1).all() and rewards[~fixed.offpolicy_rows].lt(1).any()
    # the hand computation, in fp64, from the model as it is before the step
    with torch.no_grad():
        h = final_hidden(model, fixed.input_ids, fixed.attention_mask)[:, :-1].double()
        logp_all = torch.log_softmax(h @ lm_head_weight(model).double().T, -1)
    logp = logp_all.gather(-1, fixed.input_ids[:, 1:, None]).squeeze(-1)
    kinds = fixed.kinds[:, 1:]
    adv = torch.zeros(fixed.batch_size, dtype=torch.float64)
    for g in fixed.group_ids.unique():  # GRPO: (R - mean) / (unbiased std + 1e-6) within the group
        m = fixed.group_ids == g
        r = rewards[m].double()
        adv[m] = (r - r.mean()) / (r.std() + 1e-6)
    gamma = cfg.loss.gamma
    p = logp.exp()
    term = torch.where(kinds == KIND_OFF, -adv[:, None] * p / (p + gamma), -adv[:, None] * torch.ones_like(p))
    active = (kinds == KIND_GEN) | (kinds == KIND_OFF)
    per_row = (term * active).sum(1) / active.sum(1).clamp_min(1)
    want = per_row[active.any(1)].mean()
    seen = []

    def loss_fn(**kw):
        out = __import__("rapo_fast").rapo_loss(**kw)
        seen.append(float(out[0].detach()))
        return out

    trainer = RAPOTrainer(
        model, tok, task, None, cfg, problems[:2], rollout_fn=lambda *a, **k: fixed, loss_fn=loss_fn, offpolicy=off
    )
    trainer.sample_problems = lambda: problems[:2]
    trainer.step()
    assert len(seen) == 1
    assert seen[0] == pytest.approx(float(want), rel=1e-5, abs=1e-6)
