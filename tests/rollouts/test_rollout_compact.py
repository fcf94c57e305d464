"""Tests of the rollout's compaction (DecodeEngine.compact, called by the lockstep loop): a rollout that drops finished
rows and unused cache columns samples the same tokens, with the same behaviour log-probs and entropies up to float
rounding, as the lockstep layout that keeps every row and column (strategies on_policy, hybrid exact and splice); the
engine refuses a dropped row. Not here: the rest of the loop (test_rollout.py)."""

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.kv.splice import StepKVStore
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.batch import KIND_RET
from rapo_fast.rollouts.config import RolloutConfig
from rapo_fast.rollouts.engine import DecodeEngine
from rapo_fast.rollouts.loop import rollout
from rapo_fast.rollouts.strategies import RolloutStrategy
from rapo_fast.train.sft import sft_warmup


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A policy warmed up just enough to emit tool calls and retrieve, a solver-seeded buffer, training problems."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    model = build_tiny_policy(tok.vocab_size, hidden_size=64, seed=0)
    sft_warmup(model, tok, task, task.make_problems(500, seed=5, start_qid=5000), steps=60, batch_size=16, seed=0)
    problems = task.make_problems(4, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 8, 0.2, seed=0), tmp_path_factory.mktemp("traj") / "t.jsonl")
    yield task, tok, model, problems, path
    torch.set_num_threads(threads)


def _run(setup, strategy: str, mode: str, seed: int):
    task, tok, model, problems, path = setup
    store = StepKVStore.for_model(model) if mode == "splice" else None
    traces = StepTraces.from_jsonl(
        path, HashedNgramEncoder(), tok, top_k=5, kv_store=store, model=model if mode == "splice" else None
    )
    cfg = RolloutConfig(
        strategy=strategy, mode=mode, group_size=6, max_step_tokens=16, hybrid={"n_hybrid": 3, "retrieve_prob": 0.8}
    )
    return rollout(model, tok, task, problems, cfg, traces=traces, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("strategy", "mode"), [("on_policy", "exact"), ("hybrid", "exact"), ("hybrid", "splice")])
def test_compaction_changes_no_token_and_no_logprob(setup, monkeypatch, strategy, mode):
    compacted = []
    real = DecodeEngine.compact

    def spy(self, keep):
        before = (len(self.held), self.num_columns)
        done = real(self, keep)
        compacted.append((before, (len(self.held), self.num_columns)) if done else None)
        return done

    monkeypatch.setattr(DecodeEngine, "compact", spy)
    fast = _run(setup, strategy, mode, seed=4)
    assert any(c is not None and c[1] < c[0] for c in compacted)  # it dropped rows or columns: not vacuous
    with monkeypatch.context() as m:
        m.setattr(RolloutStrategy, "reuses_rows", True)  # the loop then never compacts: the full lockstep layout
        n_before = len(compacted)
        slow = _run(setup, strategy, mode, seed=4)
        assert len(compacted) == n_before
    lengths = fast.attention_mask.sum(1)
    assert int(lengths.max()) > int(lengths.min())  # ragged rows: some finished before others
    if strategy == "hybrid":
        assert int((fast.kinds == KIND_RET).sum()) > 0
    assert torch.equal(fast.input_ids, slow.input_ids) and torch.equal(fast.kinds, slow.kinds)
    assert torch.equal(fast.step_spans, slow.step_spans) and torch.equal(fast.retrievals, slow.retrievals)
    torch.testing.assert_close(fast.behav_logp, slow.behav_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast.entropy, slow.entropy, rtol=0, atol=1e-5)


def test_engine_refuses_a_dropped_row(setup):
    _, tok, model, _, _ = setup
    eng = DecodeEngine(model, 3, torch.device("cpu"))
    tokens = torch.tensor([[1, 5, 6], [1, 7, 0], [1, 0, 0]])
    eng.feed(tokens, tokens != 0)
    assert eng.compact([0, 2]) and eng.held.tolist() == [0, 2] and eng.num_columns == 3
    assert eng.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(RuntimeError, match="row 1 was dropped"):
        eng.physical(1)
    with pytest.raises(RuntimeError, match="dropped"):
        eng.feed(torch.tensor([[4], [4], [0]]), torch.tensor([[True], [True], [False]]))
