"""RAPOTrainer's on-policy steps (add_onpolicy_steps): what goes into the step buffer and what the metrics say about
it. A buffer full of the pinned off-policy source drops the policy's steps (counted as dropped, not added), and the
whole off-policy trajectories of strategy "offpolicy_traj" are the source's steps, never added as the policy's."""

from __future__ import annotations

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.loop import rollout
from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig


@pytest.fixture
def world(tmp_path):
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    problems = task.make_problems(8, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 4, 0.2, seed=0), tmp_path / "t.jsonl")
    return task, tok, problems, path


def _cfg(overrides=None):
    base = {
        "rollout.group_size": 4,
        "rollout.hybrid.n_hybrid": 2,
        "prompts_per_step": 2,
        "rollout.max_step_tokens": 6,
        "rollout.max_steps": 2,
        "optim.lr": 5e-3,
        "logging.log_csv": None,
    }
    return TrainerConfig.RAPO(base | (overrides or {}))


def _tool_steps_rollout(*args, **kwargs):
    """The real rollout with every generated step marked as a tool step (its observation ends one token later), so
    that every successful row has steps for the buffer whatever the random policy wrote."""
    batch = rollout(*args, **kwargs)
    batch.step_obs_end = torch.clamp(batch.step_spans[:, 2] + 1, max=batch.input_ids.shape[1])
    return batch


@pytest.mark.parametrize("pin", [True, False])
def test_onpolicy_metrics_count_the_steps_the_buffer_stored(world, pin):
    """onpolicy_steps_added counts the steps the buffer stored, not the steps offered. A buffer its
    off-policy source fills (capacity = the source's steps) keeps every source step by default (pinned) and drops
    the on-policy steps (onpolicy_steps_dropped); with pin_offpolicy=False the on-policy steps evict the source."""
    task, tok, problems, path = world
    n_off = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok).num_offpolicy
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, capacity=n_off, pin_offpolicy=pin)
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    trainer = RAPOTrainer(
        model,
        tok,
        task,
        traces,
        _cfg({"buffer.add_onpolicy_steps": True}),
        problems,
        rollout_fn=_tool_steps_rollout,
        reward_fn=lambda env, probs, batch: torch.ones(batch.batch_size),
    )
    added = 0
    for _ in range(2):
        before = traces.num_onpolicy
        m = trainer.step()
        offered = traces.num_onpolicy - before
        assert 0 < offered < n_off  # steps were offered, fewer than the buffer holds (fifo keeps a whole batch)
        assert m["onpolicy_steps_added"] + m["onpolicy_steps_dropped"] == offered
        assert m["onpolicy_steps_added"] == (0 if pin else offered)
        added += m["onpolicy_steps_added"]
    pids = traces.buffer.payload_ids.tolist()
    assert len(pids) == n_off
    n_source = sum(p < n_off for p in pids)
    assert n_source == (n_off if pin else n_off - added)  # by default every source step is still there


def test_offpolicy_trajectories_are_not_added_as_onpolicy_steps(world):
    """strategy "offpolicy_traj" with a buffer and add_onpolicy_steps: the whole off-policy trajectories' steps are
    the source's, so only the policy's own rows' steps go into the buffer."""
    from rapo_fast.rollouts.offpolicy import OffPolicyTrajectories

    task, tok, problems, path = world
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok)
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    cfg = _cfg(
        {
            "buffer.add_onpolicy_steps": True,
            "rollout.strategy": "offpolicy_traj",
            "rollout.hybrid.n_hybrid": 0,
            "rollout.offpolicy_traj.n_offpolicy": 1,
        }
    )
    seen = {}

    def rollout_fn(*args, **kwargs):
        batch = _tool_steps_rollout(*args, **kwargs)
        spans = batch.step_spans.tolist()
        seen["own"] = sum(1 for r, s, e in spans if not bool(batch.offpolicy_rows[r]))
        seen["off"] = sum(1 for r, s, e in spans if bool(batch.offpolicy_rows[r]))
        return batch

    trainer = RAPOTrainer(
        model,
        tok,
        task,
        traces,
        cfg,
        problems,
        rollout_fn=rollout_fn,
        offpolicy=OffPolicyTrajectories.from_jsonl(path, top_k=2),
        reward_fn=lambda env, probs, batch: torch.ones(batch.batch_size),
    )
    before = traces.num_onpolicy
    trainer.step()
    assert seen["off"] > 0  # the batch did hold off-policy trajectories with steps
    # every own step is a tool step here except each row's answer; the off-policy rows' steps are never offered
    assert 0 < traces.num_onpolicy - before <= seen["own"]
