"""Argument checks and conversions of StepBuffer's public methods (rapo_fast/retrieval/buffer.py).

What this is: the checks of its key rows and id vectors (in rapo_fast/_checks.py's vocabulary, which holds the rest),
and the conversion of NumPy arrays (what a faiss user passes) to tensors, without importing NumPy (not a dependency of
rapo_fast: an array is recognised by its `__array__`). What this is not: the buffer's state or its search.
"""

from __future__ import annotations

from typing import Any

import torch

from rapo_fast import _checks as C


def as_tensor(x: Any, device: torch.device) -> Any:
    """A NumPy array (anything with `__array__` that is not a tensor) as a tensor on `device`; anything else as given,
    for the caller's checks to judge (lists stay refused: their dtype would be a guess). An array with a negative
    stride (a reversed view, `a[::-1]`) is copied first: torch has no negative strides, and its own error would not
    name the argument."""
    if isinstance(x, torch.Tensor) or not hasattr(x, "__array__"):
        return x
    strides = getattr(x, "strides", None)
    if strides and any(s < 0 for s in strides) and callable(getattr(x, "copy", None)):
        x = x.copy()  # NumPy's copy is C-contiguous, whatever the view's order
    return torch.as_tensor(x, device=device)


def check_rows(name: str, x: Any, dim: int, rows: str) -> torch.Tensor:
    """embeddings [M, dim] / queries [Q, dim] (`rows`: the letter): a float tensor (any float dtype: rounded to the
    buffer's)."""
    C.check_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a float tensor [{rows}, {dim}], got dtype {x.dtype}")
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"{name}: expected shape [{rows}, {dim}], got {tuple(x.shape)}")
    return x


def check_ids(name: str, t: Any, n: int) -> torch.Tensor:
    """payload_ids / group_ids / exclude_groups: an integer tensor [n], as int64."""
    return C.check_tensor(name, t, shape=(n,), dtypes=C.INT_DTYPES).to(torch.int64)
