"""rollout(model, tokenizer, env, problems, cfg): the former flat keywords build the same RolloutConfig (a
DeprecationWarning; the same batch, bit for bit, for every strategy), mixing them with cfg or passing an unknown one is
a TypeError, and rows end in RowState.DONE. Not here: what each strategy does (test_rollout.py, test_arpo_rules.py,
test_offpolicy_traj.py)."""

from __future__ import annotations

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.config import RolloutConfig
from rapo_fast.rollouts.loop import rollout
from rapo_fast.rollouts.offpolicy import OffPolicyTrajectories
from rapo_fast.rollouts.rows import Row, RowState


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    problems = task.make_problems(2, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 4, 0.2, seed=0), tmp_path_factory.mktemp("t") / "t.jsonl")
    model = build_tiny_policy(tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, seed=0)
    return task, tok, problems, path, model


CASES = {
    "hybrid": dict(strategy="hybrid", n_hybrid=2, retrieve_prob=1.0),
    "on_policy": dict(strategy="on_policy", n_hybrid=0),
    "arpo": dict(strategy="arpo", n_hybrid=0, arpo_initial=2, arpo_beam=2, arpo_k=2, arpo_alpha=1.0),
    "offpolicy_traj": dict(strategy="offpolicy_traj", n_hybrid=0, n_offpolicy=1),
}
NESTED = {
    "hybrid": dict(strategy="hybrid", hybrid={"n_hybrid": 2, "retrieve_prob": 1.0}),
    "on_policy": dict(strategy="on_policy", hybrid={"n_hybrid": 0}),
    "arpo": dict(strategy="arpo", hybrid={"n_hybrid": 0}, arpo={"initial": 2, "beam": 2, "k": 2, "alpha": 1.0}),
    "offpolicy_traj": dict(strategy="offpolicy_traj", hybrid={"n_hybrid": 0}, offpolicy_traj={"n_offpolicy": 1}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_legacy_keywords_give_the_same_batch(world, name):
    task, tok, problems, path, model = world
    res = dict(
        traces=StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, top_k=2),
        offpolicy=OffPolicyTrajectories.from_jsonl(path, top_k=2),
    )
    common = dict(group_size=4, max_step_tokens=6, max_steps=2)
    with pytest.warns(DeprecationWarning, match="RolloutConfig"):
        old = rollout(
            model, tok, task, problems, **common, **CASES[name], **res, generator=torch.Generator().manual_seed(3)
        )
    cfg = RolloutConfig(**common, **NESTED[name])
    assert cfg == RolloutConfig.from_legacy({**common, **CASES[name]})
    new = rollout(model, tok, task, problems, cfg, **res, generator=torch.Generator().manual_seed(3))
    for k in ("input_ids", "kinds", "behav_logp", "entropy", "step_spans", "retrievals", "parent", "origin"):
        assert torch.equal(getattr(old, k), getattr(new, k)), k
    assert old.completions == new.completions


def test_bad_calls(world):
    task, tok, problems, _, model = world
    with pytest.raises(TypeError, match="not both"):
        rollout(model, tok, task, problems, RolloutConfig(), group_size=4)
    with pytest.raises(TypeError, match="unexpected keyword"):
        rollout(model, tok, task, problems, group_sise=4)
    with pytest.raises(TypeError, match="RolloutConfig"):
        rollout(model, tok, task, problems, {"group_size": 4})
    with pytest.raises(ValueError, match="rollout.arpo.beam"), pytest.warns(DeprecationWarning):
        rollout(model, tok, task, problems, strategy="arpo", n_hybrid=0, arpo_beam=0)


def test_row_states():
    r = Row([1, 2], group=0, pidx=0, hybrid=False, state=RowState.IDLE)
    assert not r.active and not r.live and not r.done
    r.start()
    assert r.active and r.live and r.state is RowState.RUNNING
    r.state = RowState.BOUNDARY
    assert r.live and not r.done
    r.state = RowState.DONE
    assert r.done and r.active and not r.live


def test_legacy_default_n_offpolicy_is_accepted_by_other_strategies():
    """rollout()'s former default n_offpolicy=0, passed explicitly, still works where the strategy ignores it; the
    off-policy strategy itself refuses it (at least one off-policy member)."""
    assert RolloutConfig.from_legacy(dict(strategy="hybrid", n_offpolicy=0)) == RolloutConfig()
    with pytest.raises(ValueError, match="rollout.offpolicy_traj.n_offpolicy"):
        RolloutConfig.from_legacy(dict(strategy="offpolicy_traj", n_offpolicy=0))
