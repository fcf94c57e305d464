"""The `backend` argument of exact search (StepBuffer.search, ShardedStepBuffer.search, StepTraces.retrieve and the op
`rapo_fast::retrieval_search`): which implementation runs one search, and the refusal of an explicit choice that
cannot run on the given tensors.

The rules: docs/retrieval.md, "Choosing the backend"; every backend returns the same results
(rapo_fast/reference/retrieval.py).
What this is not: the backends themselves, or the crossover table (triton_search.py).
"""

from __future__ import annotations

import torch

from rapo_fast import _ext
from rapo_fast._checks import brief
from rapo_fast._dispatch import triton_missing_reason
from rapo_fast.retrieval.triton_search import select_backend

__all__ = ["BACKENDS", "check_backend", "resolve_backend"]

BACKENDS = ("auto", "cpu", "cuda", "triton")


def _refuse(backend: str, why: str) -> ValueError:
    return ValueError(f"backend={brief(backend)} cannot run: {why} (backend='auto' picks one that can)")


def check_backend(backend: object, device: torch.device) -> str:
    """`backend` checked to be one of BACKENDS and, when explicit, able to run on tensors of `device`; returns it.
    ValueError naming `backend`, the value and the reason otherwise."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {brief(backend)}")
    if backend == "auto":
        return backend
    if backend in ("cpu", "cuda") and device.type != backend:
        raise _refuse(backend, f"the {backend.upper()} backend needs {backend} tensors, these are on {device}")
    if backend == "cpu" and not _ext.has_extension():
        err = _ext.build_info()["extension_error"]
        raise _refuse(backend, f"rapo_fast._C is not available ({err}). {_ext.REBUILD_HINT}")
    if backend == "cuda" and not _ext.build_info()["cuda"]:
        why = "rapo_fast._C is not available" if not _ext.has_extension() else "rapo_fast._C was built without CUDA"
        raise _refuse(backend, f"{why}. {_ext.REBUILD_HINT}")
    if backend == "triton":
        missing = triton_missing_reason(device)  # the one rule of where Triton kernels run
        if missing is not None:
            raise _refuse(backend, missing)
    return backend


def resolve_backend(
    backend: str, device: torch.device, Q: int, C: int, D: int, dtype: torch.dtype, k: int, metric: int
) -> str:
    """'extension' (the C++ backend of `device`: CPU or CUDA) or 'triton' for one search; `backend` as
    `check_backend`. 'auto' is exactly the choice made before `backend` existed."""
    backend = check_backend(backend, device)
    if backend == "auto":
        if device.type == "cuda" and select_backend(Q, C, D, dtype, k, metric) == "triton":
            return "triton"
        return "extension"
    return "triton" if backend == "triton" else "extension"
