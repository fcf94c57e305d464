"""RoPE parameters of a Hugging Face model, read once, in the form the KV splice needs: `RopeSpec`.

What this is: the inverse frequencies (fp32, as the model uses them), the rotary dimension (partial rotary), the pair
layout (`rotate_half`, Llama/Qwen/NeoX in HF; `interleaved`, GPT-J/CodeGen pairs (2i, 2i+1)), and the rope type, read
from a transformers config or model. Scalings supported: default, linear, llama3, yarn. Dynamic NTK and longrope are
refused: their frequencies depend on the sequence length, so R(a) R(b) != R(a + b) across the switch and a key rotated
by delta would not equal the key the model computes at that position.
What this is not: the rotation itself (rapo_fast/reference/kv_splice.py and csrc/include/rapo/rope.h) nor a rotary
module: YaRN's attention factor scales cos/sin inside the model and is already contained in every cached key, so a
re-rotation must never apply it again (that is why R(delta) is built from inv_freq, not from the model's rotary module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rapo_fast._checks import brief, check_choice

Layout = Literal["rotate_half", "interleaved"]

# Layouts verified against the installed transformers' modeling code (rotate_half vs rotate_every_two). A model type not
# listed must name its layout explicitly: guessing would rotate the wrong pairs silently.
_ROTATE_HALF_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gpt_neox",
        "phi3",
        "gemma",
        "gemma2",
        "olmo",
        "olmo2",
        "starcoder2",
        "stablelm",
        "granite",
        "smollm3",
    }
)
_INTERLEAVED_TYPES = frozenset({"gptj", "codegen"})
_REFUSED_TYPES = {
    "dynamic": "dynamic-NTK RoPE changes its frequencies with the sequence length, so rotations do not compose",
    "longrope": "longrope switches short/long factors with the sequence length, so rotations do not compose",
}


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _head_dim(cfg: Any) -> int:
    hd = getattr(cfg, "head_dim", None)
    if hd:
        return int(hd)
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    return int(hidden) // int(heads)


def _rope_params(cfg: Any) -> dict:
    std = getattr(cfg, "standardize_rope_params", None)
    if callable(std):
        std()
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return params


def compute_inv_freq(
    rotary_dim: int,
    theta: float,
    rope_type: str = "default",
    params: dict | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (fp32) and attention factor of a RoPE scaling, as transformers forms them.

    rope_type: default | linear | llama3 | yarn. The attention factor is returned for information only (YaRN's mscale):
    cached keys already contain it and a re-rotation must not apply it.
    """
    params = dict(params or {})
    if rope_type in _REFUSED_TYPES:
        raise ValueError(
            f"rope_type: expected one the KV splice supports, got {brief(rope_type)}: {_REFUSED_TYPES[rope_type]}"
        )
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected a positive even int, got {rotary_dim}")
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    base = theta**exps
    inv = 1.0 / base
    attention = 1.0
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv = inv / float(params["factor"])
    elif rope_type == "llama3":
        factor, lo, hi = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        lo_wave, hi_wave = old / lo, old / hi
        wave = 2 * math.pi / inv
        scaled = torch.where(wave > lo_wave, inv / factor, inv)
        smooth = (old / wave - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wave < hi_wave) * ~(wave > lo_wave)
        inv = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        factor = params.get("factor")
        orig = float(params["original_max_position_embeddings"])
        if factor is None:
            factor = float(max_position_embeddings) / orig
        factor = float(factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = params.get("attention_factor")
        if attention is None:
            ms, msa = params.get("mscale"), params.get("mscale_all_dim")
            attention = mscale(factor, ms) / mscale(factor, msa) if ms and msa else mscale(factor)
        fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return (rotary_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr_dim(fast), corr_dim(slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extra = 1 - ramp
        inv = (1.0 / (factor * base)) * (1 - extra) + (1.0 / base) * extra
    else:
        raise ValueError(f"rope_type: expected default, linear, llama3 or yarn, got {brief(rope_type)}")
    return inv.to(torch.float32), float(attention)


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates its keys: inv_freq [rotary_dim // 2] fp32 (CPU), head_dim, rotary_dim, layout, rope_type.

    Rotation by delta of a key x [head_dim]: for pair i (rotate_half: (i, i + rotary_dim/2); interleaved: (2i, 2i+1)),
    angle a = delta * inv_freq[i], (x1, x2) -> (x1 cos a - x2 sin a, x2 cos a + x1 sin a); dims >= rotary_dim unchanged.
    """

    inv_freq: torch.Tensor
    head_dim: int
    rotary_dim: int
    layout: Layout = "rotate_half"
    rope_type: str = "default"
    attention_scaling: float = 1.0
    _device_cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_choice("layout", self.layout, ("rotate_half", "interleaved"))
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim: expected even, in [2, head_dim={self.head_dim}], got {self.rotary_dim}")
        inv = self.inv_freq
        if not isinstance(inv, torch.Tensor) or inv.dim() != 1 or inv.numel() != self.rotary_dim // 2:
            shape = tuple(inv.shape) if isinstance(inv, torch.Tensor) else type(inv).__name__
            raise ValueError(f"inv_freq: expected 1-D, rotary_dim // 2 = {self.rotary_dim // 2} entries, got {shape}")
        object.__setattr__(self, "inv_freq", inv.detach().to(device="cpu", dtype=torch.float32).contiguous())

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """inv_freq on `device`, copied once per device."""
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = self.inv_freq.to(device)
        return self._device_cache[key]

    @classmethod
    def from_theta(
        cls, head_dim: int, theta: float = 10000.0, *, rotary_dim: int | None = None, layout: Layout = "rotate_half"
    ) -> RopeSpec:
        """Plain RoPE with base `theta` over the first `rotary_dim` (default: all) dims of each head."""
        rd = head_dim if rotary_dim is None else rotary_dim
        inv, _ = compute_inv_freq(rd, theta)
        return cls(inv_freq=inv, head_dim=head_dim, rotary_dim=rd, layout=layout)

    @classmethod
    def from_config(cls, config: Any, *, layout: Layout | None = None) -> RopeSpec:
        """Read theta, scaling (linear/llama3/yarn), partial rotary and the pair layout from a transformers config.

        Raises ValueError for dynamic-NTK/longrope RoPE, and for a model type whose layout is not known (pass layout=).
        """
        cfg = _text_config(config)
        model_type = str(getattr(cfg, "model_type", ""))
        head_dim = _head_dim(cfg)
        if layout is None:
            if model_type in _INTERLEAVED_TYPES:
                layout = "interleaved"
            elif model_type in _ROTATE_HALF_TYPES:
                layout = "rotate_half"
            else:
                raise ValueError(
                    f"layout: expected one for model_type={brief(model_type)} (unknown to rapo_fast), got None; pass "
                    "layout='rotate_half' (HF rotate_half, as Llama) or layout='interleaved' (pairs (2i, 2i+1), "
                    "as GPT-J)"
                )
        if model_type in ("gptj", "codegen"):
            # GPT-J/CodeGen keep their own sinusoid table: base 10000 over rotary_dim (all dims when None), no scaling.
            rd = getattr(cfg, "rotary_dim", None) or head_dim
            inv, att = compute_inv_freq(int(rd), 10000.0)
            return cls(inv_freq=inv, head_dim=head_dim, rotary_dim=int(rd), layout=layout)
        params = _rope_params(cfg)
        rope_type = str(params.get("rope_type", "default"))
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        prf = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None)) or 1.0
        rd = int(head_dim * float(prf))
        inv, att = compute_inv_freq(rd, theta, rope_type, params, getattr(cfg, "max_position_embeddings", None))
        return cls(
            inv_freq=inv, head_dim=head_dim, rotary_dim=rd, layout=layout, rope_type=rope_type, attention_scaling=att
        )

    @classmethod
    def from_model(cls, model: Any, *, layout: Layout | None = None) -> RopeSpec:
        """RopeSpec of a transformers model: its config's RoPE, with inv_freq taken from the model's rotary module when
        it has one (the frequencies the model really uses), checked against the config's.
        """
        spec = cls.from_config(model.config, layout=layout)
        for _name, module in model.named_modules():
            inv = getattr(module, "original_inv_freq", None)
            if inv is None:
                inv = getattr(module, "inv_freq", None)
            if isinstance(inv, torch.Tensor) and inv.numel() == spec.rotary_dim // 2:
                # model.to(bfloat16) also casts this buffer, and the model then rotates with the rounded frequencies;
                # follow the model (that is what its cached keys contain), with the check loosened to that rounding.
                rtol = {torch.bfloat16: 8e-3, torch.float16: 1e-3}.get(inv.dtype, 1e-5)
                inv = inv.detach().float().cpu()
                if not torch.allclose(inv, spec.inv_freq, rtol=rtol, atol=0.0):
                    off = ((inv - spec.inv_freq).abs() / spec.inv_freq).max().item()
                    raise ValueError(
                        f"model: expected the config's {spec.rope_type!r} RoPE in rotary module {_name!r}, got inv_freq"
                        f" off by a max rel. diff {off:.3g}; refusing to guess"
                    )
                return cls(
                    inv_freq=inv,
                    head_dim=spec.head_dim,
                    rotary_dim=spec.rotary_dim,
                    layout=spec.layout,
                    rope_type=spec.rope_type,
                    attention_scaling=spec.attention_scaling,
                )
        return spec
