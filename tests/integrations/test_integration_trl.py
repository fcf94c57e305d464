"""Tests of rapo_fast.integrations.trl against the installed trl: same loss and gradients as GRPOTrainer's own.

How TRL's trainer is built here (no hub, no downloads): a tiny LlamaForCausalLM from a config (random weights, V=97,
hidden 48, 2 layers) and a word-level tokenizer built in memory; `RAPOGRPOTrainer` (a GRPOTrainer subclass) is
constructed once with beta=0 (a non-zero beta at construction would load a reference model from the hub), then the
loss options are set on the instance, the way TRL's `_compute_loss` reads them (self.loss_type, self.beta, ...).
TRL's own loss is `GRPOTrainer._compute_loss(trainer, model, inputs)` on a hand-built inputs dict with the keys its
`_generate_and_score_completions` produces, so no generation is needed; ours is `trainer._compute_loss`. Both run on
the same model, so equal losses and parameter gradients mean the adapter reproduces TRL.

Not tested here: multi-process (DDP/FSDP) runs, bf16 models, and TRL's vLLM path beyond its loss-side IS factor.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch

# Skip the module, with the reason, when trl or what it imports is missing or broken: `import trl` can succeed while
# `from trl import GRPOTrainer` raises a RuntimeError (trl 1.16 imports datasets lazily; the GPU image lacks it); an
# error at collection would stop `pytest -m gpu` before any test runs (tests/bench/test_gpu_stages.py checks it).
try:
    import transformers  # noqa: F401  (the tests build a tiny Llama with it)
    from trl import GRPOConfig, GRPOTrainer
except Exception as exc:  # ImportError, or any error raised while trl imports its own needs
    pytest.skip(f"trl integration needs trl and its imports: {exc!r}"[:300], allow_module_level=True)

from helpers import assert_close_verbose  # noqa: E402

from rapo_fast.integrations.trl import RAPOGRPOTrainer, trl_to_rapo_options  # noqa: E402

V = 97
MAX_COMPLETION = 9
TEMPERATURE = 0.7
# Both sides are fp32 on the CPU; TRL's chunked log-softmax and ours differ by summation order only.
LOSS_TOL = dict(atol=2e-6, rtol=2e-5)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)  # atol is relative to the tensor's largest gradient (see _compare)
# Under GRPOConfig's default bf16 autocast both sides run the backbone in bf16; the backward's rounding then differs.
BF16_GRAD_TOL = dict(atol=2e-2, rtol=2e-2)
# Under bf16 autocast the logits are bf16 and TRL takes their log-softmax in a different order of operations than our
# fp32-accumulating kernel: measured |diff| 1.4e-5 on a loss of 0.186 (trl 1.16, transformers 5.23, torch 2.13 CPU),
# i.e. 7e-5 relative, far below bf16's 2^-8 = 3.9e-3 unit roundoff. The fp32 bound above (atol 2e-6) is for fp32 runs.
BF16_LOSS_TOL = dict(atol=1e-4, rtol=1e-3)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V - 3)}
    vocab.update({"<pad>": V - 3, "<eos>": V - 2, "<unk>": V - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _build(rapo_options=None, **config):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=V - 3,
        eos_token_id=V - 2,
    )
    model = LlamaForCausalLM(cfg)
    ds = Dataset.from_dict({"prompt": ["t1 t2 t3", "t4 t5"] * 2})
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rapo_fast_test_trl"),  # one per trainer: tests may run in parallel
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        **{"bf16": False, **config},  # GRPOConfig defaults to bf16 autocast; fp32 gives the tight comparison
    )
    trainer = RAPOGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=ds,
        processing_class=_tokenizer(),
        rapo_options=rapo_options,
    )
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def trainer():
    return _build()


def _inputs(
    trainer, *, batch=5, prompt_len=4, width=7, with_old=True, empty_row=False, seed=1, noise=0.3, ref_shift=0.0
):
    """A batch shaped like GRPOTrainer._generate_and_score_completions' output (left-padded prompts)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, V - 3, (batch, prompt_len), generator=g)
    prompt_mask = torch.ones(batch, prompt_len, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    prompt_ids[1, :2] = V - 3
    completion_ids = torch.randint(0, V - 3, (batch, width), generator=g)
    lengths = torch.randint(2, width + 1, (batch,), generator=g)
    lengths[0] = width
    if empty_row:
        lengths[-1] = 0
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, V - 3)
    advantages = torch.randn(batch, generator=g)
    inputs = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=advantages,
        num_items_in_batch=completion_mask.sum() * 2,  # as if the generation batch spanned two micro-batches
    )
    # Current log-probs through TRL's own path, perturbed so that ratios fall on both sides of the clip range.
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            width,
        )
    if with_old:
        inputs["old_per_token_logps"] = logps + noise * torch.randn(logps.shape, generator=g)
    inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(logps.shape, generator=g)
    # ref_shift > 0 puts ref - logp near it on every other token: k3 past verl's clamp of 10 once ref - logp > ~2.6
    inputs["ref_per_token_logps"][:, ::2] += ref_shift
    inputs["sampling_per_token_logps"] = logps + 0.25 * torch.randn(logps.shape, generator=g)
    return inputs


def _loss_and_grads(fn, trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = fn(trainer, trainer.model, copy.copy(inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _compare(trainer, inputs, loss_tol=LOSS_TOL, grad_tol=GRAD_TOL):
    want, want_g = _loss_and_grads(GRPOTrainer._compute_loss, trainer, inputs)
    got, got_g = _loss_and_grads(RAPOGRPOTrainer._compute_loss, trainer, inputs)
    assert torch.isfinite(want) and want.abs() > 0
    assert_close_verbose(got, want, name="loss", **loss_tol)
    assert set(got_g) == set(want_g)
    for name in want_g:
        # atol relative to the tensor's largest gradient: the rounding of a sum scales with its terms.
        scale = want_g[name].abs().max().item()
        assert_close_verbose(
            got_g[name], want_g[name], name=f"grad {name}", atol=grad_tol["atol"] * scale, rtol=grad_tol["rtol"]
        )
    # The gradient must not be trivially zero, or the comparison above proves nothing.
    assert any(g.abs().max() > 0 for g in want_g.values())


CASES = {
    "grpo": dict(loss_type="grpo"),
    "grpo-empty-row": dict(loss_type="grpo", _empty_row=True),
    "grpo-clip-higher-dual": dict(
        loss_type="grpo", epsilon_high=0.28, delta=1.5, _noise=0.8, _differs=dict(delta=None)
    ),
    "grpo-gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "bnpo-kl": dict(loss_type="bnpo", beta=0.04),
    # k3 = e^3 - 4 = 16.09 on half the tokens: TRL does not clamp it, verl would (10.0, zero gradient)
    "bnpo-kl-past-verl-clamp": dict(loss_type="bnpo", beta=0.5, _ref_shift=3.0),
    "bnpo-entropy": dict(loss_type="bnpo", entropy_coef=0.05),
    "dr_grpo": dict(loss_type="dr_grpo", epsilon_high=0.28),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "grpo-no-old": dict(loss_type="grpo", _with_old=False),
    "dapo-vllm-tis": dict(loss_type="dapo", _vllm_tis=2.0),
}


def _configure(trainer, case):
    """Set the loss options on the trainer instance as GRPOTrainer.__init__ would have from a GRPOConfig."""
    args = trainer.args
    trainer.loss_type = case.get("loss_type", "grpo")
    trainer.epsilon_low = case.get("epsilon", 0.2)
    trainer.epsilon_high = case.get("epsilon_high", trainer.epsilon_low)
    trainer.importance_sampling_level = case.get("importance_sampling_level", "token")
    trainer.beta = case.get("beta", 0.0)
    args.use_bias_correction_kl = False
    args.delta = case.get("delta")
    trainer.entropy_coef = case.get("entropy_coef", 0.0)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0
    tis = case.get("_vllm_tis")
    trainer.use_vllm = tis is not None
    trainer.vllm_importance_sampling_correction = tis is not None
    trainer.vllm_importance_sampling_mode = "token_truncate"
    trainer.vllm_importance_sampling_clip_min = None
    trainer.vllm_importance_sampling_clip_max = tis
    trainer.current_gradient_accumulation_steps = 2
    if hasattr(trainer, "loss_plan"):  # the plan is made once, at construction: remade for the new attributes
        trainer.loss_plan = trl_to_rapo_options(trainer, trainer.rapo_options)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_trl_loss_and_grads(trainer, name):
    torch.manual_seed(0)
    case = CASES[name]
    _configure(trainer, case)
    inputs = _inputs(
        trainer,
        with_old=case.get("_with_old", True),
        empty_row=case.get("_empty_row", False),
        noise=case.get("_noise", 0.3),
        ref_shift=case.get("_ref_shift", 0.0),
    )
    if case.get("_vllm_tis") is not None:
        # Restated from GRPOTrainer._generate_and_score_completions (trl 1.16, mode "token_truncate"): the ratio TRL
        # multiplies its per-token loss by; our side derives the same weight from sampling_per_token_logps.
        mask = inputs["completion_mask"]
        inputs["sampling_per_token_logps"][0, 1] = float("nan")  # a token vLLM could not score
        diff = torch.nan_to_num((inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask, nan=0.0)
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp(diff), max=case["_vllm_tis"])
    try:
        _compare(trainer, inputs)
        if "_differs" in case:
            # The option under test changes TRL's own loss on these inputs, so the match above covers it.
            with torch.no_grad():
                with_opt = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))
                _configure(trainer, {**case, **case["_differs"]})
                without = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))
            assert (with_opt - without).abs() > 1e-6
    finally:
        _configure(trainer, {})


@pytest.mark.parametrize(
    "config, case, seed",
    [
        ({}, {"loss_type": "dapo", "epsilon_high": 0.28}, 7),  # GRPOConfig's default: TRL's log-prob pass autocast
        ({"cast_lm_head_to_fp32": True}, {"loss_type": "bnpo"}, 8),  # TRL's head in fp32 outside autocast
    ],
    ids=["autocast", "fp32-lm-head"],
)
def test_matches_trl_under_bf16_autocast(config, case, seed):
    trainer = _build(bf16=True, **config)
    _configure(trainer, case)
    _compare(trainer, _inputs(trainer, seed=seed), loss_tol=BF16_LOSS_TOL, grad_tol=BF16_GRAD_TOL)


def test_eval_mode_has_no_grad_accum_division(trainer):
    _configure(trainer, {"loss_type": "bnpo"})
    inputs = _inputs(trainer, seed=3)
    trainer.model.eval()
    try:
        with torch.no_grad():
            want = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))
            got = RAPOGRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))
        assert_close_verbose(got, want, name="eval loss", **LOSS_TOL)
    finally:
        trainer.model.train()


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(loss_type="cispo"), "cispo"),
        (dict(loss_type="sapo"), "sapo"),
        (dict(loss_type="vespo"), "vespo"),
        (dict(beta=0.1, use_bias_correction_kl=True), "use_bias_correction_kl"),
        (dict(delta=1.1), "delta"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(entropy_coef=0.01), "entropy_coef"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy"),
        (dict(use_vllm=True, vllm_importance_sampling_correction=True), "clip_max"),
        (
            dict(
                use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask"
            ),
            "vllm_importance_sampling_mode",
        ),
    ],
)
def test_options_without_exact_equivalent_raise(trainer, setting, match):
    fake = copy.copy(trainer)
    fake.args = copy.copy(trainer.args)
    _configure(fake, {})
    for key, value in setting.items():
        setattr(fake.args if key in ("use_bias_correction_kl", "delta") else fake, key, value)
    if "use_vllm" in setting:
        fake.vllm_importance_sampling_clip_min = None
    with pytest.raises(ValueError, match=match):
        trl_to_rapo_options(fake)


def test_logit_scale_folds_into_temperature_and_softcap_raises():
    from types import SimpleNamespace

    from rapo_fast.integrations.trl import _logit_scale

    assert _logit_scale(SimpleNamespace(config=SimpleNamespace(logit_scale=2.0))) == 2.0
    assert _logit_scale(SimpleNamespace(config=SimpleNamespace(model_type="granite", logits_scaling=4.0))) == 0.25
    assert _logit_scale(SimpleNamespace(config=SimpleNamespace())) == 1.0
    with pytest.raises(ValueError, match="softcapping"):
        _logit_scale(SimpleNamespace(config=SimpleNamespace(final_logit_softcapping=30.0)))


def test_unknown_rapo_option_raises(trainer):
    with pytest.raises(ValueError, match="unknown option"):
        trl_to_rapo_options(trainer, {"shaping": 0.05})


def test_mapping_table(trainer):
    _configure(trainer, {"loss_type": "dr_grpo", "epsilon_high": 0.28, "delta": 2.0})
    try:
        plan = trl_to_rapo_options(trainer, {"shaping_m": 0.05})
    finally:
        _configure(trainer, {})
    assert plan.options.loss_agg == "token-mean" and plan.normaliser == "batch_x_max_len"
    assert plan.options.eps_low == pytest.approx(0.2) and plan.options.eps_high == pytest.approx(0.28)
    assert plan.options.dual_clip == 2.0 and plan.options.shaping_m == 0.05
    assert plan.options.temperature == pytest.approx(TEMPERATURE)


def test_rapo_extras_reach_rapo_loss(trainer):
    """With retrieved tokens and shaping, the adapter equals rapo_loss called directly on the model's logits."""
    import rapo_fast

    trainer.rapo_options = {"shaping_m": 0.5, "offpolicy_train": "shaped", "gamma": 0.1}
    _configure(trainer, {"loss_type": "grpo"})
    inputs = _inputs(trainer, seed=5)
    width = inputs["completion_ids"].shape[1]
    retrieved = torch.zeros_like(inputs["completion_mask"], dtype=torch.bool)
    retrieved[0, 1:4] = True
    retrieved[2, :2] = True
    inputs["retrieved_mask"] = retrieved
    try:
        got, got_g = _loss_and_grads(RAPOGRPOTrainer._compute_loss, trainer, inputs)
        trainer.model.zero_grad(set_to_none=True)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logits = trainer.model(input_ids=input_ids, attention_mask=attention).logits[:, -width - 1 : -1]
        want = (
            rapo_fast.rapo_loss(
                logits,
                targets=inputs["completion_ids"],
                old_logp=inputs["old_per_token_logps"],
                advantages=inputs["advantages"],
                loss_mask=inputs["completion_mask"].bool(),
                retrieved_mask=retrieved,
                response_mask=inputs["completion_mask"].bool(),
                shaping_m=0.5,
                offpolicy_train="shaped",
                gamma=0.1,
                temperature=TEMPERATURE,
                loss_agg="seq-mean-token-mean",
                global_num_tokens=inputs["completion_ids"].shape[0],
            )
            / trainer.current_gradient_accumulation_steps
        )
        want.backward()
        assert_close_verbose(got, want.detach(), name="loss", **LOSS_TOL)
        for name, p in trainer.model.named_parameters():
            assert_close_verbose(got_g[name], p.grad, name=f"grad {name}", atol=1e-6, rtol=2e-4)
        # Shaping changes the loss: it is not silently dropped.
        trainer.rapo_options = {"offpolicy_train": "shaped", "gamma": 0.1}
        trainer.loss_plan = trl_to_rapo_options(trainer, trainer.rapo_options)
        plain = RAPOGRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs)).detach()
        assert (plain - got).abs() > 1e-6
    finally:
        trainer.rapo_options = {}
        _configure(trainer, {})


def test_one_training_step_runs():
    """A real GRPO step (generation, rewards, advantages, our loss, optimiser) on the tiny model."""
    trainer = _build(rapo_options={"shaping_m": 0.05}, max_steps=1, logging_steps=1, loss_type="grpo")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = trainer.train()
    assert torch.isfinite(torch.tensor(out.training_loss))
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "the optimiser step changed no parameter"
    logged = trainer.state.log_history[0]
    # metrics only our loss path records: the step went through RAPOGRPOTrainer._compute_loss
    assert "rapo/ratio_mean" in logged and "clip_ratio/low_mean" in logged


@pytest.mark.parametrize("extra", [{"offpolicy_train": "truncated"}, {"tis_cap": 2.0}], ids=["truncated", "tis_cap"])
def test_behaviour_logp_options_without_a_source_fail_at_construction(extra):
    """offpolicy_train="truncated" (and tis_cap) need inputs["sampling_per_token_logps"], which TRL's transformers
    generation never provides: refused when the trainer is built, naming the option, not at the first step."""
    with pytest.raises(ValueError, match=r"rapo_options: (offpolicy_train='truncated'|tis_cap) needs the behaviour"):
        _build(rapo_options=extra)


def test_truncated_is_accepted_where_behaviour_logps_can_come(trainer):
    """With a source of behaviour log-probs (vLLM, a rollout_func, or a subclass that builds the batches) the same
    option maps as before; a batch that still lacks them fails at the step, as documented."""
    fake = copy.copy(trainer)
    _configure(fake, {})
    fake.rollout_func = lambda prompts, trainer: None
    assert trl_to_rapo_options(fake, {"offpolicy_train": "truncated"}).options.offpolicy_train == "truncated"

    class WithOwnBatches(RAPOGRPOTrainer):
        def _generate_and_score_completions(self, inputs):  # pragma: no cover - never called here
            raise NotImplementedError

    sub = copy.copy(trainer)
    sub.__class__ = WithOwnBatches
    assert trl_to_rapo_options(sub, {"offpolicy_train": "truncated"}).options.offpolicy_train == "truncated"


@pytest.mark.parametrize("with_old", [True, False])
def test_log_prob_passes_of_one_loss_call(trainer, monkeypatch, with_old):
    """One loss call runs rapo_loss once and a separate log-prob pass only when TRL skipped the old log-probs (the
    per-sequence clip metrics read the log-probs the loss used: metrics.token_logp)."""
    import rapo_fast

    calls = []
    real = rapo_fast.token_logprobs
    monkeypatch.setattr(rapo_fast, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    _configure(trainer, {})
    inputs = _inputs(trainer, with_old=with_old)
    loss = RAPOGRPOTrainer._compute_loss(trainer, trainer.model, copy.copy(inputs))
    assert torch.isfinite(loss)
    assert len(calls) == (0 if with_old else 1)


def test_one_step_hands_the_plan_s_loss_options_to_the_loss(trainer, monkeypatch):
    """The plan is made once (at construction): a training step passes its LossOptions object to rapo_loss, with no
    option given as a keyword, and checks the options at most once (no LossOptions rebuilt from a dict each step)."""
    import rapo_fast
    from rapo_fast.loss.options import LossOptions

    seen, built = [], []
    real_loss, real_init = rapo_fast.rapo_loss, LossOptions.__init__
    monkeypatch.setattr(rapo_fast, "rapo_loss", lambda *a, **k: seen.append(k) or real_loss(*a, **k))
    monkeypatch.setattr(LossOptions, "__init__", lambda self, *a, **k: built.append(k) or real_init(self, *a, **k))
    _configure(trainer, {"loss_type": "dapo", "epsilon_high": 0.28})
    built.clear()
    try:
        inputs = _inputs(trainer, seed=4)
        plan = trainer.loss_plan
        assert torch.isfinite(RAPOGRPOTrainer._compute_loss(trainer, trainer.model, copy.copy(inputs)))
    finally:
        _configure(trainer, {})
    assert len(seen) == 1
    assert isinstance(seen[0]["options"], LossOptions) and seen[0]["options"] is plan.options
    assert not set(seen[0]) & set(LossOptions.names()), "an option passed as a keyword beside the object"
    assert len(built) <= 1, f"LossOptions built {len(built)} times in one step"
