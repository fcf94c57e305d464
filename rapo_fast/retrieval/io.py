"""Atomic, versioned save/load of a StepBuffer's state: safetensors for the arrays, JSON for the rest.

Directory layout: ``<dir>/CURRENT`` names the live snapshot ``<dir>/snapshot-<id>/`` holding ``tensors.safetensors``
and ``meta.json`` (format name, format version, sizes, policy, the tensors file's SHA-256). A save writes a new
snapshot under a temporary name, fsyncs it, renames it into place, then replaces CURRENT with os.replace (atomic on
POSIX) and only then removes older snapshots: a crash at any point leaves CURRENT naming a complete snapshot.
What this is not: the buffer logic (rapo_fast/retrieval/buffer.py) or a general checkpoint format.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

FORMAT_NAME = "rapo_fast.StepBuffer"
FORMAT_VERSION = 1
_TENSORS = "tensors.safetensors"
_META = "meta.json"
_CURRENT = "CURRENT"


class StepBufferFormatError(ValueError):
    """A saved StepBuffer directory is missing, corrupt, or written by an incompatible format version."""


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_snapshot(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write tensors + meta as a new snapshot of `directory` and make it current atomically. Returns its path."""
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"snapshot-{uuid.uuid4().hex}"
    tmp = root / f".{name}.tmp"
    tmp.mkdir()
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / _TENSORS))
        _fsync_file(tmp / _TENSORS)
        digest = _sha256(tmp / _TENSORS)
        full_meta = dict(meta, format=FORMAT_NAME, format_version=FORMAT_VERSION, tensors_sha256=digest)
        (tmp / _META).write_text(json.dumps(full_meta, indent=1, sort_keys=True))
        _fsync_file(tmp / _META)
        _fsync_dir(tmp)
        os.rename(tmp, root / name)
        _fsync_dir(root)
        cur_tmp = root / f".{_CURRENT}.{uuid.uuid4().hex}.tmp"
        cur_tmp.write_text(name + "\n")
        _fsync_file(cur_tmp)
        os.replace(cur_tmp, root / _CURRENT)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Older snapshots and leftovers of interrupted saves go only after CURRENT names the new one.
    for p in root.iterdir():
        if p.name != name and (p.name.startswith("snapshot-") or (p.name.startswith(".") and p.name.endswith(".tmp"))):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return root / name


def read_snapshot(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read the current snapshot of `directory`: (tensors on the CPU, meta). Raises StepBufferFormatError."""
    from safetensors.torch import load_file

    root = Path(directory)
    cur = root / _CURRENT
    if not cur.is_file():
        raise StepBufferFormatError(f"{root} is not a saved StepBuffer (no {_CURRENT} file)")
    snap = root / cur.read_text().strip()
    if not snap.name.startswith("snapshot-") or not (snap / _META).is_file() or not (snap / _TENSORS).is_file():
        raise StepBufferFormatError(f"{root}: {_CURRENT} names {snap.name!r}, which is missing or incomplete")
    try:
        meta = json.loads((snap / _META).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StepBufferFormatError(f"{snap / _META} is corrupt: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise StepBufferFormatError(f"{snap / _META}: not a {FORMAT_NAME} snapshot")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StepBufferFormatError(
            f"{snap}: format version {meta.get('format_version')!r}, this rapo_fast reads version {FORMAT_VERSION}"
        )
    if _sha256(snap / _TENSORS) != meta.get("tensors_sha256"):
        raise StepBufferFormatError(f"{snap / _TENSORS} is corrupt (SHA-256 differs from the one in {_META})")
    try:
        tensors = load_file(str(snap / _TENSORS))
    except Exception as exc:  # safetensors raises its own error types
        raise StepBufferFormatError(f"{snap / _TENSORS} could not be read: {exc}") from exc
    return tensors, meta
