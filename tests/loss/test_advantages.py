"""rapo_fast.step_entropy, retrieval_reward, rapo_advantages (and group_normalize) against numbers worked out by hand
in the comments, against straightforward loops, and their argument checks; rapo_advantages' ret_norm="retrieved"
(A_ret over the retrieving rows only) and the trainer's call that passes it (TrainerConfig.advantages.ret_norm).
Not here: the entropy computation itself (token_logprobs tests) or the loss (test_loss*.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_verbose
from hypothesis import given, settings
from hypothesis import strategies as st

import rapo_fast
from rapo_fast.loss.advantages import group_normalize


def test_step_entropy_padded_by_hand():
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 1.5, 9.0]])
    spans = torch.tensor([[0, 0, 2], [0, 2, 4], [1, 1, 3], [1, 3, 3], [0, 0, 4]])
    # (1+2)/2, (3+4)/2, (0.5+1.5)/2, empty -> 0, (1+2+3+4)/4
    assert_close_verbose(rapo_fast.step_entropy(ent, spans), torch.tensor([1.5, 3.5, 1.0, 0.0, 2.5]), atol=1e-7)


def test_step_entropy_flat_and_grad():
    ent = torch.tensor([1.0, 3.0, 5.0, 7.0], requires_grad=True)
    out = rapo_fast.step_entropy(ent, torch.tensor([[0, 1], [1, 4]], dtype=torch.int32))
    assert_close_verbose(out, torch.tensor([1.0, 5.0]), atol=1e-7)
    (g,) = torch.autograd.grad(out.sum(), ent)
    assert_close_verbose(g, torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3]), atol=1e-7)


def test_step_entropy_matches_loop_and_keeps_dtype():
    torch.manual_seed(0)
    ent = torch.rand(3, 50, dtype=torch.bfloat16) * 4
    starts = torch.randint(0, 50, (20,))
    ends = torch.minimum(starts + torch.randint(0, 10, (20,)), torch.tensor(50))
    spans = torch.stack([torch.randint(0, 3, (20,)), starts, ends], 1)
    out = rapo_fast.step_entropy(ent, spans)
    assert out.dtype == torch.bfloat16 and out.shape == (20,)
    want = torch.tensor([ent[r, s:e].double().mean().item() if e > s else 0.0 for r, s, e in spans.tolist()])
    assert_close_verbose(out, want, atol=2e-2)


@pytest.mark.parametrize(
    "ent,spans,exc,text",
    [
        (torch.ones(2, 4), torch.tensor([[0, 0]]), ValueError, "step_spans"),
        (torch.ones(4), torch.tensor([[0, 1, 2]]), ValueError, "step_spans"),
        (torch.ones(2, 4), torch.tensor([[2, 0, 1]]), ValueError, "row"),
        (torch.ones(2, 4), torch.tensor([[0, 3, 1]]), ValueError, "start <= end"),
        (torch.ones(2, 4), torch.tensor([[0, 0, 5]]), ValueError, "end"),
        (torch.ones(2, 4), torch.tensor([[0.0, 0.0, 1.0]]), TypeError, "step_spans"),
        (torch.ones(2, 4, dtype=torch.long), torch.tensor([[0, 0, 1]]), TypeError, "entropy"),
        (torch.ones(2, 4, 1), torch.tensor([[0, 0, 1]]), ValueError, "entropy"),
    ],
)
def test_step_entropy_checks(ent, spans, exc, text):
    with pytest.raises(exc, match=text):
        rapo_fast.step_entropy(ent, spans)


def test_retrieval_reward_by_hand():
    nan = float("nan")
    hb = torch.tensor([[2.0, 1.0], [1.0, nan], [nan, nan], [0.0, 4.0]])
    ha = torch.tensor([[1.0, 1.5], [1.0, nan], [nan, nan], [3.0, 4.0]])
    # row 0: delta = 0.5 -> tanh(1)*2 ; delta = -0.5 -> tanh(-1)*1 ; mean
    # row 1: delta 0 -> 0 ; row 2: no retrieval -> 0 ; row 3: H_b = 0 -> 0, delta 0 -> 0 ; mean over 2 = 0
    want = torch.tensor([(math.tanh(1.0) * 2 + math.tanh(-1.0) * 1) / 2, 0.0, 0.0, 0.0])
    assert_close_verbose(rapo_fast.retrieval_reward(hb, ha), want, atol=1e-7)
    hb2, ha2 = torch.tensor([[1.0, 2.0, nan]]), torch.tensor([[0.5, 3.0, nan]])
    # delta = 0.5 -> tanh(1) ; delta = -0.5 -> 2 tanh(-1)
    want2 = torch.tensor([(math.tanh(1.0) + 2 * math.tanh(-1.0)) / 2])
    assert_close_verbose(rapo_fast.retrieval_reward(hb2, ha2), want2, atol=1e-7)


def test_retrieval_reward_checks():
    with pytest.raises(ValueError, match="h_after"):
        rapo_fast.retrieval_reward(torch.ones(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="NaN"):
        rapo_fast.retrieval_reward(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1.0, 1.0]]))
    with pytest.raises(ValueError, match="h_before"):
        rapo_fast.retrieval_reward(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="h_before"):
        rapo_fast.retrieval_reward(torch.tensor([[float("inf")]]), torch.tensor([[1.0]]))
    with pytest.raises(TypeError, match="h_before"):
        rapo_fast.retrieval_reward(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1))


def test_group_normalize_by_hand():
    # group 7: [1, 2, 3] mean 2, unbiased std 1 -> [-1, 0, 1]/(1+eps); group 3: [5, 5] -> 0; group 9: [4] -> 0
    x = torch.tensor([1.0, 5.0, 2.0, 4.0, 3.0, 5.0])
    gid = torch.tensor([7, 3, 7, 9, 7, 3])
    out = group_normalize(x, gid, eps=1e-6)
    assert_close_verbose(out, torch.tensor([-1.0, 0.0, 0.0, 0.0, 1.0, 0.0]) / (1 + 1e-6), atol=1e-7)
    assert out[1] == 0 and out[3] == 0 and out[5] == 0
    # 0.1 repeated: the mean is not exactly 0.1 in floating point, the output is still exactly 0
    assert torch.count_nonzero(group_normalize(torch.full((3,), 0.1), torch.zeros(3, dtype=torch.long))) == 0


def test_rapo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    gid = torch.tensor([0, 0, 0, 0, 1])
    z = torch.tensor([0.3, 0.1, 0.2, 0.2, 7.0])
    # group 0: rewards mean 0.5, std sqrt(1/3) -> A_acc = +-0.5*sqrt(3); z mean 0.2, std sqrt(0.02/3) -> A_ret
    s = math.sqrt(1 / 3)
    a_acc = torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / (s + 1e-6)
    sz = math.sqrt(0.02 / 3)
    a_ret = torch.tensor([0.1, -0.1, 0.0, 0.0], dtype=torch.float64) / (sz + 1e-6)
    want = torch.cat([(1 + 0.2 * a_ret) * a_acc, torch.zeros(1, dtype=torch.float64)])  # group 1: one member -> 0
    out = rapo_fast.rapo_advantages(rewards, gid, z)
    assert out.dtype == torch.float32
    assert_close_verbose(out, want, atol=1e-5)
    assert_close_verbose(
        rapo_fast.rapo_advantages(rewards, gid, z, a=0.0), torch.cat([a_acc, torch.zeros(1)]), atol=1e-5
    )


def test_rapo_advantages_checks():
    r, g, z = torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.zeros(3)
    with pytest.raises(ValueError, match="group_ids"):
        rapo_fast.rapo_advantages(r, torch.zeros(2, dtype=torch.long), z)
    with pytest.raises(TypeError, match="group_ids"):
        rapo_fast.rapo_advantages(r, torch.zeros(3), z)
    with pytest.raises(ValueError, match="z_ret"):
        rapo_fast.rapo_advantages(r, g, torch.zeros(4))
    with pytest.raises(ValueError, match="rewards"):
        rapo_fast.rapo_advantages(torch.tensor([0.0, float("nan"), 1.0]), g, z)
    with pytest.raises(ValueError, match="eps"):
        rapo_fast.rapo_advantages(r, g, z, eps=0.0)
    with pytest.raises(TypeError, match="a"):
        rapo_fast.rapo_advantages(r, g, z, a="0.2")


# -- ret_norm="retrieved": A_ret z-scored over the rows that retrieved, 0 for the others --------------------------
def test_ret_norm_retrieved_by_hand():
    # group 0: rows 0, 1 retrieved (Z 0.4, 0.1), rows 2, 3 did not (Z 0 by convention; row 3's 9.0 must be ignored)
    # group 1: only row 4 retrieved -> A_ret = 0 for the whole group (std-0 rule); group 2: no row retrieved
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    z = torch.tensor([0.4, 0.1, 0.0, 9.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    ret = torch.tensor([True, True, False, False, True, False, False, False, False])
    eps = 1e-6
    # A_acc, group 0: mean 0.5, unbiased std sqrt(1/3); group 1: [0, 1, 1] mean 2/3, std sqrt(1/3); group 2: std
    # sqrt(1/2)
    s0, s1, s2 = math.sqrt(1 / 3), math.sqrt(1 / 3), math.sqrt(1 / 2)
    a_acc = [0.5 / (s0 + eps), -0.5 / (s0 + eps), 0.5 / (s0 + eps), -0.5 / (s0 + eps)]
    a_acc += [-2 / 3 / (s1 + eps), 1 / 3 / (s1 + eps), 1 / 3 / (s1 + eps), 0.5 / (s2 + eps), -0.5 / (s2 + eps)]
    # A_ret, group 0 over {0.4, 0.1}: mean 0.25, unbiased std sqrt(2 * 0.15^2 / 1) = 0.15 sqrt(2) -> +-1/sqrt(2)
    r = 0.15 / (0.15 * math.sqrt(2) + eps)
    a_ret = [r, -r, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    want = torch.tensor([(1 + 0.2 * ar) * aa for aa, ar in zip(a_acc, a_ret)], dtype=torch.float64)
    out = rapo_fast.rapo_advantages(rewards, gid, z, ret_norm="retrieved", retrieved=ret)
    assert out.dtype == torch.float32
    assert_close_verbose(out, want, atol=1e-5)
    # the rows that did not retrieve keep A = A_acc exactly, as does the group with one retrieving row
    a_acc_t = rapo_fast.rapo_advantages(rewards, gid, z, a=0.0)
    assert torch.equal(out[~ret], a_acc_t[~ret]) and out[4] == a_acc_t[4]
    # "group" (the default) scales the rows that never retrieved: their Z = 0 sits below the group's mean
    grp = rapo_fast.rapo_advantages(rewards, gid, z)
    assert not torch.allclose(grp[2], a_acc_t[2]) and not torch.allclose(grp[5:7], a_acc_t[5:7])


def test_ret_norm_retrieved_with_every_row_retrieving_equals_group():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 2, (24,), generator=g).double()
    gid = torch.randint(0, 5, (24,), generator=g)
    z = torch.randn(24, generator=g, dtype=torch.float64)
    every = torch.ones(24, dtype=torch.bool)
    out = rapo_fast.rapo_advantages(rewards, gid, z, ret_norm="retrieved", retrieved=every)
    assert torch.equal(out, rapo_fast.rapo_advantages(rewards, gid, z))  # bit for bit


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5), st.floats(-1, 1), st.booleans()), max_size=12),
    ret_norm=st.sampled_from(["group", "retrieved"]),
)
def test_rapo_advantages_match_loop(rows, ret_norm):
    """A_acc z-scored over each group, A_ret over its rows that retrieved ("retrieved") or all of them ("group")."""
    gid = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    rew = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    z = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    ret = torch.tensor([r[3] for r in rows], dtype=torch.bool)
    everyone = torch.ones_like(ret)

    def norm(x, rows_in):
        out = torch.zeros_like(x)
        for g in gid.unique():
            m = (gid == g) & rows_in
            v = x[m]
            if v.numel() == 0 or v.max() == v.min():
                continue
            out[m] = (v - v.mean()) / (v.std() + 1e-6)
        return out

    if ret_norm == "group":
        want, got = (1 + 0.2 * norm(z, everyone)) * norm(rew, everyone), rapo_fast.rapo_advantages(rew, gid, z)
    else:
        want = (1 + 0.2 * norm(z, ret)) * norm(rew, everyone)
        got = rapo_fast.rapo_advantages(rew, gid, z, ret_norm="retrieved", retrieved=ret)
    assert_close_verbose(got, want, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(
    "kw,exc,text",
    [
        (dict(ret_norm="all"), ValueError, "ret_norm"),
        (dict(ret_norm=1), TypeError, "ret_norm"),
        (dict(ret_norm="retrieved"), ValueError, "retrieved"),
        (dict(ret_norm="retrieved", retrieved=torch.ones(3)), TypeError, "retrieved"),
        (dict(ret_norm="retrieved", retrieved=torch.ones(4, dtype=torch.bool)), ValueError, "retrieved"),
        (dict(ret_norm="retrieved", retrieved=[True, False, True]), TypeError, "retrieved"),
        (dict(retrieved=torch.ones(3, dtype=torch.bool)), ValueError, "retrieved"),
    ],
)
def test_ret_norm_checks(kw, exc, text):
    r, g, z = torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.zeros(3)
    with pytest.raises(exc, match=text):
        rapo_fast.rapo_advantages(r, g, z, **kw)


def test_trainer_passes_ret_norm_and_the_scored_retrieval_mask(tmp_path, monkeypatch):
    """TrainerConfig.advantages.ret_norm reaches rapo_advantages; the mask is "a retrieval with a step after it" (the
    rows whose Z was measured); the default calls the advantage function with its four positional arguments only."""
    from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.retrieval.encoders import HashedNgramEncoder
    from rapo_fast.retrieval.step_traces import StepTraces
    from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig

    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")  # the loss kernels have their own tests
    task = ChainArithmeticTask()
    tok, problems = task.tokenizer(), task.make_problems(4, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 4, 0.2, seed=0), tmp_path / "t.jsonl")
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok)
    calls = []

    def adv_fn(rewards, group_ids, z, a, **kw):
        calls.append(kw)
        return rapo_fast.rapo_advantages(rewards, group_ids, z, a, **kw)

    for norm in ("group", "retrieved"):
        model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
        cfg = TrainerConfig.RAPO(
            {
                "rollout.group_size": 4,
                "rollout.hybrid.n_hybrid": 4,
                "rollout.hybrid.retrieve_prob": 1.0,
                "prompts_per_step": 2,
                "rollout.max_steps": 4,
                "rollout.max_step_tokens": 12,
                "advantages.ret_norm": norm,
            }
        )
        trainer = RAPOTrainer(model, tok, task, traces, cfg, problems, advantage_fn=adv_fn)
        trainer.step()
    assert calls[0] == {} and calls[1]["ret_norm"] == "retrieved"
    rets = trainer.last_batch.retrievals
    scored = torch.zeros(trainer.last_batch.batch_size, dtype=torch.bool)
    scored[rets[rets[:, 2] >= 0, 0]] = True
    assert scored.any() and not scored.all()  # this seed's rollout has rows of both kinds
    assert torch.equal(calls[1]["retrieved"], scored)
    with pytest.raises(ValueError, match="ret_norm"):
        TrainerConfig.RAPO({"advantages.ret_norm": "rows"})
