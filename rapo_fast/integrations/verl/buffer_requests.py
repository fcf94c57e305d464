"""The checks a request to the verl step-buffer actor passes before it joins a shared search, and how a caller is
handed its rows or its error (rapo_fast/integrations/verl/buffer_actor.py uses them; issue 28, class 1).

Rule: a value that could fail or misbehave inside a search shared by several callers (NaN/inf thresholds, ids past
int64, text no encoder can encode) is refused here, naming the caller's argument and entry. What this is not: the
actor, its batching, or the buffer's own checks (rapo_fast.retrieval.buffer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rapo_fast._checks import INT64_MAX, INT64_MIN, check_float, check_int_list

__all__ = ["check_groups", "check_histories", "check_min_score", "check_scores", "settle"]


def check_histories(histories: Any, who: str, name: str = "histories") -> list[str]:
    """A list of str, each encodable as UTF-8 (a lone surrogate would fail in the encoder or the tokenizer, inside a
    shared search: it is refused here, naming the caller's entry)."""
    if isinstance(histories, str) or not isinstance(histories, Sequence):
        raise TypeError(f"{who}: {name} must be a list of str, got {type(histories).__name__}")
    for i, h in enumerate(histories):
        if not isinstance(h, str):
            raise TypeError(f"{who}: {name}[{i}] must be a str, got {type(h).__name__}")
        try:
            h.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{who}: {name}[{i}] is not valid Unicode text ({exc.reason} at {exc.start})") from None
    return list(histories)


def check_groups(groups: Any, n: int, name: str, who: str, lo: int = INT64_MIN) -> list[int]:
    """`n` ints in [lo, 2^63 - 1] (the int64 the buffer stores them in; bool refused)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or len(groups) != n:
        raise ValueError(f"{who}: {name} must be a list of {n} ints (one per history), got {groups!r:.200}")
    return check_int_list(f"{who}: {name}", groups, n, lo=lo, hi=INT64_MAX)


def check_min_score(min_score: Any) -> float | None:
    """None (no threshold) or a finite number: NaN would never equal another request's threshold (it could never be
    batched), and an infinite threshold is no threshold (-inf) or no result (+inf)."""
    if min_score is None:
        return None
    return check_float("retrieve: min_score", min_score)


def check_scores(scores: Any, n: int) -> list[float] | None:
    if scores is None:
        return None
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence) or len(scores) != n:
        raise ValueError(f"add_steps: scores must be None or a list of {n} floats, got {scores!r:.200}")
    return [check_float(f"add_steps: scores[{i}]", s) for i, s in enumerate(scores)]


def settle(fut: asyncio.Future, row: Any = None, exc: BaseException | None = None) -> None:
    """Hand a caller its rows or its error, unless it has gone (a cancelled caller)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(row)
