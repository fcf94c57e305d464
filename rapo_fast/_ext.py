"""Safe loading of the compiled extension rapo_fast._C and the helpers that pass tensors to it.

What this is: the one place that imports `rapo_fast._C`, remembers why an import failed, reports `build_info()`, and
holds the Python half of the extension's binding convention (docs/extension.md): tensors as DLPack capsules, scalars
by keyword, CUDA streams as raw handles, since the extension does not link libtorch.
What this is not: argument validation of any op (each op's Python module validates its own inputs first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.dlpack import to_dlpack

from rapo_fast import _constants

_C: Any = None
_IMPORT_ERROR: BaseException | None = None
try:  # pragma: no branch
    from rapo_fast import _C as _C_mod  # type: ignore[attr-defined]

    _C = _C_mod
except Exception as exc:  # ImportError, or an OSError from a broken .so: keep the reason for later
    _IMPORT_ERROR = exc

REBUILD_HINT = (
    "Rebuild the extension from the repository root with `pip install -e . --no-build-isolation` "
    "(nvcc must be on PATH for the CUDA backend; RAPO_FAST_CUDA=1 makes a missing nvcc an error)."
)

# Dtype codes of the extension (enum class DType): defined once in rapo_fast/_constants.py, generated into
# csrc/include/rapo/constants.h.
DTYPE_CODES: dict[torch.dtype, int] = {getattr(torch, name): code for name, code in _constants.DTYPE_NAMES.items()}


def extension() -> Any:
    """Return the loaded rapo_fast._C module, or raise a RuntimeError that says why it is missing and how to fix it."""
    if _C is None:
        raise RuntimeError(f"rapo_fast._C is not available ({_IMPORT_ERROR!r}). {REBUILD_HINT}")
    return _C


def has_extension() -> bool:
    return _C is not None


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except Exception:
        return None


def build_info() -> dict[str, Any]:
    """Which backends of rapo_fast._C were built and for which CUDA architectures, what the install asked for
    (`cuda_switch`: setup.py's resolved RAPO_FAST_CUDA, "0", "AUTO" or "1"; `nvcc_found`: whether CMake found nvcc),
    plus the runtime's versions."""
    info: dict[str, Any] = {
        "extension": _C is not None,
        "extension_error": None if _IMPORT_ERROR is None else repr(_IMPORT_ERROR),
        "cpu": False,
        "cuda": False,
        "cuda_archs": [],
        "cuda_switch": None,
        "nvcc_found": False,
        "openmp": False,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda_available": torch.cuda.is_available(),
    }
    if _C is not None:
        raw = dict(_C.BUILD_INFO)
        info.update(
            cpu=bool(raw.get("cpu", False)),
            cuda=bool(raw.get("cuda", False)),
            openmp=bool(raw.get("openmp", False)),
            cuda_archs=[a for a in str(raw.get("cuda_archs", "")).split(",") if a],
            cuda_switch=raw.get("cuda_switch"),
            nvcc_found=bool(raw.get("nvcc_found", False)),
        )
    return info


def require_backend(device: torch.device) -> Any:
    """The extension, checked to have a backend for `device`; a clear error (with the rebuild hint) otherwise."""
    C = extension()
    if device.type == "cuda" and not bool(C.BUILD_INFO["cuda"]):
        raise RuntimeError(
            "rapo_fast._C was built without its CUDA backend, but a CUDA tensor was given. " + REBUILD_HINT
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"rapo_fast._C: expected cpu or cuda tensors, got a tensor on {device}")
    return C


def stream_of(device: torch.device) -> int:
    """Raw handle of torch's current stream on `device` (0 for CPU), so CUDA work is ordered with torch's."""
    if device.type == "cuda":
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0


def dlpack(t: torch.Tensor | None) -> Any:
    """`t` as the extension takes a tensor argument: a fresh DLPack capsule (unversioned "dltensor", which the
    extension consumes: one capsule per call), or None for an absent optional tensor. torch.utils.dlpack.to_dlpack
    rather than t.__dlpack__(): it also exports a tensor that requires grad (the extension never differentiates) and
    costs a fraction of a microsecond. The caller keeps `t` alive while a CUDA kernel reads it."""
    return None if t is None else to_dlpack(t)
