"""Access to Hugging Face transformers caches (the installed 5.x) for the KV splice: per-layer tensors and length.

What this is: the small set of operations the splice needs on `DynamicCache` / `StaticCache` of transformers 5.x,
written against its cache_utils.py: each layer is a `DynamicLayer` (keys/values [B, H_kv, S, D], grown by torch.cat,
length = keys.shape[-2]) or a `StaticLayer` (preallocated [B, H_kv, max_cache_len, D], length = the 0-d tensor
`cumulative_length`, and `update` writes at that length). In transformers 5.x a forward without position_ids uses
positions get_seq_length() + arange, so a cache whose length is position + L continues at position + L.
What this is not: a cache implementation, or support for sliding-window, quantized, offloaded or linear-attention
layers (refused with a TypeError: their storage is not a plain [B, H_kv, S, D] tensor indexed by position).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_CACHE_KWARG: dict[type, str] = {}


def _cu():
    from transformers import cache_utils

    return cache_utils


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes the cache: `cache` where the model's forward declares it (transformers >= 5.24,
    where `past_key_values` is deprecated), else `past_key_values` (older 5.x, e.g. verl's pinned range)."""
    cls = type(model)
    if cls not in _CACHE_KWARG:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):  # a forward without a signature: the long-standing name
            params = {}
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]


def is_hf_cache(obj: Any) -> bool:
    try:
        return isinstance(obj, _cu().Cache)
    except Exception:  # transformers missing or broken: not an HF cache
        return False


def layer_kind(layer: Any) -> str:
    """'dynamic' or 'static' for the layer classes the splice supports; TypeError for every other layer class."""
    cu = _cu()
    if type(layer) is cu.DynamicLayer:
        return "dynamic"
    if type(layer) is cu.StaticLayer:
        return "static"
    raise TypeError(
        f"cache: expected DynamicLayer/StaticLayer layers (full attention), got a {type(layer).__name__}; "
        "sliding-window, quantized and linear-attention layers do not store [B, H_kv, S, D] keys by position"
    )


def check_cache(cache: Any) -> str:
    """Validate an HF cache for splicing and return its kind ('dynamic' or 'static'); one kind for all layers."""
    if not is_hf_cache(cache):
        raise TypeError(f"cache: expected a transformers Cache (DynamicCache/StaticCache), got {type(cache).__name__}")
    if getattr(cache, "offloading", False):
        raise TypeError("cache: expected a cache on one device, got an offloaded one (its layers move between devices)")
    kinds = {layer_kind(layer) for layer in cache.layers}
    if len(kinds) > 1:
        raise TypeError(f"cache: expected one layer kind, got {sorted(kinds)}")
    return kinds.pop() if kinds else "dynamic"


def length(cache: Any) -> int:
    """Number of cached tokens (the same for every row and layer in an HF cache)."""
    if not cache.layers or not cache.layers[0].is_initialized:
        return 0
    return int(cache.get_seq_length())


def capacity(cache: Any) -> int | None:
    """Largest length a splice may reach: max_cache_len for a static cache, None (unbounded) for a dynamic one."""
    if check_cache(cache) == "static":
        return int(cache.layers[0].max_cache_len)
    return None


def batch_size(cache: Any) -> int | None:
    if not cache.layers or not cache.layers[0].is_initialized or cache.layers[0].keys.numel() == 0:
        if cache.layers and getattr(cache.layers[0], "batch_size", None) is not None:
            return int(cache.layers[0].batch_size)
        return None
    return int(cache.layers[0].keys.shape[0])


def ensure_layers(
    cache: Any, num_layers: int, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Create/initialise the layers of an empty cache so that it holds [batch, num_heads, 0, head_dim] tensors."""
    cu = _cu()
    if len(cache.layers) == 0 and getattr(cache, "layer_class_to_replicate", None) is cu.DynamicLayer:
        cache.layers.extend(cu.DynamicLayer() for _ in range(num_layers))
    if len(cache.layers) != num_layers:
        raise ValueError(f"cache: expected the store's {num_layers} layers, got {len(cache.layers)}")
    empty = torch.zeros((batch, num_heads, 0, head_dim), dtype=dtype, device=device)
    for layer in cache.layers:
        if not layer.is_initialized:
            layer.lazy_initialization(empty, empty)
            if type(layer) is cu.DynamicLayer:
                layer.keys, layer.values = empty.clone(), empty.clone()


def layer_tensors(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer key and value tensors [B, H_kv, S, D] (S = current length, or max_cache_len for static)."""
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def grow(cache: Any, new_length: int) -> None:
    """Make room for `new_length` tokens: a dynamic cache is extended with zeros (which the splice then overwrites);
    a static cache must already have the room (ValueError otherwise). Length bookkeeping is not touched here."""
    if check_cache(cache) == "static":
        cap = capacity(cache)
        if new_length > cap:
            raise ValueError(
                f"position + segment length: expected <= max_cache_len {cap} (StaticCache), got {new_length}"
            )
        return
    for layer in cache.layers:
        cur = layer.keys.shape[-2]
        if new_length > cur:
            pad_k = layer.keys.new_zeros(*layer.keys.shape[:-2], new_length - cur, layer.keys.shape[-1])
            pad_v = layer.values.new_zeros(*layer.values.shape[:-2], new_length - cur, layer.values.shape[-1])
            layer.keys = torch.cat([layer.keys, pad_k], dim=-2).contiguous()
            layer.values = torch.cat([layer.values, pad_v], dim=-2).contiguous()


def set_length(cache: Any, new_length: int) -> None:
    """Set the cache's length to `new_length`: dynamic layers are cropped to it (they must already be at least that
    long); a static cache's `cumulative_length` is set in place (its tensors keep their static addresses)."""
    kind = check_cache(cache)
    for layer in cache.layers:
        if kind == "static":
            layer.cumulative_length.fill_(new_length)
        else:
            cur = layer.keys.shape[-2]
            if new_length > cur:
                raise ValueError(f"new_length: expected <= the DynamicCache layer's {cur} tokens, got {new_length}")
            if new_length < cur:
                layer.keys = layer.keys[..., :new_length, :]
                layer.values = layer.values[..., :new_length, :]
