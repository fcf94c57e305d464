"""The trajectory JSONL format that seeds a step buffer: read with checks, written atomically.

JSONL record (one per trajectory): {"query_id": int, "prompt": str, "steps": [str, ...], "answer": str,
"reward": float}. What this is not: the producer of trajectories (an off-policy agent, e.g. the demo's scripted
solver) or the step splitting (rapo_fast.retrieval.step_traces).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """Write one JSON object per line (atomically: a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file of trajectories; a malformed line raises ValueError naming the file and line."""
    out = []
    with Path(path).open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"read_jsonl: {path}:{i} is not valid JSON ({e})") from e
            for key, typ in (("query_id", int), ("prompt", str), ("steps", list), ("reward", (int, float))):
                if not isinstance(rec.get(key), typ):
                    raise ValueError(f"read_jsonl: {path}:{i} needs {key!r} of type {typ}, got {rec.get(key)!r}")
            out.append(rec)
    return out
