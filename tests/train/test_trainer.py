"""Tests of the thin trainer: retrieval reward and advantage formulas by hand, ARPO hard attribution, one step lowers
the loss on a fixed batch, resume == uninterrupted run, bad trainer arguments, the on-policy steps (add_onpolicy_steps)
the buffer stores and the metrics counting them. Not here: the config (test_config.py)."""

import math
import statistics

import pytest
import torch

from rapo_fast import rapo_advantages, rapo_loss
from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy, final_hidden, lm_head_weight
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.batch import KIND_GEN, KIND_PROMPT, RolloutBatch
from rapo_fast.rollouts.loop import rollout
from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig, hard_attribution, retrieval_rewards

TIMING_KEYS = {
    "tokens_per_s",
    "t_rollout",
    "t_retrieval",
    "t_splice",
    "t_buffer",
    "t_step",
    "t_logprob",
    "t_loss",
    "t_optimizer",
}

ON_INTERPRETER = {"test_grpo_and_arpo_presets_train"}


@pytest.fixture(autouse=True)
def _fast_cpu(request, monkeypatch):
    """One thread (tiny matrices), and the loss on its torch path: the Triton interpreter runs those kernels ~50x
    slower and the kernels have their own tests; the tests named in ON_INTERPRETER stay on them (integration)."""
    if request.node.originalname not in ON_INTERPRETER:
        monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _hand_batch(B, T, step_spans, retrievals, group_ids):
    kinds = torch.full((B, T), KIND_GEN, dtype=torch.int8)
    kinds[:, 0] = KIND_PROMPT
    z = torch.zeros(B, T)
    return RolloutBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        kinds=kinds,
        behav_logp=z,
        entropy=z,
        step_spans=torch.tensor(step_spans).reshape(-1, 3),
        step_obs_end=torch.tensor([s[2] for s in step_spans]),
        retrievals=torch.tensor(retrievals).reshape(-1, 5),
        group_ids=torch.tensor(group_ids),
        prompt_index=torch.tensor(group_ids),
        hybrid=torch.ones(B, dtype=torch.bool),
        parent=torch.full((B,), -1),
        branch_at=torch.full((B,), -1),
        origin=torch.full((B, T), -1),
        prompt_len=torch.ones(B, dtype=torch.long),
        completions=[""] * B,
    )


def test_retrieval_reward_and_advantage_by_hand():
    # spans 0,1: row 0; spans 2,3,4: row 1; span 5: row 2; span 6: row 3
    spans = [[0, 1, 2], [0, 2, 3], [1, 1, 2], [1, 2, 3], [1, 3, 4], [2, 1, 2], [3, 1, 2]]
    step_ent = torch.tensor([2.0, 1.0, 1.0, 1.5, 0.25, 0.7, 0.3])
    # row 0: one retrieval (H_b 2, H_a 1); row 1: two (1 -> 1.5, 1.5 -> 0.25); row 2: one with no step after it;
    # row 3: one right after the prompt (no step before it: at_prompt), unscored too
    rets = [[0, 0, 1, 11, 5], [1, 2, 3, 12, 5], [1, 3, 4, 13, 5], [2, 5, -1, 14, 5], [3, -1, 6, 15, 5]]
    batch = _hand_batch(4, 5, spans, rets, [0, 0, 0, 0])
    z, counts = retrieval_rewards(batch, step_ent)

    def one(hb, ha):
        return math.tanh(2 * (-(ha - hb) / hb)) * hb

    want = [one(2.0, 1.0), (one(1.0, 1.5) + one(1.5, 0.25)) / 2, 0.0, 0.0]
    assert z.tolist() == pytest.approx(want, abs=1e-6)
    assert counts.tolist() == [1, 2, 0, 0]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])

    def norm(xs):
        m, s = statistics.mean(xs), statistics.stdev(xs)
        return [(x - m) / (s + 1e-6) for x in xs]

    a_acc, a_ret = norm(rewards.tolist()), norm(want)
    adv = rapo_advantages(rewards, batch.group_ids, z, 0.2)
    assert adv.tolist() == pytest.approx([(1 + 0.2 * r) * a for a, r in zip(a_acc, a_ret)], abs=1e-5)
    # a = 0 is plain GRPO
    assert rapo_advantages(rewards, batch.group_ids, z, 0.0).tolist() == pytest.approx(a_acc, abs=1e-5)


def test_hard_attribution_averages_shared_prefix():
    batch = _hand_batch(3, 5, [[0, 1, 5]], [], [0, 0, 0])
    batch.origin = torch.tensor([[-1, 10, 11, 12, 13], [-1, 10, 11, 20, 21], [-1, 30, 31, 32, 33]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    out = hard_attribution(batch, adv)  # shifted coordinates: column j is token j + 1
    assert out[0, :2].tolist() == pytest.approx([0.25, 0.25]) and out[1, :2].tolist() == pytest.approx([0.25, 0.25])
    assert out[0, 2:].tolist() == [1.0, 1.0] and out[1, 2:].tolist() == [-0.5, -0.5]
    assert out[2].tolist() == [2.0] * 4


@pytest.fixture
def world(tmp_path):
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    problems = task.make_problems(8, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 4, 0.2, seed=0), tmp_path / "t.jsonl")
    return task, tok, problems, path


def _rewards_from_tokens(env, problems, batch):
    """A deterministic, rollout-dependent reward that a random policy varies (parity of the generated token ids)."""
    return ((batch.input_ids * batch.loss_mask).sum(1) % 2).float()


def _cfg(tmp_path=None, overrides=None):
    base = {
        "rollout.group_size": 4,
        "rollout.hybrid.n_hybrid": 2,
        "prompts_per_step": 2,
        "rollout.max_step_tokens": 6,
        "rollout.max_steps": 2,
        "optim.lr": 5e-3,
        "logging.log_csv": None if tmp_path is None else str(tmp_path / "m.csv"),
    }
    return TrainerConfig.RAPO(base | (overrides or {}))


def test_one_step_lowers_the_loss_on_a_fixed_batch(world):
    task, tok, problems, path = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok)
    fixed = rollout(
        model, tok, task, problems[:2], _cfg().rollout, traces=traces, generator=torch.Generator().manual_seed(0)
    )
    seen = {}

    def loss_fn(**kw):
        seen.update(kw)
        return rapo_loss(**kw)

    trainer = RAPOTrainer(
        model,
        tok,
        task,
        traces,
        _cfg(),
        problems,
        rollout_fn=lambda *a, **k: fixed,
        reward_fn=_rewards_from_tokens,
        loss_fn=loss_fn,
    )
    m = trainer.step()
    assert m["adv_abs_mean"] > 0

    def loss_now():  # the same packed call (the loss contract: each row's scored positions, its prefix)
        with torch.no_grad():
            h = final_hidden(model, fixed.input_ids, fixed.attention_mask)[:, :-1]
            keep = torch.arange(h.shape[1])[None, :] < seen["cu_seqlens"].diff()[:, None]
            return float(rapo_loss(**(seen | {"hidden": h[keep], "weight": lm_head_weight(model)}))[0])

    assert loss_now() < m["loss"] - 1e-4


def test_mini_batches_make_the_clip_bind_and_each_loss_equals_the_reference(world):
    """PPO mini-batches (verl's ppo_mini_batch_size, ppo_epochs): a rollout batch of 2 prompt groups split into 2
    mini-batches of 1 group, 2 epochs = 4 optimiser steps. The old log-probs are those before the first step, so
    after it the ratios move off 1 and the clip binds (a non-zero clip fraction); each step's loss equals the float64
    reference (rapo_loss_ref) on that mini-batch's rows with the hidden states it was given; the mini-batches hold
    whole groups, in order."""
    from rapo_fast.reference.policy_loss import rapo_loss_ref
    from rapo_fast.train.trainer import mini_batch_rows

    task, tok, problems, path = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok)
    fixed = rollout(
        model, tok, task, problems[:2], _cfg().rollout, traces=traces, generator=torch.Generator().manual_seed(0)
    )
    calls = []

    def loss_fn(**kw):
        loss, m = rapo_loss(**kw)
        calls.append(({k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in kw.items()}, loss, m))
        return loss, m

    cfg = _cfg(
        overrides={
            "optim.mini_batch_groups": 1,
            "optim.updates_per_step": 2,
            "optim.lr": 0.05,
            "loss.eps_low": 0.02,
            "loss.eps_high": 0.02,
        }
    )
    trainer = RAPOTrainer(
        model,
        tok,
        task,
        traces,
        cfg,
        problems,
        rollout_fn=lambda *a, **k: fixed,
        reward_fn=_rewards_from_tokens,
        loss_fn=loss_fn,
    )
    m = trainer.step()
    assert len(calls) == 4
    rows = mini_batch_rows(fixed.group_ids, 1)
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # whole groups, in order
    assert [c[0]["cu_seqlens"].numel() - 1 for c in calls] == [4, 4, 4, 4]  # 4 rows each, packed
    fracs = [float(c[2].clip_frac_low + c[2].clip_frac_high) for c in calls]
    assert fracs[0] == 0.0 and max(fracs[1:]) > 0.0, fracs  # r = 1 only before the first update
    assert m["clip_frac_low"] + m["clip_frac_high"] == pytest.approx(sum(fracs) / 4, rel=1e-5)
    for kw, loss, _ in calls:
        t = {k: v for k, v in kw.items() if torch.is_tensor(v)}
        want = rapo_loss_ref(
            **{k: (v.double() if v.is_floating_point() else v) for k, v in t.items()},
            options=kw["options"].replace(return_metrics=False),
        )
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_resume_gives_the_same_next_step(world, tmp_path):
    task, tok, problems, path = world

    def make(seed_model):
        model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=seed_model)
        traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok)
        cfg = _cfg(tmp_path, {"buffer.add_onpolicy_steps": True})
        return RAPOTrainer(model, tok, task, traces, cfg, problems, reward_fn=_rewards_from_tokens)

    a = make(0)
    a.step()
    a.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(123)  # the global RNG moves on; resume must restore it
    m_a = a.step()
    b = make(1)
    b.load_checkpoint(tmp_path / "ckpt")
    m_b = b.step()
    assert {k: v for k, v in m_a.items() if k not in TIMING_KEYS} == pytest.approx(
        {k: v for k, v in m_b.items() if k not in TIMING_KEYS}, nan_ok=True
    )
    assert torch.equal(_params(a.model), _params(b.model))
    assert a.buffer.payloads == b.buffer.payloads and len(a.buffer.buffer) == len(b.buffer.buffer)
    assert m_a["step"] == 2
    lines = (tmp_path / "m.csv").read_text().strip().splitlines()
    assert lines[0].startswith("loss,") and len(lines) >= 3


def test_resume_in_splice_mode_between_kv_refreshes(world, tmp_path):
    """The K/V store is saved with the checkpoint: resumed between refreshes (refresh_kv_every=3), the next step
    splices the K/V the uninterrupted run computed with the earlier weights, not ones recomputed with the new."""
    from rapo_fast.kv.splice import StepKVStore

    task, tok, problems, path = world

    def make(seed_model):
        model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=seed_model)
        traces = StepTraces.from_jsonl(
            path, HashedNgramEncoder(), tok, kv_store=StepKVStore.for_model(model), model=model
        )
        cfg = _cfg(tmp_path, {"rollout.mode": "splice", "buffer.refresh_kv_every": 3, "loss.tis_cap": 2.0})
        return RAPOTrainer(model, tok, task, traces, cfg, problems, reward_fn=_rewards_from_tokens)

    a = make(0)
    a.step()  # refreshes the K/V at step 0, then trains: the cached K/V are now stale by one update
    a.save_checkpoint(tmp_path / "ckpt")
    m_a = a.step()
    b = make(1)
    b.load_checkpoint(tmp_path / "ckpt")
    m_b = b.step()
    assert m_a["retrieval_rate"] > 0
    assert {k: v for k, v in m_a.items() if k not in TIMING_KEYS} == pytest.approx(
        {k: v for k, v in m_b.items() if k not in TIMING_KEYS}, nan_ok=True
    )
    assert torch.equal(_params(a.model), _params(b.model))
    for pid in a.buffer.kv_store.payload_ids():
        assert torch.equal(a.buffer.kv_store.get(pid)[0], b.buffer.kv_store.get(pid)[0])


def test_grpo_and_arpo_presets_train(world):
    task, tok, problems, _ = world
    for cfg in (
        TrainerConfig.GRPO(
            {"rollout.group_size": 4, "prompts_per_step": 2, "rollout.max_step_tokens": 6, "rollout.max_steps": 2}
        ),
        TrainerConfig.ARPO(
            {
                "rollout.group_size": 4,
                "prompts_per_step": 2,
                "rollout.max_step_tokens": 6,
                "rollout.max_steps": 2,
                "rollout.arpo.k": 2,
                "advantages.advantage_attribution": "hard",
            }
        ),
    ):
        model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
        trainer = RAPOTrainer(model, tok, task, None, cfg, problems, reward_fn=_rewards_from_tokens)
        m = trainer.step()
        assert m["retrieval_rate"] == 0.0 and m["f_ret"] == 0.0 and math.isfinite(m["loss"])


def test_bad_trainer_arguments(world):
    task, tok, problems, _ = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    with pytest.raises(ValueError, match="buffer"):
        RAPOTrainer(model, tok, task, None, TrainerConfig.RAPO(), problems)
    with pytest.raises(TypeError, match="TrainerConfig"):
        RAPOTrainer(model, tok, task, None, {"strategy": "hybrid"}, problems)
    with pytest.raises(ValueError, match="num_steps"):
        RAPOTrainer(model, tok, task, None, TrainerConfig.GRPO(), problems).train(-1)


def test_splice_mode_step_uses_behaviour_correction(world):
    import random

    from rapo_fast.kv.splice import StepKVStore
    from rapo_fast.train.sft import sft_examples

    task, tok, problems, path = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, kv_store=StepKVStore.for_model(model), model=model)
    # a fixed batch in the rollout's format: solutions with retrieved steps, behaviour log-probs off by a little
    # (as sampling from a spliced cache would leave them)
    ex = sft_examples(task, tok, problems[:2] * 2, retrieve_frac=1.0, rng=random.Random(0))
    T = max(len(i) for i, _ in ex)
    batch = _hand_batch(4, T, [[b, 1, 2] for b in range(4)], [], [0, 0, 1, 1])
    for b, (ids, kinds) in enumerate(ex):
        batch.input_ids[b, : len(ids)] = torch.tensor(ids)
        batch.kinds[b] = 0
        batch.kinds[b, : len(ids)] = torch.tensor(kinds, dtype=torch.int8)
    batch.attention_mask = (batch.kinds != 0).long()
    assert batch.retrieved_mask.any()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    batch.behav_logp[:, 1:] = torch.where(batch.loss_mask[:, 1:], lp - 0.1, torch.zeros_like(lp))
    seen = {}

    def loss_fn(**kw):
        seen.update(kw)
        return rapo_loss(**kw)

    cfg = _cfg(overrides={"rollout.mode": "splice", "loss.tis_cap": 2.0})
    trainer = RAPOTrainer(
        model,
        tok,
        task,
        traces,
        cfg,
        problems,
        rollout_fn=lambda *a, **k: batch,
        reward_fn=lambda env, p, b: torch.tensor([1.0, 0.0, 0.0, 1.0]),
        loss_fn=loss_fn,
    )
    m = trainer.step()
    keep = batch.attention_mask[:, 1:].bool()  # right-padded rows: the positions whose target is attended
    assert seen["options"].tis_cap == 2.0 and torch.equal(seen["behav_logp"], batch.behav_logp[:, 1:][keep])
    # old_logp - behav_logp = 0.1 on every trained token: the truncated IS weight is exp(0.1) there
    assert m["tis_weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-4)
    assert m["f_ret"] == pytest.approx(float(batch.retrieved_fraction().mean()))
    with pytest.raises(ValueError, match="kv_store"):
        RAPOTrainer(model, tok, task, StepTraces.from_jsonl(path, HashedNgramEncoder(), tok), cfg, problems)


def test_train_callbacks_run_every_step_can_stop_and_evaluate_inside_the_loop(world, capsys):
    from rapo_fast.train.callbacks import EvalCallback, TrainerCallback

    task, tok, problems, _ = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    cfg = TrainerConfig.GRPO(
        {"rollout.group_size": 2, "prompts_per_step": 1, "rollout.max_step_tokens": 4, "rollout.max_steps": 1}
    )
    trainer = RAPOTrainer(model, tok, task, None, cfg, problems, reward_fn=_rewards_from_tokens)
    events = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, t, num_steps):
            events.append(("begin", t.step_count, num_steps))

        def on_step_end(self, t, step, metrics):
            events.append(("step", step, metrics["step"], "eval" in metrics))
            return step == 3  # ask to stop after the third step

        def on_train_end(self, t, history):
            events.append(("end", len(history)))

    evaluated_at = []

    def eval_fn(t):
        evaluated_at.append(t.step_count)  # the trainer's state between steps: eval runs inside the loop
        return 0.25 * t.step_count

    held_out = EvalCallback(eval_fn, every=2)
    plain = []
    hist = trainer.train(5, progress=True, callbacks=[Recorder(), held_out], callback=lambda m: plain.append(m["step"]))
    # every step reaches the callbacks, in order; the Recorder's stop ends training after step 3 of 5
    assert events == [("begin", 0, 5), ("step", 1, 1, False), ("step", 2, 2, False), ("step", 3, 3, False), ("end", 3)]
    assert plain == [1, 2, 3] and len(hist) == 3 and trainer.step_count == 3
    # evaluation before the first step, at step 2 (every=2) and at the last step run (3, cut short)
    assert evaluated_at == [0, 2, 3] and held_out.curve == [(0, 0.0), (2, 0.5), (3, 0.75)]
    assert "eval" not in hist[0] and hist[1]["eval"] == 0.5 and hist[2]["eval"] == 0.75
    assert held_out.seconds >= 0
    assert "eval=0.50" in capsys.readouterr().err  # the eval score shows in the progress bar

    # a target stops training at the first evaluation that reaches it (here after one more step)
    reach = EvalCallback(lambda t: float(t.step_count >= 4), every=1, target=1.0)
    assert len(trainer.train(10, progress=False, callbacks=[reach])) == 1 and trainer.step_count == 4
    assert reach.curve == [(3, 0.0), (4, 1.0)]
    # ... and before any step when the start already reaches it
    assert trainer.train(3, progress=False, callbacks=[EvalCallback(lambda t: 1.0, every=1, target=0.5)]) == []
    assert trainer.step_count == 4
    with pytest.raises(TypeError, match="callbacks"):
        trainer.train(1, progress=False, callbacks=[lambda m: None])
    with pytest.raises(ValueError, match="every"):
        EvalCallback(eval_fn, every=0)


def test_train_closes_its_logger_when_it_returns_and_when_it_raises(world, tmp_path):
    """With TensorBoard on, train() leaves no writer thread running after it returns or raises (a callback's error
    mid-run); a later train() logs again (a new writer) and closes it too, every step in the CSV once."""
    import threading

    from rapo_fast.train.callbacks import TrainerCallback

    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    task, tok, problems, _ = world
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    logging = {"logging.log_csv": str(tmp_path / "m.csv"), "logging.tensorboard_dir": str(tmp_path / "tb")}
    cfg = TrainerConfig.GRPO(
        {"rollout.group_size": 2, "prompts_per_step": 1, "rollout.max_step_tokens": 4, "rollout.max_steps": 1} | logging
    )
    trainer = RAPOTrainer(model, tok, task, None, cfg, problems, reward_fn=_rewards_from_tokens)
    threads = threading.active_count()
    seen = []

    class Fails(TrainerCallback):
        def on_step_end(self, t, step, metrics):
            seen.append(threading.active_count())  # the writer's thread runs while training
            if step == 2:
                raise RuntimeError("callback failed")

    assert len(trainer.train(1, progress=False)) == 1
    assert threading.active_count() == threads and trainer.logger._tb[0] is None
    with pytest.raises(RuntimeError, match="callback failed"):
        trainer.train(3, progress=False, callbacks=[Fails()])
    assert seen == [threads + 1] and threading.active_count() == threads and trainer.logger._tb[0] is None
    assert len(trainer.train(1, progress=False)) == 1 and threading.active_count() == threads
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 1 + 3  # header, steps 1-3


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
        _cfg(overrides={"buffer.add_onpolicy_steps": True}),
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
        overrides={
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
