"""Atomic, versioned, checksummed save/load of a StepBuffer's state: safetensors for the arrays, JSON for the rest.

The layout (a versioned directory of rapo_fast._atomic) and what a load checks: docs/formats.md section 2; a bad
file raises StepBufferFormatError naming the file and the field.
What this is not: the buffer logic (rapo_fast/retrieval/buffer.py) or the generic crash-safe machinery
(rapo_fast/_atomic.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from rapo_fast._atomic import FormatError, HashingWriter, VersionWriter, read_version
from rapo_fast._checks import check_choice, check_field, check_int
from rapo_fast._constants import MAX_KEYS
from rapo_fast.retrieval.op import METRIC_CODES

FORMAT_NAME = "rapo_fast.StepBuffer"
FORMAT_VERSION = 2
_PREFIX = "snapshot"
_TENSORS = "tensors.safetensors"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_EVICTIONS = ("fifo", "lowest_score")
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
MAX_CAPACITY = MAX_KEYS


class StepBufferFormatError(FormatError):
    """A saved StepBuffer directory is missing, corrupt, or written by an incompatible format version."""


def _write_safetensors(f: HashingWriter, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors layout (8-byte header length, JSON header, raw little-endian data), streamed tensor by tensor
    so that a large buffer is not copied into one bytes object first."""
    header, offset, parts = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        parts.append(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    f.write(len(raw).to_bytes(8, "little") + raw)
    for t in parts:
        if t.numel():
            f.write(t.reshape(-1).view(torch.uint8).numpy())


def write_snapshot(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write tensors + meta as a new snapshot of `directory` and make it current atomically. Returns its path."""
    with VersionWriter(directory, _PREFIX, FORMAT_NAME, FORMAT_VERSION) as w:
        with w.open(_TENSORS) as f:
            _write_safetensors(f, tensors)
        return w.commit(meta)


def _check_meta(meta: dict[str, Any], where: Path) -> dict[str, Any]:
    err = StepBufferFormatError
    cap = check_field(meta, "capacity", where, err, check_int, lo=1, hi=MAX_CAPACITY)
    check_field(meta, "dim", where, err, check_int, lo=1, hi=2**31 - 1)
    check_field(meta, "dtype", where, err, check_choice, tuple(_DTYPES))
    check_field(meta, "metric", where, err, check_choice, tuple(METRIC_CODES))
    check_field(meta, "eviction", where, err, check_choice, _EVICTIONS)
    size = check_field(meta, "size", where, err, check_int, lo=0, hi=cap)
    # fifo: head moves only once the ring is full; lowest_score never moves it
    head_hi = cap - 1 if size == cap and meta["eviction"] == "fifo" else 0
    check_field(meta, "head", where, err, check_int, lo=0, hi=head_hi)
    check_field(meta, "next_seq", where, err, check_int, lo=size)
    return meta


def _check_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any], where: Path) -> None:
    n, err = meta["size"], StepBufferFormatError
    expect = {
        "keys": ((n, meta["dim"]), _DTYPES[meta["dtype"]]),
        "payload_ids": ((n,), torch.int64),
        "group_ids": ((n,), torch.int64),
        "scores": ((n,), torch.float32),
        "seq": ((n,), torch.int64),
    }
    if set(tensors) != set(expect):
        raise err(f"{where}: tensors: expected {sorted(expect)}, got {sorted(tensors)}")
    for name, (shape, dt) in expect.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dt:
            raise err(f"{where}: tensor {name!r}: expected {shape} {dt}, got {tuple(t.shape)} {t.dtype}")
    if not bool(torch.isfinite(tensors["keys"]).all()) or not bool(torch.isfinite(tensors["scores"]).all()):
        raise err(f"{where}: tensors 'keys' and 'scores': expected finite values, got NaN/inf")
    if bool((tensors["group_ids"] < 0).any()):
        raise err(f"{where}: tensor 'group_ids': expected ids >= 0, got {int(tensors['group_ids'].min())}")
    seq = tensors["seq"]
    if n and (int(seq.min()) < 0 or int(seq.max()) >= meta["next_seq"] or seq.unique().numel() != n):
        raise err(f"{where}: tensor 'seq': expected {n} distinct ids in [0, next_seq={meta['next_seq']}), got others")


def read_snapshot(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read the current snapshot of `directory`: (tensors on the CPU, meta), every file, field and tensor checked
    (docs/formats.md section 2). Raises StepBufferFormatError."""
    from safetensors.torch import load_file

    with read_version(directory, _PREFIX, FORMAT_NAME, FORMAT_VERSION, StepBufferFormatError) as v:
        meta = _check_meta(v.meta, v.path / "meta.json")
        if set(v.files) != {_TENSORS}:
            raise StepBufferFormatError(
                f"{v.path / 'meta.json'}: field 'files': expected [{_TENSORS!r}], got {sorted(v.files)}"
            )
        try:
            tensors = load_file(str(v.path / _TENSORS))
        except Exception as exc:  # safetensors raises its own error types
            raise StepBufferFormatError(f"{v.path / _TENSORS}: expected a safetensors file, got {exc}") from exc
    _check_tensors(tensors, meta, v.path / _TENSORS)
    return tensors, meta
