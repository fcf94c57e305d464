"""KV splice on tiny Hugging Face models built from configs (random weights, no downloads): Llama (GQA), Qwen2,
GPT-NeoX (partial rotary) and GPT-J (interleaved pairs, partial rotary).

Checks: after a splice at position p > 0, layer-0 keys/values equal those of a full forward of the spliced sequence;
a segment spliced into an empty context equals the full forward in every layer; generation from a spliced cache
continues with the same tokens as exact mode when the segment sits at position 0; DynamicCache and StaticCache agree;
ragged (left-padded) batches with per-row rope positions; the splice-vs-exact divergence (KL of next-token
distributions, mean |logp_train - logp_behaviour| of sampled tokens) is measured and printed, not hidden.
Not here: backend-vs-reference numerics (tests/kv/test_kv_splice.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import ATOL, assert_close_verbose
from transformers import (
    DynamicCache,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

from rapo_fast import _ext
from rapo_fast.kv.hf_cache import cache_kwarg
from rapo_fast.kv.splice import RopeSpec, StepKVStore, insert_segment, splice_kv

V = 97
BACKEND = "cpu" if _ext.has_extension() else "reference"


_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=V)
_MODELS = {  # (model class, config class, config fields past the common ones)
    "llama": (LlamaForCausalLM, LlamaConfig, dict(_DECODER, num_key_value_heads=2)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(_DECODER, num_key_value_heads=1, rope_theta=1e6)),
    "neox": (GPTNeoXForCausalLM, GPTNeoXConfig, dict(_DECODER, rotary_pct=0.25)),
    "gptj": (GPTJForCausalLM, GPTJConfig, dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=V)),
}


def _model(kind: str, dtype=torch.float32):
    torch.manual_seed(1)
    model_cls, config_cls, fields = _MODELS[kind]
    if kind == "gptj":
        cfg = config_cls(n_positions=512, bos_token_id=0, eos_token_id=0, **fields)
    else:
        cfg = config_cls(max_position_embeddings=512, **fields)
    return model_cls(cfg).eval().to(dtype)


def _prefill(model, ids, cache=None):
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    return cache, out.logits[:, -1].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "neox", "gptj"])
def test_layer0_matches_full_forward_and_empty_context_is_exact(kind):
    model = _model(kind)
    rope = RopeSpec.from_model(model)
    assert rope.layout == ("interleaved" if kind == "gptj" else "rotate_half")
    store = StepKVStore.for_model(model)
    segs = [[5, 7, 9, 11, 13, 2, 40], [3, 1, 4]]
    store.add_from_model(model, [10, 11], segs)
    ctx = torch.randint(0, V, (1, 23))
    for pid, seg in zip([10, 11], segs):
        full, _ = _prefill(model, torch.cat([ctx, torch.tensor([seg])], 1))
        cache, _ = _prefill(model, ctx)
        assert splice_kv(cache, store, [(pid, 0, 23)], rope, backend=BACKEND) == 23 + len(seg)
        k0, v0 = cache.layers[0].keys, cache.layers[0].values
        assert_close_verbose(k0, full.layers[0].keys, atol=ATOL[torch.float32], name=f"{kind} layer-0 keys")
        assert_close_verbose(v0, full.layers[0].values, atol=ATOL[torch.float32], name=f"{kind} layer-0 values")
        deep = (cache.layers[1].keys[:, :, 23:] - full.layers[1].keys[:, :, 23:]).abs().max().item()
        print(f"{kind}: layer-1 key |splice - full| max {deep:.3g} (expected > 0: no cross-attention to the context)")
        empty = DynamicCache(config=model.config)
        splice_kv(empty, store, [(pid, 0, 0)], rope, backend=BACKEND)
        ref, _ = _prefill(model, torch.tensor([seg]))
        # R(0) is the identity; the store was computed in a padded batch, so allow matmul rounding only.
        for layer in range(2):
            assert_close_verbose(empty.layers[layer].keys, ref.layers[layer].keys, atol=1e-5, name=f"empty K{layer}")
            assert_close_verbose(
                empty.layers[layer].values, ref.layers[layer].values, atol=1e-5, name=f"empty V{layer}"
            )


def test_layer0_bf16_llama():
    model = _model("llama", torch.bfloat16)
    store = StepKVStore.for_model(model)
    seg = list(range(20, 36))
    store.add_from_model(model, [1], [seg])
    ctx = torch.randint(0, V, (2, 300))
    full, _ = _prefill(model, torch.cat([ctx, torch.tensor([seg, seg])], 1))
    cache, _ = _prefill(model, ctx)
    splice_kv(cache, store, [(1, 0, 300), (1, 1, 300)], RopeSpec.from_model(model), backend=BACKEND)
    # HF rounds cos/sin to bf16 and rotates in bf16; we rotate in fp32 and round once: compare at the bf16 floor.
    assert_close_verbose(cache.layers[0].keys, full.layers[0].keys, atol=ATOL[torch.bfloat16], name="bf16 keys")
    assert torch.equal(cache.layers[0].values, full.layers[0].values)


def _generate(model, cache, logits, next_pos, steps, *, sample_seed=None):
    """Greedy (or seeded sampling) continuation; returns tokens [B, steps] and their behaviour log-probs."""
    toks, logps = [], []
    g = None if sample_seed is None else torch.Generator().manual_seed(sample_seed)
    pos = next_pos.clone()
    for _ in range(steps):
        lp = torch.log_softmax(logits, -1)
        tok = lp.argmax(-1) if g is None else torch.multinomial(lp.exp(), 1, generator=g)[:, 0]
        toks.append(tok)
        logps.append(lp.gather(1, tok[:, None])[:, 0])
        with torch.no_grad():
            out = model(
                input_ids=tok[:, None], position_ids=pos[:, None], use_cache=True, **{cache_kwarg(model): cache}
            )
        logits, pos = out.logits[:, -1].float(), pos + 1
    return torch.stack(toks, 1), torch.stack(logps, 1)


@pytest.mark.parametrize("kind", ["llama", "gptj"])
def test_generation_from_spliced_segment_at_position_0_equals_exact(kind):
    model = _model(kind)
    store = StepKVStore.for_model(model)
    seg = [8, 6, 7, 5, 3, 0, 9, 12, 30]
    store.add_from_model(model, [3], [seg])
    runs = {}
    for mode in ("exact", "splice"):
        cache = DynamicCache(config=model.config)
        r = insert_segment(model, cache, [seg], [0], [0], mode=mode, store=store, payload_ids=[3], backend=BACKEND)
        assert r.next_slot == len(seg) == cache.get_seq_length()
        runs[mode] = (r.logits, *_generate(model, cache, r.logits, r.next_positions, 12))
    assert_close_verbose(runs["splice"][0], runs["exact"][0], atol=1e-4, name="next-token logits")
    assert torch.equal(runs["splice"][1], runs["exact"][1])


def _kl(p_logits, q_logits):
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "neox"])
def test_splice_vs_exact_divergence_and_behaviour_logp_mismatch(kind):
    model = _model(kind)
    store = StepKVStore.for_model(model)
    b, ctx_len, steps = 4, 24, 16
    segs = [torch.randint(0, V, (12,)).tolist() for _ in range(b)]
    store.add_from_model(model, list(range(b)), segs)
    ctx = torch.randint(0, V, (b, ctx_len))
    res = {}
    for mode in ("exact", "blend", "splice"):
        cache, _ = _prefill(model, ctx)
        r = insert_segment(
            model,
            cache,
            segs,
            list(range(b)),
            [ctx_len] * b,
            mode=mode,
            store=store,
            payload_ids=list(range(b)),
            blend_fraction=0.25,
            backend=BACKEND,
        )
        toks, behav = _generate(model, cache, r.logits, r.next_positions, steps, sample_seed=7)
        # "train" log-probs: one full forward of context + segment + sampled tokens, as the trainer recomputes them
        full = torch.cat([ctx, torch.tensor(segs), toks], 1)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=full).logits.float(), -1)
        start = ctx_len + 12 - 1
        train = lp[:, start : start + steps].gather(2, toks[:, :, None])[:, :, 0]
        res[mode] = (r.logits, (train - behav).abs().mean().item())
    kl = {m: _kl(res["exact"][0], res[m][0]).mean().item() for m in ("splice", "blend")}
    print(
        f"\n[{kind}] next-token KL(exact || splice) = {kl['splice']:.4g}, KL(exact || blend 25%) = {kl['blend']:.4g};"
        f" mean |logp_train - logp_behaviour|: exact {res['exact'][1]:.3g}, blend {res['blend'][1]:.3g},"
        f" splice {res['splice'][1]:.3g}"
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in kl.values())
    assert res["exact"][1] < 1e-4, "exact mode must reproduce the full-attention log-probs (measurement sanity)"
    assert torch.isfinite(torch.tensor(res["splice"][1]))


def test_static_cache_matches_dynamic_cache():
    model = _model("llama")
    store = StepKVStore.for_model(model)
    seg = [1, 2, 3, 4, 5, 6]
    store.add_from_model(model, [0], [seg])
    ctx = torch.randint(0, V, (2, 9))
    out = {}
    for kind in ("dynamic", "static"):
        cache = DynamicCache(config=model.config) if kind == "dynamic" else StaticCache(model.config, max_cache_len=40)
        _prefill(model, ctx, cache)
        r = insert_segment(
            model, cache, [seg, seg], [0, 1], [9, 9], mode="splice", store=store, payload_ids=[0, 0], backend=BACKEND
        )
        assert int(cache.get_seq_length()) == 15
        out[kind] = (r.logits, _generate(model, cache, r.logits, r.next_positions, 6)[0])
    assert_close_verbose(out["static"][0], out["dynamic"][0], atol=1e-4, name="static vs dynamic")
    assert torch.equal(out["static"][1], out["dynamic"][1])
    small = StaticCache(model.config, max_cache_len=12)
    _prefill(model, ctx, small)
    with pytest.raises(ValueError, match="max_cache_len"):
        splice_kv(small, store, [(0, 0, 9)], RopeSpec.from_model(model))


def test_ragged_left_padded_batch_uses_per_row_rope_positions():
    model = _model("llama")
    store = StepKVStore.for_model(model)
    seg = [11, 22, 33, 44, 55]
    store.add_from_model(model, [9], [seg])
    short, long_ = torch.randint(1, V, (5,)), torch.randint(1, V, (8,))
    ids = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), short]), long_])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
    full_mask = torch.cat([mask, torch.ones(2, len(seg), dtype=torch.long)], 1)
    r = insert_segment(
        model,
        cache,
        [seg, seg],
        [0, 1],
        [8, 8],
        mode="splice",
        store=store,
        payload_ids=[9, 9],
        rope_positions=[5, 8],
        attention_mask=full_mask,
        backend=BACKEND,
    )
    assert r.next_positions.tolist() == [10, 13] and r.next_slot == 13
    alone, alone_logits = _prefill(model, torch.cat([short, torch.tensor(seg)])[None])
    assert_close_verbose(cache.layers[0].keys[0, :, 8:], alone.layers[0].keys[0, :, 5:], atol=1e-4, name="row 0 K")
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(model): exact})
    e = insert_segment(
        model, exact, [seg, seg], [0, 1], [8, 8], mode="exact", rope_positions=[5, 8], attention_mask=full_mask
    )
    assert_close_verbose(e.logits[0], alone_logits[0], atol=1e-4, name="exact ragged row 0 vs unpadded")


def test_insert_segment_contract_errors():
    model = _model("llama")
    store = StepKVStore.for_model(model)
    store.add_from_model(model, [1, 2], [[1, 2, 3], [4, 5]])
    cache, _ = _prefill(model, torch.randint(0, V, (2, 4)))
    seg = [[1, 2, 3], [1, 2, 3]]
    with pytest.raises(ValueError, match="every batch row"):
        insert_segment(model, cache, seg[:1], [0], [4], store=store, payload_ids=[1])
    with pytest.raises(ValueError, match="positions: expected one slot"):
        insert_segment(model, cache, seg, [0, 1], [4, 3], store=store, payload_ids=[1, 1])
    with pytest.raises(ValueError, match="segments of one length"):
        insert_segment(model, cache, [[1, 2, 3], [4, 5]], [0, 1], [4, 4], store=store, payload_ids=[1, 2])
    with pytest.raises(ValueError, match=r"segment_tokens\[1\]: expected payload 1.s stored tokens"):
        insert_segment(model, cache, [[1, 2, 3], [3, 2, 1]], [0, 1], [4, 4], store=store, payload_ids=[1, 1])
    with pytest.raises(ValueError, match="store/payload_ids: expected both"):
        insert_segment(model, cache, seg, [0, 1], [4, 4], mode="splice")
    with pytest.raises(ValueError, match="slot <= the cache.s length"):
        insert_segment(model, cache, seg, [0, 1], [5, 5], mode="exact")
    # position 2 < length 4: the cache must not be cropped first
    with pytest.raises(ValueError, match=r"payload_ids\[0\]: expected a payload in the StepKVStore"):
        insert_segment(model, cache, seg, [0, 1], [2, 2], store=store, payload_ids=[7, 7])
    with pytest.raises(ValueError, match="mode"):
        insert_segment(model, cache, seg, [0, 1], [4, 4], mode="approx")
    assert cache.get_seq_length() == 4, "a refused call must leave the cache alone"


def test_our_model_calls_use_the_supported_cache_keyword():
    """The engine, the store's prefill and insert_segment pass the cache under the name the installed transformers
    declares (`cache` from 5.24, `past_key_values` before): no deprecation warning comes from our calls."""
    import warnings

    from rapo_fast.rollouts.engine import DecodeEngine

    model = _model("llama")
    assert cache_kwarg(model) in ("cache", "past_key_values")
    store = StepKVStore.for_model(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        warnings.filterwarnings("error", category=FutureWarning)
        store.add_from_model(model, [3], [[5, 6, 7]])
        eng = DecodeEngine(model, 2, torch.device("cpu"))
        eng.feed(torch.tensor([[1, 2], [1, 0]]), torch.tensor([[True, True], [True, False]]))
        cache, _ = _prefill(model, torch.tensor([[1, 2, 3], [1, 4, 5]]))
        r = insert_segment(model, cache, [[5, 6, 7]] * 2, [0, 1], [3, 3], mode="exact")
    assert r.logits.shape == (2, V) and eng.num_columns == 2
