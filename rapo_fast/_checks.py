"""Argument validation helpers shared by rapo_fast's public functions.

Each helper raises TypeError (wrong kind or dtype) or ValueError (wrong shape, value or option string) naming the
argument, what was expected and what was given, before any kernel is launched. Checks that read tensor values sync
with the device once, on the validation side, never in the hot path.
What this is not: a place for op math, nor the choice of the path that runs (rapo_fast/loss/path_plan.py).
"""

from __future__ import annotations

import itertools
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MASK_DTYPES = (torch.bool,) + INT_DTYPES + FLOAT_DTYPES


_BRIEF_ITEMS, _BRIEF_DEPTH, _BRIEF_TEXT = 4, 3, 60


def brief(value: Any, limit: int = 100) -> str:
    """repr(value) cut to at most `limit` characters, at a cost bounded whatever the value: at most 4 items of a
    container, 3 levels deep, 60 characters of a str, the bit length of an int past 64 bits. Every error message that
    quotes a value it was given goes through here: a 0.4 KB YAML alias bomb expands to billions of items, whose full
    repr costs seconds and gigabytes (and the repr of an int of over 4300 digits raises)."""
    out = _brief(value, _BRIEF_DEPTH)
    return out if len(out) <= limit else out[: max(limit - 3, 0)] + "..."


def _brief(v: Any, depth: int) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return repr(int(v)) if v.bit_length() <= 64 else f"<int of {v.bit_length()} bits>"
    if isinstance(v, (str, bytes)):
        return repr(v[:_BRIEF_TEXT]) + ("..." if len(v) > _BRIEF_TEXT else "")
    if isinstance(v, Mapping):
        brackets, first = "{}", itertools.islice(v.items(), _BRIEF_ITEMS)
        show = lambda kv: f"{_brief(kv[0], depth - 1)}: {_brief(kv[1], depth - 1)}"  # noqa: E731
    elif isinstance(v, (list, tuple, set, frozenset)):
        brackets, first = "[]" if isinstance(v, list) else "()" if isinstance(v, tuple) else "{}", iter(v)
        first, show = itertools.islice(first, _BRIEF_ITEMS), lambda x: _brief(x, depth - 1)
    else:  # anything else: its own repr (a tensor's is summarised by torch), cut
        try:
            text = repr(v)
        except Exception:  # a broken __repr__ must not replace the error being reported
            text = f"<{type(v).__name__}>"
        return text if len(text) <= 2 * _BRIEF_TEXT else text[: 2 * _BRIEF_TEXT] + "..."
    if depth <= 0:
        return brackets[0] + ("..." if len(v) else "") + brackets[1]
    more = f", ... ({len(v)} items)" if len(v) > _BRIEF_ITEMS else "," if isinstance(v, tuple) and len(v) == 1 else ""
    return brackets[0] + ", ".join(show(x) for x in first) + more + brackets[1]


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
        raise TypeError(f"{name}: expected one of {list(choices)}, got {type(value).__name__} {brief(value)}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {brief(value)}")
    return value


def check_bool(name: str, value) -> bool:
    """A bool (not an int, nor a 0-d tensor: a flag that picks code paths is a Python bool)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {brief(value)}")
    return value


def check_instance(name: str, value, types: type | tuple[type, ...], expected: str) -> Any:
    """`value` is an instance of `types`; `expected` says so in words for the message ("a TrainerConfig")."""
    if not isinstance(value, types):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}")
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
    """A finite real number (bool refused; NumPy's count) within the bounds; returned as a Python float."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {brief(value)}")
    try:
        v = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{name}: expected a finite number, got an int of {value.bit_length()} bits") from None
    if not v - v == 0.0:  # not finite (inf - inf and NaN - NaN are NaN); also traceable on a symbolic float
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if min_value is not None and (v < min_value or (not min_inclusive and v == min_value)):
        op = ">=" if min_inclusive else ">"
        raise ValueError(f"{name}: expected {op} {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ValueError(f"{name}: expected <= {max_value}, got {v}")
    return v


def check_min_score(name: str, value) -> float | None:
    """A search's score threshold: None (no threshold) or a finite number, for StepBuffer and the verl step buffer
    alike. NaN matches nothing and would never equal another request's threshold (the verl buffer batches searches by
    it); an infinite one is a mistake: -inf is no threshold (None), +inf no result."""
    return check_float(name, value, allow_none=True)


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
        raise TypeError(f"{name}: expected an int in [{lo}, {hi}], got {type(value).__name__} {brief(value)}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int in [{lo}, {hi}], got {type(value).__name__} {brief(value)}") from None
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


def check_field(meta: Mapping[str, Any], key: str, where: Any, error: type[ValueError], check, *args, **kw) -> Any:
    """A saved field: meta[key] through `check` (check_int, check_choice, check_bool...), named `<where>: field
    '<key>'`; its refusal (or the field's absence) is raised as `error`, the format's FormatError."""
    name = f"{where}: field {key!r}"
    if key not in meta:
        raise error(f"{name}: expected a value, got none (missing)")
    try:
        return check(name, meta[key], *args, **kw)
    except (TypeError, ValueError) as exc:
        raise error(str(exc)) from None


def check_str_list(name: str, values) -> list[str]:
    """A sequence (not a str itself) of str: histories, steps, texts to encode."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a list of str, got {type(values).__name__}")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}]: expected a str, got {type(v).__name__} {brief(v)}")
    return list(values)


def check_index_range(name: str, t: torch.Tensor, high: int) -> None:
    """Every value of the integer tensor `t` in [0, high). Reads values (one sync; skipped while tracing under
    torch.compile, where it would break the graph)."""
    if t.numel() == 0 or torch.compiler.is_compiling():
        return
    lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < 0 or hi >= high:
        raise ValueError(f"{name}: expected values in [0, {high}), got min {lo} max {hi}")


def check_finite(name: str, t: torch.Tensor, *, allow_inf: bool = False, in_loss: torch.Tensor | None = None) -> None:
    """No NaN (and no inf unless allowed) in `t`, or only where the mask `in_loss` is set (the tokens in a loss).
    Reads values (one sync): skipped while tracing under torch.compile, where it would break the graph."""
    if t.numel() == 0 or not t.is_floating_point() or torch.compiler.is_compiling():
        return
    bad = torch.isnan(t) if allow_inf else ~torch.isfinite(t)
    if in_loss is not None:
        bad = bad & in_loss.to(bad.device)
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        want, got = ("no NaN", "NaN") if allow_inf else ("finite values", "NaN/inf")
        where = " at tokens in the loss" if in_loss is not None else ""
        raise ValueError(f"{name}: expected {want}{where}, got {int(bad.sum())} {got}, the first at index {first}")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> int:
    """cu_seqlens: 1-D int32/int64 of length S+1, cu[0] == 0, non-decreasing, cu[-1] == total. Returns S. The values
    are read on the host (one sync): skipped while tracing under torch.compile, where only the shape is checked."""
    check_tensor(name, cu, ndim=1, dtypes=(torch.int32, torch.int64))
    if cu.numel() < 2:
        raise ValueError(f"{name}: expected at least 2 entries (S+1 for S >= 1 segments), got shape {tuple(cu.shape)}")
    if torch.compiler.is_compiling():
        return cu.numel() - 1
    c = cu.detach().cpu().to(torch.int64)
    if int(c[0]) != 0:
        raise ValueError(f"{name}: expected cu_seqlens[0] == 0, got {int(c[0])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {c.tolist()[:16]}")
    if int(c[-1]) != total:
        raise ValueError(f"{name}: expected cu_seqlens[-1] == number of tokens {total}, got {int(c[-1])}")
    return cu.numel() - 1


# The integer dtypes accepted for targets, by rapo_loss and by token_logprobs: torch's index dtypes. Narrower integers
# (int8/int16/uint8) are refused rather than widened: they cannot hold a real vocabulary's ids.
TARGET_DTYPES = (torch.int64, torch.int32)
# The float dtypes of token_logprobs' kernels: no fp64 (rapo_loss takes it too, and sends it to its reference path).
KERNEL_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_head(hidden, weight, bias, float_dtypes: Sequence[torch.dtype]) -> int:
    """weight [V, H] (and bias [V]) of the hidden-state path, in hidden's dtype; returns V."""
    if weight is None:
        raise ValueError("weight: expected the lm_head weight [V, H] with hidden=, got None")
    check_tensor("weight", weight, ndim=2, dtypes=float_dtypes)
    v = weight.shape[0]
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected shape (V, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    check_optional_tensor("bias", bias, shape=(v,), dtypes=float_dtypes)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:  # the message names the fixes: an explicit cast, or autocast
            got, want = str(t.dtype).replace("torch.", ""), str(hidden.dtype).replace("torch.", "")
            raise TypeError(
                f"{name}: expected hidden's dtype {want}, got {got}; pass {name}.to(hidden.dtype), or call under "
                f"torch.autocast, where rapo_loss / token_logprobs cast it to hidden's dtype themselves"
            )
    return v


def check_model_inputs(
    logits, hidden, weight, bias, targets, *, float_dtypes: Sequence[torch.dtype] = FLOAT_DTYPES
) -> int:
    """The model-side arguments of token_logprobs and rapo_loss: exactly one of logits [..., V] or hidden [..., H]
    with weight [V, H] (+ bias [V]) in hidden's dtype, integer targets shaped like the leading dims (1 or 2 of them),
    all on one device; returns V. `float_dtypes`: those the entry point takes (token_logprobs: KERNEL_FLOAT_DTYPES).
    Values (the targets' range) are the callers' (rapo_loss allows the ignore index)."""
    if (logits is None) == (hidden is None):
        got = "both" if logits is not None else "neither"
        raise ValueError(f"logits/hidden: expected exactly one of logits [..., V] or hidden [..., H], got {got}")
    if logits is not None and (weight is not None or bias is not None):
        raise ValueError("weight/bias: expected only with hidden=, got them with logits=")
    x, src = (logits, "logits") if logits is not None else (hidden, "hidden")
    check_tensor(src, x, ndim=(2, 3), dtypes=float_dtypes)
    check_tensor("targets", targets, dtypes=TARGET_DTYPES)
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        want = tuple(x.shape[:-1])
        raise ValueError(f"targets: expected shape {src}.shape[:-1] = {want}, got {tuple(targets.shape)}")
    vocab = logits.shape[-1] if logits is not None else _check_head(hidden, weight, bias, float_dtypes)
    if vocab < 1:
        raise ValueError(f"{src if logits is not None else 'weight'}: expected a vocabulary size V >= 1, got 0")
    check_same_device(**{src: x, "weight": weight, "bias": bias, "targets": targets})
    return vocab
