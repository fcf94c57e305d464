"""Backend choice shared by every op: Triton on CUDA tensors, Triton on CPU tensors only under TRITON_INTERPRET=1,
the plain-PyTorch reference otherwise; the device guard around every Triton launch (which also serialises
interpreted launches: the interpreter is not thread-safe); and the one helper through which
ops are registered with torch.library.

Not a place for op logic. docs/interpreter.md (backend choice) and docs/testing.md rule 3 (registered ops) give the
rules implemented here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence

import torch


def interpret_mode() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors); read once per call, it is cheap."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_TRITON_OK: bool | None = None


def triton_available() -> bool:
    # A module-level cache rather than functools.lru_cache: Dynamo warns on every trace through an lru_cache'd call.
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401

            _TRITON_OK = True
        except Exception:
            _TRITON_OK = False
    return _TRITON_OK


def triton_disabled() -> bool:
    """RAPO_FAST_DISABLE_TRITON=1: the process-wide off switch of the Triton kernels (read at call time)."""
    return os.environ.get("RAPO_FAST_DISABLE_TRITON", "0") == "1"


def triton_missing_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on tensors of `device` (None when they can), the off switch aside."""
    if not triton_available():
        return "triton is not installed (not importable)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return None if interpret_mode() else "CPU tensors run Triton only under TRITON_INTERPRET=1"
    return f"Triton has no backend for {device.type} tensors"


def use_triton(device: torch.device) -> bool:
    """Whether an op on tensors of `device` runs its Triton kernels (else the reference path)."""
    if triton_disabled():
        return False
    if device.type == "cuda":
        return triton_available()
    if device.type == "cpu":
        return interpret_mode() and triton_available()
    return False


def device_guard(x: torch.Tensor | torch.device) -> contextlib.AbstractContextManager:
    """The context every Triton launch runs in: `torch.cuda.device(x's device)` for CUDA, a no-op otherwise.

    Why: a Triton launch runs on the current CUDA device (and its current stream), not on its tensors' device; on a
    multi-GPU host a tensor on cuda:1 would be computed by a launch on cuda:0. The C++ ops guard themselves
    (CudaDeviceGuard in csrc/); the Triton launchers in rapo_fast/loss/ use this. Entering it on the current device
    costs a device query and no switch. Under TRITON_INTERPRET=1 with CPU tensors it is the lock that serialises
    interpreted launches (_INTERPRETER_LOCK).
    """
    dev = x.device if isinstance(x, torch.Tensor) else torch.device(x)
    if dev.type == "cuda":
        return torch.cuda.device(dev)
    if interpret_mode():
        return _INTERPRETER_LOCK
    return contextlib.nullcontext()


# Triton's interpreter patches `triton.language` process-wide for the length of each launch (and restores it after),
# so two interpreted launches at once break each other; every launch enters device_guard, so this one lock there
# serialises them. Reentrant: a guard entered inside another on the same thread must not deadlock. GPU launches
# never take it.
_INTERPRETER_LOCK = threading.RLock()


# Registration through one switch (FlashInfer keeps one too): RAPO_FAST_NO_CUSTOM_OP=1 calls the implementation
# directly, should dispatcher overhead ever show up in a profile.
_REGISTER = os.environ.get("RAPO_FAST_NO_CUSTOM_OP", "0") != "1"


def register_op(
    name: str,
    fn: Callable,
    *,
    mutates_args: Iterable[str] | str = (),
    fake: Callable | None = None,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
    device_types: Sequence[str] | str | None = None,
    eager_direct: bool = False,
) -> Callable:
    """Register `fn` as the torch.library custom op `rapo_fast::<name>` with its fake and autograd formulas.

    Returns the callable to use (the op, or `fn` itself when registration is switched off). eager_direct (ops without
    an autograd formula only): outside torch.compile the callable runs `fn` itself and the op only while tracing.
    Why: the first call of any torch.library custom op imports torch._dynamo (torch's backend_impl is wrapped in
    `_disable_dynamo`), 1.5-3 s on a CPU; a search or a splice in eager mode need not pay it. The op stays
    registered (torch.ops.rapo_fast.<name>, opcheck, torch.compile) and runs the same `fn`.
    """
    if not _REGISTER:
        return fn
    op = torch.library.custom_op(f"rapo_fast::{name}", fn, mutates_args=mutates_args, device_types=device_types)
    if fake is not None:
        op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    if not eager_direct:
        return op
    if backward is not None:
        raise ValueError(f"register_op({name!r}): eager_direct needs an op without an autograd formula")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return op(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)

    call.op = op  # type: ignore[attr-defined]
    return call
