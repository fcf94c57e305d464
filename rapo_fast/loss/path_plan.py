"""Which log-prob / loss path runs, decided in one place: `plan_path` returns a named `Path` and the reason for it.

What this is: the rule behind the `backend=` argument of token_logprobs, rapo_loss and policy_loss_from_logp, with the
environment switches, the refusals and the debug log line; docs/architecture.md ("Log-prob and loss paths") lists the
paths. The plan is made in Python before any op runs; no op sees it.
What this is not: the paths themselves (rapo_fast/loss/logprobs.py, linear_logprobs.py, fused_linear.py,
torch_linear_ce.py, policy_op.py) nor the per-device rule of a single op (rapo_fast/_dispatch.py).
"""

from __future__ import annotations

import enum
import logging
import os
from typing import NamedTuple

import torch

from rapo_fast import _checks as C
from rapo_fast import _dispatch
from rapo_fast.loss.torch_linear_ce import torch_linear_ce_available

__all__ = ["BACKENDS", "ENTRIES", "Path", "PathPlan", "plan_path", "log_path"]

BACKENDS = ("auto", "triton", "torch", "reference")
ENTRIES = ("token_logprobs", "rapo_loss", "policy_loss_from_logp")
LOGGER = logging.getLogger("rapo_fast")


class Path(str, enum.Enum):
    """The paths, named by what runs (the value is the name reported)."""

    TRITON_LOGITS = "triton_logits"  # Triton online-softmax kernels over the given logits
    TRITON_LINEAR = "triton_linear"  # hidden x lm_head in logits tiles (torch.matmul) + Triton kernels, two passes
    TRITON_FUSED_LINEAR = "triton_fused_linear"  # rapo_loss: logp, loss and all gradients in one tiled pass
    TRITON_POLICY = "triton_policy"  # policy_loss_from_logp: the Triton policy-loss op on given log-probs
    TORCH_LINEAR_CE = "torch_linear_ce"  # torch's chunked F.linear_cross_entropy (hidden, no entropy)
    REFERENCE_CHUNKED = "reference_chunked"  # the plain-PyTorch reference over row chunks (checkpointed)
    REFERENCE_FP64 = "reference_fp64"  # rapo_loss on fp64 inputs: the reference, unchunked, in fp64
    TORCH_POLICY = "torch_policy"  # policy_loss_from_logp: the reference's per-token policy loss in torch

    @property
    def triton(self) -> bool:
        """Whether this path runs Triton kernels (rapo_loss then runs the Triton policy op too)."""
        return self.value.startswith("triton")


class PathPlan(NamedTuple):
    """The path, why, and the backend family it belongs to ("triton" or "torch"/"reference", "auto" resolved)."""

    path: Path
    reason: str
    backend: str


def _refuse(backend: str, why: str) -> ValueError:
    return ValueError(f"backend: expected a backend that can run on these inputs, got {backend!r}: {why}")


def _auto_triton(device: torch.device, auto_triton: bool | None) -> tuple[bool, str]:
    """(Triton or not, why) for backend="auto"; `auto_triton` is the caller's use_triton(device), when given."""
    ok = _dispatch.use_triton(device) if auto_triton is None else auto_triton
    if ok:
        interp = " (TRITON_INTERPRET=1)" if device.type == "cpu" else ""
        return True, f"Triton runs on {device.type} tensors{interp}"
    if _dispatch.triton_disabled():
        return False, "RAPO_FAST_DISABLE_TRITON=1"
    return False, _dispatch.triton_missing_reason(device) or "Triton is off for this call"


def _torch_path(entry: str, hidden: bool, entropy: bool, backend: str) -> tuple[Path, str]:
    """The plain-PyTorch log-prob path: torch's chunked linear CE where it does the job ("torch" only), else the
    chunked reference."""
    if entry == "policy_loss_from_logp":
        return Path.TORCH_POLICY, "the reference's per-token policy loss"
    if backend == "reference":
        return Path.REFERENCE_CHUNKED, "backend='reference'"
    if not hidden:
        return Path.REFERENCE_CHUNKED, "logits given (torch's linear CE takes hidden states)"
    if entropy:
        return Path.REFERENCE_CHUNKED, "entropy asked for (torch's linear CE gives none)"
    if not torch_linear_ce_available():
        return Path.REFERENCE_CHUNKED, "this torch has no chunked F.linear_cross_entropy"
    if torch.compiler.is_compiling():
        return Path.REFERENCE_CHUNKED, "tracing under torch.compile (torch's linear CE needs a data-dependent check)"
    return Path.TORCH_LINEAR_CE, "hidden states without entropy"


def _triton_path(entry: str, hidden: bool, needs_grad: bool, sequence_level: bool, auto: bool) -> tuple[Path, str]:
    if entry == "policy_loss_from_logp":
        return Path.TRITON_POLICY, "the Triton policy-loss op"
    if not hidden:
        return Path.TRITON_LOGITS, "logits given"
    if entry == "token_logprobs":
        return Path.TRITON_LINEAR, "hidden states"
    if sequence_level:
        return Path.TRITON_LINEAR, "importance_sampling_level='sequence' (GSPO) needs whole sequences' logp first"
    if not needs_grad:
        return Path.TRITON_LINEAR, "no gradient needed (the fused pass would add gradient GEMMs)"
    if auto and os.environ.get("RAPO_FAST_FUSED_LINEAR_LOSS", "1") == "0":
        return Path.TRITON_LINEAR, "RAPO_FAST_FUSED_LINEAR_LOSS=0"
    return Path.TRITON_FUSED_LINEAR, "hidden states, token level, gradient needed"


def plan_path(
    entry: str,
    backend: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    hidden: bool = False,
    entropy: bool = False,
    needs_grad: bool = False,
    sequence_level: bool = False,
    auto_triton: bool | None = None,
) -> PathPlan:
    """The path `entry` (one of ENTRIES) takes for inputs on `device` in `dtype` (logits' / hidden's / logp's),
    given hidden states or not, entropy wanted, a gradient needed, GSPO's sequence level; `auto_triton` is the
    caller's use_triton(device) (default: rapo_fast._dispatch.use_triton). Raises ValueError for a backend outside
    BACKENDS or an explicit one that cannot run here; environment switches steer "auto" only."""
    C.check_choice("backend", backend, BACKENDS)
    fp64 = dtype == torch.float64
    if backend == "triton":
        if _dispatch.triton_disabled():
            raise _refuse(backend, "RAPO_FAST_DISABLE_TRITON=1 switches the Triton kernels off in this process")
        missing = _dispatch.triton_missing_reason(device)
        if missing is not None:
            raise _refuse(backend, missing)
        if fp64:
            raise _refuse(backend, "float64 inputs (the Triton kernels take float32/float16/bfloat16)")
        path, why = _triton_path(entry, hidden, needs_grad, sequence_level, auto=False)
        return PathPlan(path, f"backend='triton': {why}", "triton")
    if backend == "auto":
        ok, why_device = _auto_triton(device, auto_triton)
        if ok and not fp64:
            path, why = _triton_path(entry, hidden, needs_grad, sequence_level, auto=True)
            return PathPlan(path, f"auto: {why_device}; {why}", "triton")
        why_device = "float64 inputs" if fp64 else why_device
        family = "torch"
    else:
        why_device, family = f"backend={backend!r}", backend
    if fp64 and entry == "rapo_loss":
        return PathPlan(Path.REFERENCE_FP64, f"{why_device}; float64: the reference keeps fp64", family)
    path, why = _torch_path(entry, hidden, entropy, family)
    return PathPlan(path, f"{why_device}; {why}", family)


def log_path(entry: str, path: Path, reason: str) -> None:
    """The debug line naming the path that ran (not while tracing under torch.compile)."""
    if not torch.compiler.is_compiling() and LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("%s: path %s (%s)", entry, path.value, reason)
