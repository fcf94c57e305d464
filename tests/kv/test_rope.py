"""Tests of RoPE parameter reading (rapo_fast/kv/rope.py) and the reference rotation (rapo_fast/reference/kv_splice.py).

Checks: inv_freq for default/linear/llama3/yarn equals transformers' own ROPE_INIT_FUNCTIONS; partial rotary and the
pair layout are read from GPT-NeoX / GPT-J / Llama configs; dynamic NTK and longrope are refused; an unknown model
type needs an explicit layout; the reference rotation equals the model's own rotation and composes; fp32 vs float64.
Not here: the splice itself (tests/kv/test_kv_splice*.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_verbose, assert_within_ref_error
from transformers import GPTJConfig, GPTNeoXConfig, LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rapo_fast.kv.rope import RopeSpec
from rapo_fast.reference.kv_splice import rope_cos_sin_ref, rotate_keys_ref


def _llama(**rope):
    return LlamaConfig(
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=50,
        max_position_embeddings=4096,
        rope_scaling=rope or None,
    )


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_inv_freq_matches_transformers(rope):
    cfg = _llama(**rope)
    spec = RopeSpec.from_config(cfg)
    inv, att = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg)
    assert spec.rope_type == rope["rope_type"] and spec.layout == "rotate_half"
    assert_close_verbose(spec.inv_freq, inv, atol=0.0, rtol=1e-6, name="inv_freq")
    assert math.isclose(spec.attention_scaling, att, rel_tol=1e-6)


def test_default_theta_partial_and_layouts():
    q = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=50,
        rope_theta=1e6,
    )
    s = RopeSpec.from_config(q)
    assert s.head_dim == 16 and s.rotary_dim == 16 and s.layout == "rotate_half"
    assert_close_verbose(s.inv_freq, 1.0 / (1e6 ** (torch.arange(0, 16, 2).float() / 16)), atol=0, rtol=1e-6)
    n = GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=50, rotary_pct=0.25
    )
    s = RopeSpec.from_config(n)
    assert (s.head_dim, s.rotary_dim, s.layout) == (16, 4, "rotate_half")
    j = GPTJConfig(n_embd=64, n_layer=1, n_head=4, rotary_dim=8, vocab_size=50)
    s = RopeSpec.from_config(j)
    assert (s.head_dim, s.rotary_dim, s.layout) == (16, 8, "interleaved")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 16,
            "long_factor": [2.0] * 16,
            "original_max_position_embeddings": 512,
        },
    ],
)
def test_length_dependent_rope_is_refused(rope):
    with pytest.raises(ValueError, match="do not compose"):
        RopeSpec.from_config(_llama(**rope))


def test_unknown_model_type_needs_layout():
    cfg = _llama()
    cfg.model_type = "some_new_model"
    with pytest.raises(ValueError, match="layout"):
        RopeSpec.from_config(cfg)
    assert RopeSpec.from_config(cfg, layout="interleaved").layout == "interleaved"
    with pytest.raises(ValueError, match="layout"):
        RopeSpec(inv_freq=torch.ones(4), head_dim=8, rotary_dim=8, layout="neox")
    with pytest.raises(ValueError, match="inv_freq"):
        RopeSpec(inv_freq=torch.ones(3), head_dim=8, rotary_dim=8)


def test_reference_rotation_equals_hf_apply_rotary():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = _llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=512)
    rot = LlamaRotaryEmbedding(cfg)
    spec = RopeSpec.from_config(cfg)
    k = torch.randn(1, 2, 7, 32, dtype=torch.float64).float()
    pos = torch.arange(30, 37)[None]
    cos, sin = rot(k, pos)
    # HF multiplies cos/sin by YaRN's attention factor; a re-rotation must not (the stored key already carries it).
    _, want = apply_rotary_pos_emb(k, k, cos / spec.attention_scaling, sin / spec.attention_scaling)
    got = rotate_keys_ref(k, pos[0][None, :], spec.inv_freq, layout="rotate_half")
    assert_close_verbose(got, want, atol=2e-5, name="rotate_half vs HF")


def test_interleaved_matches_gptj_rotate_every_two():
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    table = create_sinusoidal_positions(64, 8)
    spec = RopeSpec.from_theta(16, 10000.0, rotary_dim=8, layout="interleaved")
    x = torch.randn(1, 5, 2, 16)  # GPT-J applies rotation on [B, S, H, D]
    pos = torch.arange(11, 16)
    sin, cos = torch.split(table[pos][None], 4, dim=-1)
    want = torch.cat([apply_rotary_pos_emb(x[..., :8], sin, cos), x[..., 8:]], dim=-1)
    got = rotate_keys_ref(x, pos[None, :, None], spec.inv_freq, rotary_dim=8, layout="interleaved")
    assert_close_verbose(got, want, atol=2e-5, name="interleaved vs GPT-J")


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotation_composes_and_matches_fp64(layout, dtype):
    d, rd = 24, 16
    inv = RopeSpec.from_theta(d, 500.0, rotary_dim=rd).inv_freq
    k64 = torch.randn(3, 9, d, dtype=torch.float64)
    k = k64.to(dtype)
    for delta in (0, 1, 97, 1025, 1_000_003):
        ref64 = rotate_keys_ref(k.double(), delta, inv, rotary_dim=rd, layout=layout, compute_dtype=torch.float64)
        got = rotate_keys_ref(k, delta, inv, rotary_dim=rd, layout=layout)
        assert_within_ref_error(got, got, ref64, dtype, name=f"delta={delta}")
        assert torch.equal(got[..., rd:], k[..., rd:])
    # R(a) R(b) = R(a + b) up to rounding, in float64.
    a = rotate_keys_ref(
        rotate_keys_ref(k64, 300, inv, rotary_dim=rd, layout=layout, compute_dtype=torch.float64),
        4000,
        inv,
        rotary_dim=rd,
        layout=layout,
        compute_dtype=torch.float64,
    )
    b = rotate_keys_ref(k64, 4300, inv, rotary_dim=rd, layout=layout, compute_dtype=torch.float64)
    assert_close_verbose(a, b, atol=1e-9, name="composition")


def test_large_delta_angles_are_accurate():
    inv = torch.tensor([1.0, 0.5, 1e-3])
    c, s = rope_cos_sin_ref(torch.tensor([10**6, 2**24 + 1]), inv)
    ang = torch.tensor([10**6, 2**24 + 1], dtype=torch.float64)[:, None] * inv.double()
    assert_close_verbose(c, torch.cos(ang), atol=2e-6, name="cos")
    assert_close_verbose(s, torch.sin(ang), atol=2e-6, name="sin")
