"""Argument validation helpers shared by rapo_fast's public functions.

Each helper raises TypeError (wrong kind or dtype) or ValueError (wrong shape, value or option string) with a message
that names the argument and says what was expected and what was given, so that bad input fails before any kernel is
launched. Some checks read tensor values (targets range, NaN, cu_seqlens): they sync with the device once, on the
validation side, never in the hot path. `check_model_inputs` is the one check of the model-side arguments (logits, or
hidden + lm_head weight + bias, and targets) of token_logprobs and rapo_loss, in each one's wording.
What this is not: a place for op math, nor the choice of the path that runs (rapo_fast/loss/path_plan.py).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MASK_DTYPES = (torch.bool,) + INT_DTYPES + FLOAT_DTYPES


# ------------------------------------------------------------------------------------- values quoted in error messages
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


def check_index_range(name: str, t: torch.Tensor, high: int) -> None:
    """Every value of the integer tensor `t` in [0, high). Reads values (one sync; skipped while tracing under
    torch.compile, where it would break the graph)."""
    if t.numel() == 0 or torch.compiler.is_compiling():
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


# --------------------------------------------------------------------------------- model inputs (logits or hidden)
# The integer dtypes accepted for targets, by rapo_loss and by token_logprobs: torch's index dtypes. Narrower integers
# (int8/int16/uint8) are refused rather than widened: they cannot hold a real vocabulary's ids.
TARGET_DTYPES = (torch.int64, torch.int32)
_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # token_logprobs: no fp64 (rapo_loss sends it elsewhere)

# The wording of each refusal, per entry point: token_logprobs says "<arg> must ...", rapo_loss "<arg>: expected ...";
# the checks themselves are one (check_model_inputs).
_MODEL_MESSAGES = {
    "token_logprobs": {
        "one_of": "pass exactly one of logits or hidden (with weight), got {got}",
        "head_with_logits": "weight and bias go with hidden, not with logits",
        "vocab_logits": "logits must have a vocabulary dimension V >= 1, got shape {shape}",
        "no_weight": "weight (the lm_head weight, [V, H]) is required with hidden",
        "weight_shape": "weight must have shape [V, H] = [V, {h}] with V >= 1, got {shape}",
        "x_shape": "targets must have shape {src}.shape[:-1] = {lead}, got {got}",
    },
    "rapo_loss": {
        "one_of": "logits/hidden: pass exactly one of logits [..., V] or hidden [..., H] (+ weight [V, H]), got {got}",
        "head_with_logits": "weight/bias: only with hidden=, not with logits",
        "vocab_logits": "logits/weight: vocabulary size must be >= 1",
        "no_weight": "weight: required with hidden= (the lm_head weight [V, H])",
        "weight_shape": "weight: expected shape (V, {h}), got {shape}",
        "x_shape": "{src}: expected shape {want} (targets' shape + {what}), got {got}",
    },
}


def _float_arg(name: str, x, ndims: tuple[int, ...] | None, style: str) -> None:
    """A float tensor (fp32/fp16/bf16 for token_logprobs, also fp64 for rapo_loss) with one of `ndims` dims."""
    if style == "rapo_loss":
        check_tensor(name, x, ndim=ndims, dtypes=FLOAT_DTYPES)
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _LOW_FLOATS:
        raise TypeError(f"{name} must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if ndims is not None and x.dim() not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")


def _head_dtype(name: str, t: torch.Tensor, hidden: torch.Tensor, style: str) -> None:
    """weight / bias in hidden's dtype; the message names the fixes (an explicit cast, or autocast)."""
    if t.dtype == hidden.dtype:
        return
    if style == "rapo_loss":
        got, want = str(t.dtype).replace("torch.", ""), str(hidden.dtype).replace("torch.", "")
        raise TypeError(
            f"{name}: expected hidden's dtype {want}, got {got}; pass {name}.to(hidden.dtype), or call under "
            f"torch.autocast, where rapo_loss / token_logprobs cast it to hidden's dtype themselves"
        )
    if name == "bias":
        raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {t.dtype}")
    raise TypeError(
        f"weight must have hidden's dtype {hidden.dtype}, got {t.dtype}; pass weight.to(hidden.dtype), "
        "or call under torch.autocast, where it is cast to hidden's dtype here"
    )


def _check_head(hidden, weight, bias, style: str) -> int:
    """weight [V, H] (and bias [V]) of the hidden-state path, in hidden's dtype; returns V."""
    m = _MODEL_MESSAGES[style]
    if weight is None:
        raise ValueError(m["no_weight"])
    _float_arg("weight", weight, (2,), style)
    hd, v = hidden.shape[-1], weight.shape[0]
    _head_dtype("weight", weight, hidden, style)
    if weight.shape[1] != hd or (v < 1 and style == "token_logprobs"):
        raise ValueError(m["weight_shape"].format(h=hd, shape=tuple(weight.shape)))
    if bias is None:
        return v
    if style == "rapo_loss":
        check_tensor("bias", bias, shape=(v,), dtypes=FLOAT_DTYPES)
        _head_dtype("bias", bias, hidden, style)
        return v
    _float_arg("bias", bias, (1,), style)
    _head_dtype("bias", bias, hidden, style)
    if tuple(bias.shape) != (v,):
        raise ValueError(f"bias must have shape [V] = [{v}], got {tuple(bias.shape)}")
    return v


def _check_targets_arg(targets, style: str) -> None:
    if style == "rapo_loss":
        check_tensor("targets", targets, ndim=(1, 2), dtypes=TARGET_DTYPES)
        return
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in TARGET_DTYPES:
        raise TypeError(f"targets must have dtype int64 or int32, got {targets.dtype}")


def check_model_inputs(logits, hidden, weight, bias, targets, *, style: str) -> int:
    """The model-side arguments of token_logprobs and rapo_loss: exactly one of logits [..., V] or hidden [..., H]
    with weight [V, H] (+ bias [V]) in hidden's dtype, integer targets shaped like the leading dims; returns V.
    `style` ("token_logprobs" or "rapo_loss") picks the entry point's wording and its float dtypes (rapo_loss also
    takes fp64); token_logprobs also checks here that the tensors share one device (rapo_loss checks all of its
    tensors at once). Values (the targets' range) are the callers' (rapo_loss allows the ignore index)."""
    m = _MODEL_MESSAGES[style]
    if (logits is None) == (hidden is None):
        raise ValueError(m["one_of"].format(got="both" if logits is not None else "neither"))
    rapo = style == "rapo_loss"
    if logits is not None and (weight is not None or bias is not None) and not rapo:
        raise ValueError(m["head_with_logits"])
    x, src = (logits, "logits") if logits is not None else (hidden, "hidden")
    if rapo:
        _check_targets_arg(targets, style)  # rapo_loss's shapes are stated from the targets'
    _float_arg(src, x, None if rapo else (2, 3), style)
    if logits is not None and not rapo and logits.shape[-1] < 1:
        raise ValueError(m["vocab_logits"].format(shape=tuple(logits.shape)))
    if rapo and (x.dim() != targets.dim() + 1 or tuple(x.shape[:-1]) != tuple(targets.shape)):
        want = tuple(targets.shape) + ("V" if logits is not None else "H",)
        what = "vocab" if logits is not None else "hidden"
        raise ValueError(m["x_shape"].format(src=src, want=want, what=what, got=tuple(x.shape)))
    if logits is not None and rapo and (weight is not None or bias is not None):
        raise ValueError(m["head_with_logits"])
    vocab = logits.shape[-1] if logits is not None else _check_head(hidden, weight, bias, style)
    if rapo:
        if vocab < 1:
            raise ValueError(m["vocab_logits"])
        return vocab
    _check_targets_arg(targets, style)
    lead = list(x.shape[:-1])
    if list(targets.shape) != lead:
        raise ValueError(m["x_shape"].format(src=src, lead=lead, got=list(targets.shape)))
    tensors = {src: x, "weight": weight, "bias": bias, "targets": targets}
    tensors = {k: t for k, t in tensors.items() if t is not None}
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {src} is on {x.device}: all tensors must share one device")
    return vocab
