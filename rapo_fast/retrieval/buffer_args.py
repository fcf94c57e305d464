"""Argument checks and conversions of StepBuffer's public methods (rapo_fast/retrieval/buffer.py).

What this is: the checks that name the argument, the expected and the given (int vectors, k, min_score), and the
conversion of NumPy arrays (what a faiss user passes) to tensors, without importing NumPy (not a dependency of
rapo_fast: an array is recognised by its `__array__`). What this is not: the buffer's state or its search.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rapo_fast.retrieval.op import MAX_K


def shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def as_tensor(x: Any, device: torch.device) -> Any:
    """A NumPy array (anything with `__array__` that is not a tensor) as a tensor on `device`; anything else as given,
    for the caller's checks to judge (lists stay refused: their dtype would be a guess)."""
    if isinstance(x, torch.Tensor) or not hasattr(x, "__array__"):
        return x
    return torch.as_tensor(x, device=device)


def check_int_vector(name: str, t, n: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [{n}] int64, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{name} must be an int64 tensor of shape [{n}], got dtype {t.dtype}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {shape(t)}")
    return t.to(torch.int64)


def check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int in [1, {MAX_K}], got {type(k).__name__}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    return k


def check_min_score(min_score) -> float:
    if min_score is None:
        return float("-inf")
    if isinstance(min_score, bool) or not isinstance(min_score, (int, float)):
        raise TypeError(f"min_score must be a float or None, got {type(min_score).__name__}")
    if math.isnan(min_score):
        raise ValueError("min_score must not be NaN")
    return float(min_score)
