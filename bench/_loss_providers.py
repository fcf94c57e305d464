"""The providers of bench/bench_loss.py (the clipped-surrogate policy loss, forward + backward) and its agreement
reference, each built on its own by name so that one that cannot be built costs only its own row.

A provider is fn(hidden [B, T, H], weight [V, H], targets [B, T], old_logp [B, T], adv [B], mask [B, T]) -> scalar loss;
the bench calls backward on it. Building one raises _common.Unavailable when it cannot run here (package not installed,
or a CUDA-only kernel on the CPU): its row says "unavailable: ...", never a made-up number.
What this is not: the bench's loop, rows or options (bench/bench_loss.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from _reference import token_logp

from _common import Unavailable, env_var

EPS = 0.2
# The order of a run without --providers; the CUDA-only variant is added after the logits ones on the GPU.
DEFAULT = [
    "torch_eager",
    "rapo_fast_hidden",
    "rapo_fast_logits",
    "rapo_fast_logits_lmhead",
    "rapo_fast_logits_lmhead_inplace",
    "torch_compile",
    "torch_linear_ce",
    "liger",
    "cce",
]
ALL = [*DEFAULT[:5], "rapo_fast_hidden_2pass", *DEFAULT[5:]]
EAGER_LOGITS = ("torch_eager", "torch_compile")  # hold [N, V] fp32 logits and their gradient


def compiled(name: str, device: torch.device) -> bool:
    """Whether provider `name` runs through torch.compile here (`torch_compile`; Liger on CUDA): a --quick smoke run
    skips those, whose compile alone takes longer than the rest of the run."""
    return name == "torch_compile" or (name == "liger" and device.type == "cuda")


def default_providers(gpu: bool) -> list[str]:
    """The default list: `rapo_fast_hidden_2pass` only on the GPU, the two variants differ only where Triton runs
    (it can still be asked for on the CPU by --providers, where it measures the same path again)."""
    return list(ALL) if gpu else list(DEFAULT)


def surrogate(logp, old_logp, adv, mask):
    """Clipped surrogate (clip EPS both sides) on per-token log-probs, token-mean over the mask."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20, 20))
    a = adv[:, None]
    token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
    m = mask.to(token.dtype)
    return (token * m).sum() / m.sum().clamp_min(1)


@torch.no_grad()
def reference_loss(hidden, weight, targets, old_logp, adv, mask) -> float:
    """The loss every provider is checked against: fp32 log-probs from row chunks of the logits (never the whole
    [N, V] fp32 at once), then the same surrogate. Untimed, once per shape, whatever the providers' order."""
    return float(surrogate(token_logp(targets, hidden=hidden, weight=weight), old_logp, adv, mask))


def eager_loss(hidden, weight, targets, old_logp, adv, mask):
    """Without fused kernels: materialised fp32 logits, log-softmax, clipped surrogate, token-mean."""
    from rapo_fast.reference import linear_token_logprobs_ref

    return surrogate(linear_token_logprobs_ref(hidden, weight, targets), old_logp, adv, mask)


def _torch_linear_ce_loss(hidden, weight, targets, old_logp, adv, mask):
    """The clipped surrogate on log-probs from torch's chunked F.linear_cross_entropy (fp32, as our fallback)."""
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=256, chunking_method=None)
    h = hidden.reshape(-1, hidden.shape[-1]).float()
    lce = torch.nn.functional.linear_cross_entropy(
        h, weight.float(), targets.reshape(-1), reduction="none", options=opts
    )
    return surrogate(-lce.view(targets.shape), old_logp, adv, mask)


def _ours(targets, old_logp, adv, mask, **inputs):
    """rapo_loss with the bench's options (clip EPS, token-mean) on the given logits= or hidden=/weight= inputs."""
    import rapo_fast

    return rapo_fast.rapo_loss(
        targets=targets,
        old_logp=old_logp,
        advantages=adv,
        loss_mask=mask,
        eps_low=EPS,
        eps_high=EPS,
        loss_agg="token-mean",
        **inputs,
    )


def _ours_hidden(hidden, weight, targets, old_logp, adv, mask):
    return _ours(targets, old_logp, adv, mask, hidden=hidden, weight=weight)


def _ours_hidden_2pass(*args):
    """rapo_loss(hidden=) with RAPO_FAST_FUSED_LINEAR_LOSS=0: the backward recomputes the logits (4 GEMMs)."""
    with env_var("RAPO_FAST_FUSED_LINEAR_LOSS", "0"):
        return _ours_hidden(*args)


def _ours_logits() -> Callable:
    cache: dict = {}

    def ours_logits(hidden, weight, targets, old_logp, adv, mask):
        # The logits are an input of this provider (made once, outside the timed region), as in a trainer that already
        # has them; only the loss and its backward into the logits are timed.
        key = (hidden.data_ptr(), weight.data_ptr())
        if key not in cache:
            cache.clear()
            cache[key] = (hidden @ weight.T).detach().requires_grad_(True)
        logits = cache[key]
        logits.grad = None
        return _ours(targets, old_logp, adv, mask, logits=logits)

    return ours_logits


def _ours_logits_lmhead(hidden, weight, targets, old_logp, adv, mask, inplace=False):
    """rapo_loss(logits=) on logits formed in the call (a trainer's lm_head), so that the in-place option applies."""
    return _ours(targets, old_logp, adv, mask, logits=hidden @ weight.T, inplace_backward=inplace)


def _ours_logits_lmhead_inplace(*args):
    return _ours_logits_lmhead(*args, inplace=True)


def _liger(device: torch.device) -> Callable:
    """Liger-Kernel's LigerFusedLinearGRPOLoss: loss_type "dapo" = token-mean over the batch; no reference model (beta
    0); compiled (Liger's fast path) on CUDA only, its plain-torch chunked path on the CPU."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as exc:
        raise Unavailable(f"liger_kernel not importable ({exc!r})") from exc
    liger = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        epsilon_low=EPS,
        epsilon_high=EPS,
        loss_type="dapo",
        compiled=device.type == "cuda",
    )

    def liger_fn(hidden, weight, targets, old_logp, adv, mask):
        out = liger(hidden, weight, targets, mask.long(), adv, old_per_token_logps=old_logp)
        return out[0] if isinstance(out, tuple) else out

    return liger_fn


def cce_linear_ce(device: torch.device) -> Callable:
    """Apple's Cut Cross-Entropy linear_cross_entropy; Unavailable where it cannot run: not installed, or off CUDA
    (its kernels are Triton on CUDA tensors; on CPU tensors its call fails with Triton's "0 active drivers")."""
    if importlib.util.find_spec("cut_cross_entropy") is None:
        raise Unavailable("cut_cross_entropy is not installed (PyPI cut-cross-entropy)")
    if device.type != "cuda":
        raise Unavailable(f"Cut Cross-Entropy runs Triton kernels on CUDA tensors only; this run is on {device.type}")
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError as exc:
        raise Unavailable(f"cut_cross_entropy not importable ({exc!r})") from exc
    return linear_cross_entropy


def _cce(device: torch.device) -> Callable:
    """The same clipped surrogate on per-token log-probs from Cut Cross-Entropy: -linear_cross_entropy(hidden, W,
    targets, reduction="none") (impl "cce", its default filter_eps "high": gradient entries below eps/32 of the
    input dtype are skipped in its backward, as it ships). Its backward needs bf16/fp16 hidden states."""
    linear_cross_entropy = cce_linear_ce(device)

    def cce_fn(hidden, weight, targets, old_logp, adv, mask):
        logp = -linear_cross_entropy(hidden, weight, targets, reduction="none", impl="cce")
        return surrogate(logp.float(), old_logp, adv, mask)

    return cce_fn


def make_provider(name: str, device: torch.device) -> Callable:
    """The provider `name` (one of ALL), built now; Unavailable when it cannot run here."""
    fixed = {
        "torch_eager": eager_loss,
        "rapo_fast_hidden": _ours_hidden,
        "rapo_fast_hidden_2pass": _ours_hidden_2pass,
        "rapo_fast_logits_lmhead": _ours_logits_lmhead,
        "rapo_fast_logits_lmhead_inplace": _ours_logits_lmhead_inplace,
    }
    if name in fixed:
        return fixed[name]
    if name == "rapo_fast_logits":
        return _ours_logits()
    if name == "torch_compile":
        return torch.compile(eager_loss, dynamic=False)
    if name == "torch_linear_ce":
        if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
            raise Unavailable(f"torch {torch.__version__} has no chunked F.linear_cross_entropy")
        return _torch_linear_ce_loss
    if name == "liger":
        return _liger(device)
    if name == "cce":
        return _cce(device)
    raise ValueError(f"unknown loss provider {name!r}")
