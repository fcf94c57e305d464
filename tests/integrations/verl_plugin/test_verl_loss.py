"""The RAPO loss inside verl's actor update (rapo_fast/integrations/verl/actor_loss.py, policy_loss.py), verl 0.9.1.

Real verl code on the path: DataProto.to_tensordict (non_tensor_batch -> NonTensorStack), left_right_2_no_padding,
tu.chunk_tensordict / index_select_tensor_dict (micro-batching), verl's `ppo_loss` (no_padding_2_padding, field
selection, global-batch info, get_policy_loss_fn, metrics) as the engine worker binds it after `register()`
(verl.workers.engine_workers.ppo_loss), verl's `compute_policy_loss_vanilla` and `agg_loss`. Driven around it: the
model forward (the log-probs come from `rapo_fast.token_logprobs` on a logits leaf, laid out as the engine's nested
[prompt + response] log-prob output) and the engine's counters (dp_size, batch_num_tokens, global_batch_size are set
on the TensorDict as FSDPEngine.forward_backward_batch sets them).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils import losses as verl_losses  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import rapo_fast  # noqa: E402
from rapo_fast.integrations.verl import actor_loss, policy_loss  # noqa: E402

V = 37
MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _close(got, want, name, atol=2e-5, rtol=1e-4):
    err = (got.double() - want.double()).abs()
    bad = err > atol + rtol * want.double().abs()
    assert not bool(bad.any()), f"{name}: max err {float(err.max()):.3g} at {bad.nonzero()[:5].tolist()}"


def _batch(seed: int, retrieval: bool = True):
    """A padded verl batch: 4 rows, prompts of 3..5 tokens (left padded), responses of 9..13 tokens (right padded)
    mixing model tokens (response_mask 1), tool tokens and retrieved tokens (response_mask 0)."""
    g = torch.Generator().manual_seed(seed)
    P, R = 5, 13
    p_lens, r_lens = [5, 3, 4, 5], [13, 9, 11, 12]
    B = len(p_lens)
    kinds = torch.zeros(B, R, dtype=torch.int64)  # 0 pad, 1 model, 2 tool, 3 retrieved
    for i, n in enumerate(r_lens):
        kinds[i, :n] = 1
    kinds[0, 4:7] = 2  # tool output
    kinds[1, 3:5] = 2
    kinds[2, 8:10] = 2
    if retrieval:
        kinds[0, 7:10] = 3  # a retrieved step after the tool output
        kinds[2, 2:6] = 3
    prompts = torch.randint(1, V, (B, P), generator=g)
    responses = torch.randint(1, V, (B, R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        attn[i, P - p : P + r] = 1
    response_mask = (kinds == 1).long()
    logits = torch.randn(B, R, V, generator=g) * 1.5
    targets = responses
    with torch.no_grad():
        logp0 = rapo_fast.token_logprobs(logits, targets=targets)
    old = logp0 + 0.6 * torch.randn(B, R, generator=g)
    old[0, 0] = logp0[0, 0] - 1.6  # ratio ~5 > c = 3 ...
    adv = torch.randn(B, generator=g)[:, None].expand(B, R).contiguous()
    adv[0] = -abs(adv[0, 0]) - 0.5  # ... with A < 0: the dual clip is active there
    adv = adv * (attn[:, P:] > 0)
    retrieved = [[int(k == 3) for k in kinds[i, :n].tolist()] for i, n in enumerate(r_lens)]
    f_ret = [sum(r) / len(r) for r in retrieved]
    return dict(
        prompts=prompts,
        responses=responses,
        attention_mask=attn,
        response_mask=response_mask,
        old_log_probs=old,
        advantages=adv,
        logits=logits,
        kinds=kinds,
        retrieved=retrieved,
        f_ret=f_ret,
        p_lens=p_lens,
        r_lens=r_lens,
        P=P,
    )


def _tensordict(b, route: str = "legacy"):
    """The TensorDict the engine hands the loss: DataProto -> to_tensordict -> left_right_2_no_padding, with the
    RAPO fields as the legacy trainer (non_tensor_batch keys) or the v1 trainer (extra_fields dicts) carries them."""
    ids = torch.cat([b["prompts"], b["responses"]], 1)
    pos = (b["attention_mask"].cumsum(1) - 1).clamp_min(0)
    tensors = {k: b[k] for k in ("prompts", "responses", "attention_mask", "response_mask", "old_log_probs")}
    tensors.update(advantages=b["advantages"], input_ids=ids, position_ids=pos)
    non_tensors = {}
    if route == "legacy":
        non_tensors["rapo_retrieved_mask"] = np.array(b["retrieved"] + [None], dtype=object)[:-1]
        non_tensors["rapo_f_ret"] = np.array(b["f_ret"], dtype=object)
    elif route == "v1":
        rows = [{"rapo_retrieved_mask": r, "rapo_f_ret": f} for r, f in zip(b["retrieved"], b["f_ret"])]
        non_tensors["extra_fields"] = np.array(rows + [None], dtype=object)[:-1]
    td = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors or None).to_tensordict()
    td = left_right_2_no_padding(td)
    B = len(b["p_lens"])
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(b["response_mask"].sum()), global_batch_size=B)
    return td


def _model_output(b, logp_resp):
    """The engine's nested log-prob output: per row [prompt + response] positions, position t holding the log-prob of
    token t + 1 (no_padding_2_padding reads values[offset - resp_len - 1 : offset - 1])."""
    pieces, lens = [], []
    for i, (p, r) in enumerate(zip(b["p_lens"], b["r_lens"])):
        pieces += [logp_resp.new_zeros(p - 1), logp_resp[i, :r], logp_resp.new_zeros(1)]
        lens.append(p + r)
    offsets = torch.tensor([0] + lens).cumsum(0)
    return {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets=offsets)}


def _config(mode, loss_mode="rapo", **kw):
    """verl's actor config (the dataclass verl's worker builds from actor_rollout_ref.actor)."""
    return FSDPActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=4,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode=mode,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        **kw,
    )


@pytest.fixture(scope="module", autouse=True)
def _registered():
    actor_loss.register()
    actor_loss.register()  # idempotent


def _installed_loss(cfg):
    """The actor loss as ActorRolloutRefWorker.init_model binds it: partial(ppo_loss, config=actor_config), with the
    ppo_loss name of verl.workers.engine_workers (wrapped by register())."""
    import verl.workers.engine_workers as ew

    return functools.partial(ew.ppo_loss, config=cfg)


def _plugin_loss(b, mode, route="legacy", loss_mode="rapo", td=None):
    logits = b["logits"].clone().requires_grad_(True)
    logp = rapo_fast.token_logprobs(logits, targets=b["responses"])
    td = _tensordict(b, route) if td is None else td
    loss, metrics = _installed_loss(_config(mode, loss_mode))(model_output=_model_output(b, logp), data=td)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, metrics


def _rapo_loss(b, mode, dual_clip=3.0, shaping_m=0.05, trajectory=None):
    """rapo_fast.rapo_loss on the same batch: loss_mask = model tokens, F over every response token."""
    logits = b["logits"].clone().requires_grad_(True)
    B, R = b["responses"].shape
    lens = torch.tensor(b["r_lens"])
    traj = torch.arange(R)[None] < lens[:, None] if trajectory is None else trajectory
    retrieved = b["kinds"] == 3
    mask = b["response_mask"].bool()
    agg, norm = mode, None
    if mode == "token-mean":
        norm = int(mask.sum())
    elif mode == "token-sum":
        agg, norm = "token-mean", 1
    elif mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        norm = B
    else:
        agg, norm = "token-mean", B * R  # sum / (global_batch_size * T)
    loss = rapo_fast.rapo_loss(
        logits,
        targets=b["responses"],
        old_logp=b["old_log_probs"],
        advantages=b["advantages"],
        loss_mask=mask,
        retrieved_mask=retrieved,
        response_mask=traj,
        eps_low=0.2,
        eps_high=0.28,
        dual_clip=dual_clip,
        shaping_m=shaping_m,
        loss_agg=agg,
        global_num_tokens=norm,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


@pytest.mark.parametrize("route", ["legacy", "v1"])
@pytest.mark.parametrize("mode", MODES)
def test_installed_loss_equals_rapo_loss(mode, route):
    """verl's ppo_loss path with loss_mode "rapo" == rapo_fast.rapo_loss (shaping m = 0.05 with F over model, tool
    and retrieved tokens; dual clip c = clip_ratio_c = 3), forward and gradient."""
    torch.manual_seed(0)
    b = _batch(seed=1)
    got, g_got, metrics = _plugin_loss(b, mode, route)
    want, g_want = _rapo_loss(b, mode)
    _close(got, want, f"loss {mode}")
    _close(g_got, g_want, f"grad {mode}", atol=1e-6)
    assert float(metrics["actor/pg_clipfrac_lower"].values[0]) > 0  # verl's Metric: the dual clip was hit
    # F's denominator matters: with verl's response_mask (model tokens only) the loss differs
    wrong, _ = _rapo_loss(b, mode, trajectory=b["response_mask"].bool() | (b["kinds"] == 3))
    assert (wrong - want).abs() > 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_no_dual_clip_variant_equals_rapo_preset(mode):
    torch.manual_seed(0)
    b = _batch(seed=2)
    got, g_got, _ = _plugin_loss(b, mode, loss_mode="rapo_no_dual_clip")
    want, g_want = _rapo_loss(b, mode, dual_clip=None)
    _close(got, want, "loss")
    _close(g_got, g_want, "grad", atol=1e-6)
    with_dual, _ = _rapo_loss(b, mode, dual_clip=3.0)
    assert (with_dual - want).abs() > 1e-6  # the batch reaches the dual clip


@pytest.mark.parametrize("mode", MODES)
def test_retrieval_off_equals_verl_vanilla(mode):
    """No retrieval in the batch: loss_mode "rapo" through verl's ppo_loss == loss_mode "vanilla" through verl's
    ppo_loss (verl's compute_policy_loss_vanilla) == compute_policy_loss_vanilla called directly, with gradients."""
    torch.manual_seed(0)
    b = _batch(seed=3, retrieval=False)
    got, g_got, _ = _plugin_loss(b, mode, route="none")
    van, g_van, _ = _plugin_loss(b, mode, route="none", loss_mode="vanilla")
    _close(got, van, "rapo vs vanilla (ppo_loss)")
    _close(g_got, g_van, "grad rapo vs vanilla", atol=1e-6)
    # with the RAPO fields present but no retrieved token, still vanilla
    got2, g_got2, _ = _plugin_loss(b, mode, route="legacy")
    _close(got2, van, "rapo (empty retrieval) vs vanilla")
    _close(g_got2, g_van, "grad", atol=1e-6)
    # verl's function itself, on the padded tensors ppo_loss builds
    logits = b["logits"].clone().requires_grad_(True)
    logp = rapo_fast.token_logprobs(logits, targets=b["responses"])
    cfg = _config(mode, "vanilla")
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(b["response_mask"].sum()), global_batch_size=4)
    direct, _ = compute_policy_loss_vanilla(
        b["old_log_probs"], logp, b["advantages"], b["response_mask"].bool(), mode, cfg, None
    )
    (g_direct,) = torch.autograd.grad(direct, logits)
    _close(got, direct.detach(), "rapo vs compute_policy_loss_vanilla")
    _close(g_got, g_direct, "grad vs compute_policy_loss_vanilla", atol=1e-6)


def test_shaping_changes_the_loss_with_retrieval():
    b = _batch(seed=4)
    rapo, _, _ = _plugin_loss(b, "seq-mean-token-mean")
    van, _, _ = _plugin_loss(b, "seq-mean-token-mean", loss_mode="vanilla")
    assert (rapo - van).abs() > 1e-6


def test_micro_batches_sum_to_the_batch_loss():
    """verl's chunk_tensordict and index_select_tensor_dict carry the RAPO fields with the rows: the micro-batch losses
    (global normalisers) sum to the whole batch's loss, and a reordered batch gives the same loss."""
    b = _batch(seed=5)
    for route in ("legacy", "v1"):
        td = _tensordict(b, route)
        full, _, _ = _plugin_loss(b, "token-mean", route, td=td)
        for chunks in (([0, 1], [2, 3]), ([0], [1], [2], [3])):  # micro-batches of one row too
            total = 0.0
            for idx, mb in zip(chunks, tu.chunk_tensordict(td, len(chunks))):
                loss, _, _ = _plugin_loss(_sub_batch(b, idx), "token-mean", route, td=mb)
                total = total + loss
            _close(total, full, f"micro-batch sum ({route}, {len(chunks)} chunks)")
        perm = [2, 0, 3, 1]
        loss, _, _ = _plugin_loss(_sub_batch(b, perm), "token-mean", route, td=tu.index_select_tensor_dict(td, perm))
        _close(loss, full, f"reordered ({route})")


def _sub_batch(b, idx):
    out = dict(b)
    for k in ("prompts", "responses", "attention_mask", "response_mask", "old_log_probs", "advantages", "logits"):
        out[k] = b[k][idx]
    out["kinds"] = b["kinds"][idx]
    for k in ("retrieved", "f_ret", "p_lens", "r_lens"):
        out[k] = [b[k][i] for i in idx]
    return out


def test_register_wraps_the_worker_loss_transparently():
    import verl.workers.engine_workers as ew

    assert getattr(ew.ppo_loss, "_rapo_wrapped", False)
    assert ew.ppo_loss.__wrapped__ is verl_losses.ppo_loss
    assert "rapo" in policy_loss.POLICY_LOSSES and get_policy_loss_fn("rapo").__name__ == "rapo_policy_loss_rapo"
    b = _batch(seed=6)
    logp = rapo_fast.token_logprobs(b["logits"], targets=b["responses"])
    cfg = _config("token-mean", "vanilla")
    out = _model_output(b, logp)
    wrapped, _ = ew.ppo_loss(config=cfg, model_output=out, data=_tensordict(b))
    plain, _ = verl_losses.ppo_loss(config=cfg, model_output=out, data=_tensordict(b))
    assert torch.equal(wrapped, plain)
    # the explicit form (set_loss_fn(partial(rapo_ppo_loss, config=...))) gives the same as the installed one
    cfg = _config("token-mean")
    explicit, _ = actor_loss.rapo_ppo_loss(cfg, out, _tensordict(b))
    installed, _ = _installed_loss(cfg)(model_output=out, data=_tensordict(b))
    assert torch.equal(explicit, installed)
    assert actor_loss.current_rapo_fields() is None  # the context does not leak out of the call


def test_bad_fields_raise():
    b = _batch(seed=7)
    short = dict(b, retrieved=[r[:-1] for r in b["retrieved"]])
    with pytest.raises(ValueError, match="rapo_retrieved_mask"):
        _plugin_loss(short, "token-mean")
    bad_f = dict(b, f_ret=[f + 0.1 for f in b["f_ret"]])
    with pytest.raises(ValueError, match="rapo_f_ret"):
        _plugin_loss(bad_f, "token-mean")
    on_model = [list(r) for r in b["retrieved"]]
    on_model[1][0] = 1  # a model token (response_mask 1) flagged as retrieved
    with pytest.raises(ValueError, match="response_mask"):
        _plugin_loss(dict(b, retrieved=on_model, f_ret=[sum(r) / len(r) for r in on_model]), "token-mean")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss.rapo_policy_loss(
            b["old_log_probs"], b["old_log_probs"], b["advantages"], b["response_mask"], dual_clip=0.5
        )
    with pytest.raises(ValueError, match="trajectory_mask"):
        policy_loss.rapo_policy_loss(
            b["old_log_probs"],
            b["old_log_probs"],
            b["advantages"],
            b["response_mask"],
            trajectory_mask=b["response_mask"][:, :3],
        )


def test_registered_loss_outside_the_route_warns_once(monkeypatch):
    """verl's plain ppo_loss (route not installed) with loss_mode "rapo": F = 0, and a warning says why."""
    monkeypatch.setattr(policy_loss, "_warned_no_route", False)
    b = _batch(seed=8)
    logp = rapo_fast.token_logprobs(b["logits"], targets=b["responses"])
    cfg = _config("token-mean")
    with pytest.warns(UserWarning, match="outside rapo_fast's actor-loss route"):
        verl_losses.ppo_loss(config=cfg, model_output=_model_output(b, logp), data=_tensordict(b))
    # inside the route, a batch without RAPO fields is silent
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(policy_loss, "_warned_no_route", False)
        _installed_loss(cfg)(model_output=_model_output(b, logp), data=_tensordict(b, route="none"))


def test_fused_logprobs_in_verls_model_forward(monkeypatch):
    """logprobs.register(True): verl's fused-kernel actor forward (dense_common.forward_with_torch_backend, real, on
    a 2-layer Qwen2 built from a config) computes log-probs and entropy with rapo_fast's kernel; equal to verl's own
    FusedLinearForPPO, forward and gradients."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.dense_common import forward_with_torch_backend
    from verl.utils.experimental import torch_functional as tf

    from rapo_fast.integrations.verl import logprobs

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).float()
    ids = torch.randint(0, 61, (2, 11))

    def run():
        model.zero_grad(set_to_none=True)
        out = forward_with_torch_backend(model, input_ids=ids, return_dict=True, temperature=0.7)
        (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
        grads = [p.grad.clone() for p in (model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight)]
        return out.log_probs.detach(), out.entropy.detach(), grads

    verl_class = tf.FusedLinearForPPO
    want = run()
    try:
        assert logprobs.register(True) and tf.FusedLinearForPPO is logprobs.RAPOFusedLinearForPPO
        assert logprobs.register(True)  # idempotent
        got = run()
    finally:
        logprobs.unregister()
    assert tf.FusedLinearForPPO is verl_class
    monkeypatch.delenv(logprobs.FUSED_ENV, raising=False)
    assert not logprobs.register()  # opt-in: off without the environment variable
    _close(got[0], want[0], "log_probs", atol=1e-5)
    _close(got[1], want[1], "entropy", atol=1e-5)
    for g, w in zip(got[2], want[2]):
        _close(g, w, "grad", atol=1e-5)
