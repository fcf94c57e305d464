"""Tests of rapo_fast.integrations.trl_rollout: RAPO's hybrid rollouts inside TRL's GRPOTrainer via `rollout_func`.

(a) examples/trl/rapo_grpo_arith.py runs a few steps on the CPU in under 2 minutes; (b) retrieved tokens get no
gradient: the loss's gradient w.r.t. the backbone's last hidden state is exactly 0 at every position that predicts a
retrieved token, in RAPOGRPOTrainer and in TRL's own loss; (c) with retrieval off, RAPOGRPOTrainer + the rollout_func
equals TRL's GRPOTrainer + the same rollout_func (same seed, same warm-started weights, SGD so that the parameter
change is the gradient): same completions, same logged loss and parameters to the parity tolerances of
tests/integrations/test_integration_trl.py; (d) the rollout's inputs: stored token ids past the tokenizer or the model's
embedding are refused at bind, success_fn's results are bools or finite numbers (NaN raises, adding nothing). Not
tested: TRL's own generation (its sampler differs from rollout()'s). Two processes: test_trl_two_processes.py.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

try:
    from trl import GRPOTrainer  # noqa: F401
except Exception as exc:  # ImportError, or any error raised while trl imports its own needs
    pytest.skip(f"trl integration needs trl and its imports: {exc!r}"[:300], allow_module_level=True)

from helpers import assert_close_verbose  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOSS_TOL = dict(atol=2e-6, rtol=2e-5)  # as test_integration_trl.py (fp32, CPU)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)  # atol relative to the largest parameter change


def _example():
    spec = importlib.util.spec_from_file_location("rapo_grpo_arith", ROOT / "examples" / "trl" / "rapo_grpo_arith.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EX = _example()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model on one thread, as the example runs it: more only wait on each other on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def warm_state(tmp_path_factory):
    """The example's SFT warm-up, once for the module's tests."""
    _, _, state = EX.build_trainer(EX.parse_args([]), tmp_path_factory.mktemp("warm"))
    return state


@pytest.fixture
def torch_loss_path(monkeypatch):
    """rapo_loss on its torch path, as a user's CPU runs it: under TRITON_INTERPRET=1 the Triton kernels would run in
    Triton's interpreter, which no user's run does, and which was most of these tests' time. The kernels themselves:
    their loss and gradients against TRL's own in test_integration_trl.py, a masked token's gradient exactly zero on
    every path in tests/loss/test_masked_rows.py."""
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")


def test_example_runs_in_under_two_minutes(tmp_path, capsys, torch_loss_path):
    t0 = time.perf_counter()
    assert EX.main(["--steps", "2", "--out", str(tmp_path)]) == 0
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert "trained 2 steps" in out, out
    assert elapsed < 120, f"the example took {elapsed:.1f} s"


def _hidden_grads(trainer, batch, loss_fn):
    """d loss / d last hidden state [B, L, H] of `loss_fn(trainer, model, batch)` (a forward hook adds a zero
    tensor that requires grad to the backbone's output)."""
    deltas = []

    def hook(_module, _args, output):
        delta = torch.zeros_like(output.last_hidden_state, requires_grad=True)
        deltas.append(delta)
        output.last_hidden_state = output.last_hidden_state + delta
        return output

    handle = trainer.model.model.register_forward_hook(hook)
    try:
        trainer.model.zero_grad(set_to_none=True)
        loss_fn(trainer, trainer.model, dict(batch)).backward()
    finally:
        handle.remove()
    assert len(deltas) == 1
    return deltas[0].grad


def test_retrieved_tokens_get_no_gradient(tmp_path, warm_state, torch_loss_path):
    from rapo_fast.integrations.trl import RAPOGRPOTrainer

    args = EX.parse_args(["--retrieve-prob", "1.0"])
    trainer, rollout_func, _ = EX.build_trainer(args, tmp_path, warm_state)
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(4) for _ in range(args.group_size)]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by trainer.train(); the loss divides by it
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    retrieved = batch["retrieved_mask"]
    assert retrieved.any(), "no retrieval happened: the test would prove nothing"
    # the retrieved tokens are outside TRL's loss mask (env_mask -> tool_mask) and inside the response
    assert not (batch["tool_mask"].bool() & retrieved).any()
    assert (batch["completion_mask"].bool() | ~retrieved).all()
    batch["advantages"] = torch.linspace(-1.0, 1.0, len(prompts))  # a non-zero signal on every row
    width, start = batch["completion_ids"].shape[1], batch["prompt_ids"].shape[1]
    for fn in (RAPOGRPOTrainer._compute_loss, GRPOTrainer._compute_loss):
        grads = _hidden_grads(trainer, batch, fn)
        # hidden position start + j - 1 predicts completion token j
        per_token = grads[:, start - 1 : start - 1 + width].abs().sum(-1)
        assert torch.all(per_token[retrieved] == 0), f"{fn.__qualname__}: gradient at retrieved tokens"
        generated = batch["tool_mask"].bool() & batch["completion_mask"].bool()
        assert per_token[generated].max() > 0, f"{fn.__qualname__}: no gradient at all"


def _one_run(trainer_name: str, out: Path, warm_state: dict):
    argv = ["--no-retrieval", "--steps", "2", "--trainer", trainer_name, "--optim", "sgd", "--lr", "0.1"]
    trainer, rollout_func, _ = EX.build_trainer(EX.parse_args(argv), out, warm_state)
    ids = []

    def recording(prompts, tr):
        result = rollout_func(prompts, tr)
        ids.append(result["completion_ids"])
        return result

    trainer.rollout_func = recording
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return ids, losses, params


def test_without_retrieval_equals_trl_grpo_trainer(tmp_path, warm_state, torch_loss_path):
    ids_trl, loss_trl, params_trl = _one_run("grpo", tmp_path / "trl", warm_state)
    ids_rapo, loss_rapo, params_rapo = _one_run("rapo", tmp_path / "rapo", warm_state)
    assert ids_rapo == ids_trl, "the two runs sampled different completions"
    assert len(loss_trl) == len(loss_rapo) == 2
    assert any(abs(x) > 0 for x in loss_trl), "zero losses: the comparison would prove nothing"
    for got, want in zip(loss_rapo, loss_trl):
        assert_close_verbose(torch.tensor(got), torch.tensor(want), name="loss", **LOSS_TOL)
    changed = False
    for name, want in params_trl.items():
        delta_want = want - warm_state[name] if name in warm_state else want
        scale = delta_want.abs().max().item()
        changed |= scale > 0
        assert_close_verbose(
            params_rapo[name], want, name=f"param {name}", atol=GRAD_TOL["atol"] * max(scale, 1e-12), rtol=1e-6
        )
    assert changed, "no parameter moved: the comparison would prove nothing"


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_metrics_under_trl_names_match_trl(tmp_path, warm_state, level):
    """clip_ratio/{low_mean, high_mean, region_mean, low_min, high_max}: our loss logs TRL's values on one batch."""
    from rapo_fast.integrations.trl import RAPOGRPOTrainer, trl_to_rapo_options

    args = EX.parse_args(["--no-retrieval", "--shaping", "0"])
    trainer, _, _ = EX.build_trainer(args, tmp_path, warm_state)
    trainer.importance_sampling_level = level
    trainer.loss_plan = trl_to_rapo_options(trainer, trainer.rapo_options)  # made at construction: remade here
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(2) for _ in range(args.group_size)]
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            batch["completion_ids"].shape[1],
        )
    # per token noise, plus a per row shift that moves the sequence-level ratios past the clip bounds
    noise = 0.4 * torch.randn(logps.shape, generator=g) + 0.5 * torch.randn(logps.shape[0], 1, generator=g)
    batch["old_per_token_logps"] = (logps + noise).clamp(max=0.0)
    batch["advantages"] = torch.randn(len(prompts), generator=g)
    names = [f"clip_ratio/{k}" for k in ("low_mean", "high_mean", "region_mean", "low_min", "high_max")]
    got = {}
    for fn in (GRPOTrainer._compute_loss, RAPOGRPOTrainer._compute_loss):
        trainer._metrics["train"].clear()
        with torch.no_grad():
            fn(trainer, trainer.model, dict(batch))
        got[fn] = {k: trainer._metrics["train"][k][-1] for k in names}
    want, ours = got[GRPOTrainer._compute_loss], got[RAPOGRPOTrainer._compute_loss]
    assert any(v > 0 for v in want.values()), f"nothing clipped: the comparison would prove nothing ({want})"
    for k in names:
        assert ours[k] == pytest.approx(want[k], abs=1e-6), (k, ours, want)


# -- the rollout's inputs: stored token ids, success_fn's results ----------------------------------------------------
def _tokenizers_and_traces(tmp_path):
    """(the task's tokenizer, one with a word more, a StepTraces of seed steps built with the larger one and holding a
    step that uses that word: its id is past the smaller tokenizer's vocabulary)."""
    from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
    from rapo_fast.integrations.trl import HashedNgramEncoder, StepTraces

    task = ChainArithmeticTask()
    small, big = EX.hf_tokenizer(task.tokenizer()), EX.hf_tokenizer(task.tokenizer())
    assert big.add_tokens(["zebra"]) == 1
    jsonl = write_jsonl(solver_trajectories(task, task.make_problems(4, seed=1), 2, seed=0), tmp_path / "s.jsonl")
    traces = StepTraces.from_jsonl(jsonl, HashedNgramEncoder(), big, top_k=1)
    traces.add_steps(["a history"], ["zebra <tool> 1 + 2 </tool> 3"], [7])
    return task, small, big, traces


def test_stored_token_ids_past_the_tokenizer_or_the_embedding_are_refused_at_bind(tmp_path):
    """A buffer built with a larger tokenizer than the rollout's (or the model's embedding) would fail inside the
    embedding at the first retrieval of such a step: bind refuses it, naming traces and both sizes."""
    from types import SimpleNamespace

    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.integrations.trl import make_rollout_func

    task, small, big, traces = _tokenizers_and_traces(tmp_path)
    n_small, n_big = len(small), len(big)
    rollout_func = make_rollout_func(task, traces, tokenizer=small)  # the tags have the same ids in both
    trainer = SimpleNamespace(processing_class=small, model=build_tiny_policy(n_small, hidden_size=16, seed=0))
    match = rf"traces: expected token ids below {n_small} \(the tokenizer's {n_small} tokens, the model's input "
    with pytest.raises(ValueError, match=match + rf"embedding of {n_small} rows\), got 1 of \d+ stored steps"):
        rollout_func.bind(trainer)
    # the larger tokenizer throughout, but a model whose embedding was not resized to it
    rollout_func = make_rollout_func(task, traces)
    trainer = SimpleNamespace(processing_class=big, model=build_tiny_policy(n_small, hidden_size=16, seed=0))
    with pytest.raises(ValueError, match=rf"below {n_small} \(the tokenizer's {n_big} tokens, .* {n_small} rows\)"):
        rollout_func.bind(trainer)
    trainer.model = build_tiny_policy(n_big, hidden_size=16, seed=0)
    rollout_func.bind(trainer)  # everything fits: accepted
    assert rollout_func._bound is trainer


@pytest.mark.parametrize(
    "value, want",
    [
        (True, 1.0),
        (False, 0.0),
        (1, 1.0),
        (0, 0.0),
        (10**400, 1.0),
        (0.7, 1.0),
        (0.5, 0.0),
        (-3.0, 0.0),
        (torch.tensor(True), 1.0),
        (torch.tensor([0.2]), 0.0),
    ],
)
def test_success_values_accepted(value, want):
    import numpy as np

    from rapo_fast.integrations.trl_rollout import success_value

    assert success_value(value) == want
    assert success_value(np.bool_(bool(want))) == want and success_value(np.float32(want)) == want


@pytest.mark.parametrize(
    "value, error",
    [(float("nan"), ValueError), (float("inf"), ValueError), (None, TypeError), ("yes", TypeError), ([1], TypeError)],
)
def test_success_values_refused_name_success_fn(value, error):
    from rapo_fast.integrations.trl_rollout import success_value

    with pytest.raises(error, match=r"rapo rollout_func: success_fn: expected a bool or a finite number"):
        success_value(value)


def test_a_nan_from_success_fn_raises_and_adds_nothing(tmp_path):
    """success_fn returning NaN in a training rollout: ValueError naming success_fn, the buffer unchanged (before,
    bool(nan) counted it as a success and its steps entered the buffer)."""
    args = EX.parse_args(["--sft-steps", "0", "--prompts-per-step", "1"])
    trainer, rollout_func, _ = EX.build_trainer(args, tmp_path)
    rollout_func.success_fn = lambda prompt, completion: float("nan")
    traces = rollout_func.traces
    before = (dict(traces.payloads), traces.num_onpolicy, traces.buffer.embeddings.clone())
    trainer.model.train()
    prompts = [trainer.train_dataset[0]["prompt"]] * args.group_size
    with pytest.raises(ValueError, match="success_fn: expected a bool or a finite number .*got nan"):
        rollout_func(prompts, trainer)
    assert (traces.payloads, traces.num_onpolicy) == before[:2] and torch.equal(traces.buffer.embeddings, before[2])
