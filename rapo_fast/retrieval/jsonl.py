"""The trajectory JSONL format that seeds a step buffer: read with checks, written atomically.

JSONL record (one per trajectory): {"query_id": int, "prompt": str, "steps": [str, ...], "answer": str,
"reward": float}; the rules a line must meet are check_record's (docs/formats.md, section 1). What this is not: the
producer of trajectories (an off-policy agent, e.g. the demo's scripted solver) or the step splitting
(rapo_fast.retrieval.step_traces).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rapo_fast._atomic import write_file_atomic
from rapo_fast._checks import brief, check_field, check_float, check_int


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """Write one JSON object per line, atomically (rapo_fast._atomic.write_file_atomic: a temporary file, fsynced,
    renamed into place; an exception or a kill leaves the previous file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        for r in records:
            f.write((json.dumps(r) + "\n").encode())

    write_file_atomic(path, write)
    return path


# query_id's range: the off-policy group id StepTraces stores for it, OFFPOLICY_GROUP_BASE (2^40) + query_id, must fit
# int64 (tests/retrieval/test_jsonl_errors.py checks the two constants agree).
QUERY_ID_MAX = 2**63 - 1 - 2**40


def _check_text(where: str, key: str, v: str) -> None:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: JSON's "\ud800" escape decodes to one
        raise ValueError(f"read_jsonl: {where}: {key!r}: expected valid Unicode text, got {exc.reason}") from None


# The histories of a trajectory (per step, the prompt and the steps before it: what StepTraces encodes) grow with the
# square of its length; a record whose histories would exceed this many characters in all is refused when read.
MAX_HISTORY_CHARS = 2**26


def _check_history_size(where: str, prompt: str, steps: list[str]) -> None:
    total, history = 0, len(prompt)
    for st in steps:
        total += history
        history += 1 + len(st)
        if total > MAX_HISTORY_CHARS:
            raise ValueError(
                f"read_jsonl: {where}: 'steps': expected histories (the prompt and the steps before each step) of "
                f"<= {MAX_HISTORY_CHARS} characters in all, got more over {len(steps)} steps; split the trajectory"
            )


def check_record(rec: Any, where: str) -> dict:
    """One trajectory record (the module docstring) or ValueError naming `where` (file:line) and the field: an object;
    query_id an int in [0, QUERY_ID_MAX] (bool refused); prompt a str; steps a list of str whose histories total at
    most MAX_HISTORY_CHARS characters; reward a finite number (bool refused); answer, when a str, and every text valid
    Unicode (no lone surrogates)."""
    if not isinstance(rec, dict):
        raise ValueError(f"read_jsonl: {where}: expected a JSON object (one trajectory), got {type(rec).__name__}")
    check_field(rec, "query_id", f"read_jsonl: {where}", ValueError, check_int, lo=0, hi=QUERY_ID_MAX)
    prompt = rec.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"read_jsonl: {where}: field 'prompt': expected a str, got {brief(prompt)}")
    _check_text(where, "prompt", prompt)
    steps = rec.get("steps")
    if not isinstance(steps, list):
        raise ValueError(f"read_jsonl: {where}: field 'steps': expected a list of str, got {brief(steps)}")
    for j, st in enumerate(steps):
        if not isinstance(st, str):
            raise ValueError(
                f"read_jsonl: {where}: field 'steps'[{j}]: expected a str, got {type(st).__name__} {brief(st)}"
            )
        _check_text(where, f"steps[{j}]", st)
    _check_history_size(where, prompt, steps)
    if isinstance(rec.get("answer"), str):
        _check_text(where, "answer", rec["answer"])
    check_field(rec, "reward", f"read_jsonl: {where}", ValueError, check_float)
    return rec


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file of trajectories; blank lines are skipped. Anything else that is not a record of the module
    docstring (invalid UTF-8 or JSON, a line that is not an object, a field of the wrong type or range: check_record)
    raises ValueError naming the file and line."""
    out = []
    with Path(path).open("rb") as f:
        for i, raw in enumerate(f, 1):
            where = f"{path}:{i}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"read_jsonl: {where}: expected UTF-8, got {e.reason} at byte {e.start}") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"read_jsonl: {where}: expected a JSON line, got invalid JSON ({e})") from None
            out.append(check_record(rec, where))
    return out
