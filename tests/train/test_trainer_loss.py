"""The trainer's loss contract (docs/training.md, "The loss contract"): a spy on one step sees every loss call get the
rows packed and the step's one LossOptions object as `options` (no option as a keyword), checked once per step
whatever the number of mini-batches, the same for a functools.partial of rapo_loss; the packed update equals the
padded one. Not here: the step's other stages (test_trainer.py) or the loss's values (tests/loss/)."""

import functools
import math

import pytest
import torch

from rapo_fast import rapo_loss
from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy, final_hidden
from rapo_fast.loss.options import LossOptions
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.loop import rollout
from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig


@pytest.fixture(autouse=True)
def _torch_loss(monkeypatch):
    """The loss on its torch path (the Triton interpreter is ~50x slower; the kernels have their own tests)."""
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")


@pytest.fixture
def world(tmp_path):
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    problems = task.make_problems(8, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 4, 0.2, seed=0), tmp_path / "t.jsonl")
    return task, tok, problems, StepTraces.from_jsonl(path, HashedNgramEncoder(), tok)


def _cfg(overrides=None):
    base = {
        "rollout.group_size": 4,
        "rollout.hybrid.n_hybrid": 2,
        "prompts_per_step": 2,
        "rollout.max_step_tokens": 6,
        "rollout.max_steps": 2,
        "optim.lr": 5e-3,
    }
    return TrainerConfig.RAPO(base | (overrides or {}))


def _rewards_from_tokens(env, problems, batch):
    return ((batch.input_ids * batch.loss_mask).sum(1) % 2).float()


def _trainer(world, cfg, fixed=None, **kw):
    task, tok, problems, traces = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    if fixed is None:
        fixed = rollout(model, tok, task, problems[:2], cfg.rollout, traces=traces, generator=torch.Generator())
    return RAPOTrainer(
        model, tok, task, traces, cfg, problems, rollout_fn=lambda *a, **k: fixed, reward_fn=_rewards_from_tokens, **kw
    )


@pytest.mark.parametrize("partial", [False, True], ids=["function", "partial"])
def test_one_step_passes_one_checked_options_object_and_packed_rows(world, monkeypatch, partial):
    """2 passes over 2 mini-batches: 4 loss calls, each with the step's LossOptions (the same object) and no option
    keyword; LossOptions is built and checked once in the step, not once per call; the rows arrive packed."""
    calls, checks = [], []
    real_validate = LossOptions.validate

    def counting_validate(self):
        checks.append(self)
        return real_validate(self)

    def spy(**kw):
        calls.append(kw)
        return rapo_loss(**kw)

    loss_fn = functools.partial(spy, backend="torch") if partial else spy
    cfg = _cfg({"optim.mini_batch_groups": 1, "optim.updates_per_step": 2, "loss.loss_agg": "seq-mean-token-sum-norm"})
    trainer = _trainer(world, cfg, loss_fn=loss_fn)
    monkeypatch.setattr(LossOptions, "validate", counting_validate)
    m = trainer.step()
    assert len(calls) == 4 and math.isfinite(m["loss"])
    assert len(checks) == 1, f"LossOptions checked {len(checks)} times in one step"
    opts = calls[0]["options"]
    assert type(opts) is LossOptions and all(c["options"] is opts for c in calls)
    assert opts.return_metrics and opts.temperature == (cfg.rollout.temperature or 1.0)
    assert opts.replace(return_metrics=False, temperature=1.0) == cfg.loss.replace(tis_cap=None)  # tis: splice only
    for kw in calls:
        assert not set(kw) & set(LossOptions.names()), sorted(kw)  # no option as a keyword
        n = int(kw["cu_seqlens"][-1])
        assert kw["hidden"].dim() == 2 and kw["hidden"].shape[0] == n and kw["targets"].shape == (n,)
        assert kw["advantages"].shape == (n,) and kw["global_num_tokens"] == trainer.last_batch.input_ids.shape[1] - 1


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_bucketed_packed_update_equals_the_padded_one(world, monkeypatch, loss_agg):
    """The step scores rows in length buckets and gives the loss the rows packed (cu_seqlens); the padded layout
    (final_hidden over the whole [B, T] batch; the loss on the same tokens put back into padded rows) gives the same
    metrics and the same updated weights up to float rounding, on rows of different lengths."""
    import rapo_fast.train.trainer as trainer_mod

    task, tok, problems, traces = world
    base = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    # a long step budget: the untrained policy ends its rows at different lengths
    cfg = _cfg({"rollout.max_step_tokens": 40, "optim.mini_batch_groups": 1, "loss.loss_agg": loss_agg})
    fixed = rollout(
        base, tok, task, problems[:2], cfg.rollout, traces=traces, generator=torch.Generator().manual_seed(0)
    )
    lengths = fixed.attention_mask.sum(1)
    assert int(lengths.min()) < int(lengths.max()) - 2  # padding to remove: not vacuous
    seen = []

    def step(**kw):
        trainer = _trainer(world, cfg, fixed, **kw)
        trainer.model.load_state_dict(base.state_dict())
        m = trainer.step()
        return m, torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    def padded_loss(*, hidden, weight, cu_seqlens, global_num_tokens, options, **flat):
        """The packed tokens back in padded rows [S, L, ...] (a row's scored positions are its prefix)."""
        lens = cu_seqlens.diff()
        keep = torch.arange(int(lens.max()))[None, :] < lens[:, None]

        def pad(x):
            out = x.new_zeros((*keep.shape, *x.shape[1:]))
            out[keep] = x
            return out

        seen.append(keep.shape)
        rows = {k: pad(v) for k, v in flat.items()}
        return rapo_loss(
            hidden=pad(hidden), weight=weight, **rows, global_num_tokens=global_num_tokens, options=options
        )

    fast, p_fast = step()
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "final_hidden_buckets", lambda model, ids, mask: final_hidden(model, ids, mask))
        slow, p_slow = step(loss_fn=padded_loss)
    assert seen and all(s[0] == 4 for s in seen)  # one group of 4 rows per mini-batch, padded
    assert fast["adv_abs_mean"] > 0
    for k in ("loss", "entropy", "adv_abs_mean", "ratio_mean", "approx_kl", "retrieval_reward"):
        assert fast[k] == pytest.approx(slow[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    torch.testing.assert_close(p_fast, p_slow, rtol=1e-4, atol=1e-6)
