"""Argument validation helpers shared by rapo_fast's public functions.

Each helper raises TypeError (wrong kind or dtype) or ValueError (wrong shape, value or option string) with a message
that names the argument and says what was expected and what was given, so that bad input fails before any kernel is
launched. Some checks read tensor values (targets range, NaN, cu_seqlens): they sync with the device once, on the
validation side, never in the hot path. What this is not: a place for op math.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MASK_DTYPES = (torch.bool,) + INT_DTYPES + FLOAT_DTYPES


def _dt(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    shape: Sequence[int] | None = None,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    """Check that `t` is a tensor with the given shape (or number of dims) and one of `dtypes`; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {{{_dt(dtypes)}}}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name}: expected {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def check_optional_tensor(name: str, t, **kw) -> torch.Tensor | None:
    """check_tensor for an argument that may be None."""
    return None if t is None else check_tensor(name, t, **kw)


def check_same_device(**tensors: torch.Tensor | None) -> torch.device | None:
    """All given (non-None) tensors on one device; the first one's device is returned."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name}: expected device {device} (that of {first}), got {t.device}")
    return device


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    """`value` is one of the option strings `choices`."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {list(choices)}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def check_float(
    name: str,
    value,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    min_inclusive: bool = True,
    allow_none: bool = False,
) -> float | None:
    """A finite real number (bool refused) within the bounds; returned as a Python float."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{name}: expected a finite number, got an int of {value.bit_length()} bits") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if min_value is not None and (v < min_value or (not min_inclusive and v == min_value)):
        op = ">=" if min_inclusive else ">"
        raise ValueError(f"{name}: expected {op} {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ValueError(f"{name}: expected <= {max_value}, got {v}")
    return v


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def check_int(name: str, value, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """An integer (Python or NumPy int, or an integer 0-d tensor; bool and float refused, even a whole float) in
    [lo, hi], returned as a Python int. The default range is int64's: every id this library stores in an int64 tensor
    is checked here first, so that a past-int64 value fails naming its argument instead of overflowing in torch."""
    not_int = isinstance(value, torch.Tensor) and (
        value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
    )
    if isinstance(value, bool) or not_int:
        raise TypeError(f"{name}: expected an int in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int in [{lo}, {hi}], got {type(value).__name__} {value!r}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v}")
    return v


def check_int_list(name: str, values, n: int | None = None, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> list[int]:
    """A sequence (not a str/bytes) of `n` ints (any length when n is None), each as `check_int` with `name[i]`."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a list of ints in [{lo}, {hi}], got {type(values).__name__}")
    if n is not None and len(values) != n:
        raise ValueError(f"{name}: expected {n} entries, got {len(values)}")
    return [check_int(f"{name}[{i}]", v, lo=lo, hi=hi) for i, v in enumerate(values)]


def check_index_range(name: str, t: torch.Tensor, high: int) -> None:
    """Every value of the integer tensor `t` in [0, high). Reads values (one sync)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= high:
        raise ValueError(f"{name}: values must lie in [0, {high}), got min {lo} max {hi}")


def check_finite(name: str, t: torch.Tensor, *, allow_inf: bool = False) -> None:
    """No NaN (and no inf unless allowed) in `t`. Reads values (one sync)."""
    if t.numel() == 0 or not t.is_floating_point():
        return
    bad = torch.isnan(t) if allow_inf else ~torch.isfinite(t)
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        what = "NaN" if allow_inf else "NaN or inf"
        raise ValueError(f"{name}: contains {what} ({int(bad.sum())} elements, first at index {first})")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> int:
    """cu_seqlens: 1-D int32/int64 of length S+1, cu[0] == 0, non-decreasing, cu[-1] == total. Returns S."""
    check_tensor(name, cu, ndim=1, dtypes=(torch.int32, torch.int64))
    if cu.numel() < 2:
        raise ValueError(f"{name}: expected at least 2 entries (S+1 for S >= 1 segments), got shape {tuple(cu.shape)}")
    c = cu.detach().cpu().to(torch.int64)
    if int(c[0]) != 0:
        raise ValueError(f"{name}: expected cu_seqlens[0] == 0, got {int(c[0])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {c.tolist()[:16]}")
    if int(c[-1]) != total:
        raise ValueError(f"{name}: expected cu_seqlens[-1] == number of tokens {total}, got {int(c[-1])}")
    return cu.numel() - 1
