"""rollout(model, tokenizer, env, problems, cfg): a cfg that is no RolloutConfig or a settings keyword is a TypeError,
and rows end in RowState.DONE. Not here: what each strategy does (test_rollout.py, test_arpo_rules.py,
test_offpolicy_traj.py) or the config's fields (tests/train/test_config_nested.py)."""

from __future__ import annotations

import pytest

from rapo_fast.demo.tasks import ChainArithmeticTask
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.rollouts.config import RolloutConfig
from rapo_fast.rollouts.loop import rollout
from rapo_fast.rollouts.rows import Row, RowState


@pytest.fixture(scope="module")
def world():
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    model = build_tiny_policy(tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, seed=0)
    return task, tok, task.make_problems(2, seed=0), model


def test_bad_calls(world):
    task, tok, problems, model = world
    with pytest.raises(TypeError, match="unexpected keyword"):
        rollout(model, tok, task, problems, RolloutConfig(), group_size=4)
    with pytest.raises(TypeError, match="RolloutConfig"):
        rollout(model, tok, task, problems, {"group_size": 4})


def test_row_states():
    r = Row([1, 2], group=0, pidx=0, hybrid=False, state=RowState.IDLE)
    assert not r.active and not r.live and not r.done
    r.start()
    assert r.active and r.live and r.state is RowState.RUNNING
    r.state = RowState.BOUNDARY
    assert r.live and not r.done
    r.state = RowState.DONE
    assert r.done and r.active and not r.live
