"""The options of the RAPO policy loss, once: `LossOptions` (every option, its default and its check), and the checks
of rapo_loss's tensor arguments.

What this is: `LossOptions` (a frozen rapo_fast._sections.Section that every loss entry point, adapter and the
reference builds), the option vocabularies, `OPTION_DEFAULTS`, `LossInputs`, `check_inputs`, and the two checks run
on the log-prob pass's [N] output, so that no check reads the [N, V] logits. The options table: docs/loss.md section 7.
What it is not: the loss math (docs/loss.md; rapo_fast/loss/policy_loss.py and
rapo_fast/kernels/loss/policy_loss.py compute it) or generic checks (rapo_fast/_checks.py, which this module uses).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import torch

from rapo_fast import _checks as C
from rapo_fast._sections import Section, option, rule_bool, rule_choice, rule_real
from rapo_fast.kernels.loss.policy_layout import KL_ESTIMATORS, OFFPOLICY_MODES

__all__ = [
    "LossOptions",
    "KernelArg",
    "OPTION_DEFAULTS",
    "OFFPOLICY_MODES",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "InputFacts",
    "LossInputs",
    "check_inputs",
    "check_logits_rows_defined",
    "check_loss_logp_defined",
    "with_option_keywords",
    "TARGET_DTYPES",
    "IGNORE_INDEX",
    "OLD_LOGP_MAX",
]

# The integer dtypes accepted for targets, by rapo_loss and token_logprobs (one rule: rapo_fast/_checks.py).
TARGET_DTYPES = C.TARGET_DTYPES
# The ignore index of torch's cross-entropy and of Hugging Face labels: accepted as a target where loss_mask is 0 (such
# a token never enters the loss; it is given target 0 before any kernel reads it), refused where loss_mask is set.
IGNORE_INDEX = -100
# Largest old_logp accepted at a token in the loss. A log-prob is <= 0; one computed as z_y - lse (by the rollout
# engine, say) can round a few ulp above 0 (and bf16 storage keeps that tiny), so 1e-4 tolerates rounding, while
# probabilities passed by mistake (p in (0, 1], above 1e-4 at nearly every sampled token) are refused.
OLD_LOGP_MAX = 1e-4

IS_LEVELS = ("token", "sequence")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class KernelArg:
    """How an option reaches the policy-loss kernels (rapo_fast/kernels/loss/policy_loss.py), which read it as the field
    of the same name of their one options argument: `encode` (option value -> number), `decode` (its inverse), and
    `kind`, the field's Python type (float: a runtime scalar; int / bool: a constexpr of the kernel)."""

    encode: Callable[[Any], float | int | bool]
    decode: Callable[[float], Any]
    kind: type


_K_REAL = KernelArg(float, float, float)
# an option that is off when None: 0 stands for None (every such option is > 0 when set, as its check says)
_K_REAL_OR_NONE = KernelArg(lambda v: 0.0 if v is None else float(v), lambda x: None if x == 0 else float(x), float)
_K_FLAG = KernelArg(bool, bool, bool)


def _k_choice(choices: tuple[str, ...]) -> KernelArg:
    """A string option as its index in `choices` (the kernel compares it with the same indices)."""
    return KernelArg(choices.index, lambda x: choices[int(x)], int)


@dataclass(frozen=True)
class LossOptions(Section):
    """Every keyword option of rapo_loss (everything but the tensors) with its default; the formulas are in
    docs/loss.md. Checked on construction: a bad value raises ValueError / TypeError naming the option.

    A field with `kernel` metadata (a KernelArg) is an option of the per-token policy loss and says how the kernels
    take it; the others act on rows, logits or the call.

    Build one from keywords (`LossOptions(eps_high=0.28)`), from a preset (`LossOptions(**presets.RAPO)`), or from
    another (`opts.replace(beta=0.04)`); pass it as `rapo_loss(..., options=opts)` (keywords given beside it win).
    """

    # importance shaping: r_hat = (1 + shaping_m * F_s) r, F_s the row's retrieved / response tokens
    shaping_m: float = option(0.0, rule_real(-1.0, lo_open=True))
    # retrieved tokens in the loss: "none" (excluded), "shaped" (-A p / (p + gamma)), "truncated" (capped IS weight)
    offpolicy_train: str = option("none", rule_choice(*OFFPOLICY_MODES), kernel=_k_choice(OFFPOLICY_MODES))
    gamma: float = option(0.1, rule_real(0.0, lo_open=True), kernel=_K_REAL)
    is_cap: float = option(2.0, rule_real(0.0, lo_open=True), kernel=_K_REAL)
    # truncated importance sampling of the on-policy tokens: pg *= min(exp(old - behav), tis_cap); needs behav_logp
    tis_cap: float | None = option(None, rule_real(0.0, lo_open=True, allow_none=True), kernel=_K_REAL_OR_NONE)
    # PPO clip of r_hat to [1 - eps_low, 1 + eps_high]; dual clip c (A < 0): min(pg, -A c)
    eps_low: float = option(0.2, rule_real(0.0, 1.0), kernel=_K_REAL)
    eps_high: float = option(0.2, rule_real(0.0), kernel=_K_REAL)
    dual_clip: float | None = option(None, rule_real(1.0, lo_open=True, allow_none=True), kernel=_K_REAL_OR_NONE)
    # "token" ratio, or GSPO's "sequence" ratio
    importance_sampling_level: str = option("token", rule_choice(*IS_LEVELS))
    # + beta * KL_k(logp, ref_logp) (needs ref_logp when beta != 0) - entropy_coef * H
    beta: float = option(0.0, rule_real(), kernel=_K_REAL)
    kl_estimator: str = option("k3", rule_choice(*KL_ESTIMATORS), kernel=_k_choice(KL_ESTIMATORS))
    # k3 clamped to [-10, 10] as verl's kl_penalty does (zero gradient past it); TRL does not clamp, and its adapter
    # sets False. k1 and k2 are never clamped (as in verl).
    kl_clamp: bool = option(True, rule_bool(), kernel=_K_FLAG)
    entropy_coef: float = option(0.0, rule_real(), kernel=_K_REAL)
    # logits / temperature (rapo_loss only: the log-probs given to policy_loss_from_logp have theirs already)
    temperature: float = option(1.0, rule_real(0.0, lo_open=True))
    # aggregation over tokens and sequences (docs/loss.md section 4)
    loss_agg: str = option("token-mean", rule_choice(*LOSS_AGG_MODES))
    # also return the metrics (docs/loss.md section 5)
    return_metrics: bool = option(False, rule_bool())

    # ---- the per-token policy-loss kernels' view: docs/architecture.md ("How an option reaches the kernel")
    @classmethod
    def kernel_names(cls) -> tuple[str, ...]:
        """The options the per-token policy-loss kernels take (the others act on rows, logits or the call)."""
        return tuple(_KERNEL_ARGS)

    def to_kernel(self) -> dict[str, float | int | bool]:
        """The kernels' keyword arguments: each kernel option under its own name, encoded (KernelArg)."""
        return {n: k.kind(k.encode(getattr(self, n))) for n, k in _KERNEL_ARGS.items()}

    def kernel_scalars(self) -> torch.Tensor:
        """to_kernel()'s values as one float64 CPU tensor [len(kernel_names())], the form the registered ops take
        (exact: the floats are Python floats, the codes small integers)."""
        return torch.tensor([float(v) for v in self.to_kernel().values()], dtype=torch.float64)

    @classmethod
    def kernel_kwargs(cls, scalars: torch.Tensor) -> dict[str, float | int | bool]:
        """The kernels' keyword arguments back from kernel_scalars() (equal to the options' to_kernel())."""
        return {n: k.kind(x) for (n, k), x in zip(_KERNEL_ARGS.items(), scalars.tolist(), strict=True)}

    @classmethod
    def kernel_options(cls, scalars: torch.Tensor) -> dict[str, Any]:
        """The option values back from kernel_scalars(), as the reference (policy_token_loss_ref) takes them."""
        return {n: k.decode(x) for (n, k), x in zip(_KERNEL_ARGS.items(), scalars.tolist(), strict=True)}

    def overrides(self) -> dict[str, Any]:
        """The options whose value differs from the default."""
        return {n: v for n, v in self.to_dict().items() if v != OPTION_DEFAULTS[n]}

    @classmethod
    def from_call(
        cls,
        options: LossOptions | Mapping[str, Any] | None,
        keywords: Mapping[str, Any],
        *,
        caller: str,
        exclude: Collection[str] = (),
    ) -> LossOptions:
        """The options of one call of `caller`: `options` (a LossOptions, a mapping such as a preset, or None) with
        the call's option `keywords` on top. A keyword that is not an option (or is in `exclude`) raises TypeError,
        as Python does for an unexpected keyword argument."""
        _refuse_unknown(keywords, caller, exclude)
        if options is None or isinstance(options, Mapping):
            mapping = dict(options or {})
            unknown = sorted(set(mapping) - set(cls.names()) | set(mapping) & set(exclude))
            if unknown:
                raise TypeError(
                    f"options: expected options of {caller} among {sorted(set(cls.names()) - set(exclude))}, got "
                    f"unknown option(s) {unknown}"
                )
            return cls(**{**mapping, **keywords})
        if not isinstance(options, LossOptions):
            raise TypeError(f"options: expected a LossOptions or a mapping of options, got {type(options).__name__}")
        return options.replace(**keywords) if keywords else options


# The fields read once, here: rapo_loss builds its LossOptions inside a torch.compile'd region, and Dynamo cannot
# trace dataclasses.fields(), so Section's plan is made now and no method reads the fields at call time.
LossOptions.plan()
_FIELDS = fields(LossOptions)
_KERNEL_ARGS = MappingProxyType({f.name: f.metadata["kernel"] for f in _FIELDS if "kernel" in f.metadata})


def _refuse_unknown(keywords: Mapping[str, Any], caller: str, exclude: Collection[str] = ()) -> None:
    names = set(LossOptions.names()) - set(exclude)
    for k in keywords:
        if k not in names:
            raise TypeError(
                f"{caller}: expected LossOptions' fields as keywords, got an unexpected keyword argument {k!r}"
            )


OPTION_DEFAULTS: Mapping[str, Any] = MappingProxyType({f.name: f.default for f in _FIELDS})


def with_option_keywords(exclude: Collection[str] = ()) -> Callable[[Callable], Callable]:
    """Decorator: the signature (help(), inspect) of a function taking `**options` lists LossOptions' fields, with
    their defaults, as keyword-only parameters in place of `**options`, so they are discoverable without being
    written out again. Calls are unchanged: the function itself checks its keywords (LossOptions.from_call)."""

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        params += [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in _FIELDS
            if f.name not in exclude
        ]
        fn.__signature__ = sig.replace(parameters=params)
        return fn

    return decorate


@dataclass(frozen=True)
class InputFacts:
    """What check_inputs learnt: the targets' (or logp's) shape, flat layout or not, rows (sequences), the device,
    the vocabulary size V (None for policy_loss_from_logp), and whether some targets may be IGNORE_INDEX (at tokens
    outside loss_mask only; always True while tracing under torch.compile, where the targets are not read)."""

    shape: tuple[int, ...]
    flat: bool
    rows: int
    device: torch.device | None
    vocab: int | None = None
    ignored_targets: bool = False


# The tensor arguments of the two loss entry points, by name (those an entry point lacks are None), in the order
# check_same_device reads them (the first given names the device).
_TENSOR_ARGS = (
    "logp entropy targets logits hidden weight bias old_logp advantages loss_mask retrieved_mask response_mask "
    "behav_logp ref_logp cu_seqlens global_num_tokens"
).split()


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """One rapo_loss / policy_loss_from_logp call's arguments, checked, by name, as the loss steps take them: the model
    side (logits, or hidden + weight + bias, with targets; or the given logp and entropy), the per-token tensors, the
    options, and the `facts` check_inputs learnt. Built only by `LossInputs.checked`, once per call, by both entry
    points (rapo_fast/loss/policy_loss.py); `entry` names the entry point."""

    entry: str
    opts: LossOptions
    facts: InputFacts
    old_logp: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    retrieved_mask: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    behav_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    global_num_tokens: Any = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    @classmethod
    def checked(cls, entry: str, opts: LossOptions, args: Mapping[str, Any]) -> LossInputs:
        """The call's inputs, checked once (check_inputs) against the already checked `opts`. `args`: the entry
        point's arguments by name (its locals(): the signature is the one list of them); other names are ignored.
        The ignore index is replaced in targets where the loss never reads it (check_inputs allows it only there)."""
        t = {k: args.get(k) for k in _TENSOR_ARGS}
        facts = check_inputs(entry, opts, t)
        if facts.ignored_targets:
            t["targets"] = t["targets"].masked_fill(t["targets"] == IGNORE_INDEX, 0)
        return cls(entry=entry, opts=opts, facts=facts, **t)


def _check_logp_inputs(t: Mapping[str, Any], opts: LossOptions) -> tuple:
    """policy_loss_from_logp's logp / entropy checks; returns logp's shape."""
    logp = C.check_tensor("logp", t["logp"], ndim=(1, 2), dtypes=C.FLOAT_DTYPES)
    tshape = tuple(logp.shape)
    C.check_optional_tensor("entropy", t["entropy"], shape=tshape, dtypes=C.FLOAT_DTYPES)
    if opts.entropy_coef != 0.0 and t["entropy"] is None:
        raise ValueError(f"entropy: expected a tensor when entropy_coef != 0 ({opts.entropy_coef}), got None")
    return tshape


def _check_per_token(t: Mapping[str, Any], tshape: tuple) -> None:
    for k in ("old_logp", "behav_logp", "ref_logp"):
        C.check_optional_tensor(k, t[k], shape=tshape, dtypes=C.FLOAT_DTYPES)
    for k in ("loss_mask", "retrieved_mask", "response_mask"):
        C.check_optional_tensor(k, t[k], shape=tshape, dtypes=C.MASK_DTYPES)
    if t["old_logp"] is None or t["loss_mask"] is None:
        raise ValueError("old_logp/loss_mask: expected tensors, got None")


def _check_targets(targets: torch.Tensor, loss_mask: torch.Tensor, vocab: int) -> bool:
    """targets in [0, V), except IGNORE_INDEX (-100, Hugging Face's label padding) where loss_mask is 0; returns
    whether any IGNORE_INDEX may be present. A -100 where loss_mask is set is refused by name: the token would enter
    the loss with no target. Two syncs at most; skipped while tracing under torch.compile (True is returned then: the
    caller replaces -100 without knowing whether there is one)."""
    if torch.compiler.is_compiling():
        return True
    ignored = targets == IGNORE_INDEX
    at_loss = ignored & (loss_mask != 0).to(ignored.device)
    if bool(at_loss.any()):
        first = tuple(torch.nonzero(at_loss)[0].tolist())
        raise ValueError(
            f"targets: expected ids in [0, {vocab}) at tokens in the loss (loss_mask != 0), got {IGNORE_INDEX} (the "
            f"ignore index) at {int(at_loss.sum())} such token(s) (first at index {first}); set loss_mask to 0 there"
        )
    any_ignored = bool(ignored.any())
    C.check_index_range("targets", targets.masked_fill(ignored, 0) if any_ignored else targets, vocab)
    return any_ignored


def _check_logp_not_positive(name: str, t: torch.Tensor, in_loss: torch.Tensor) -> None:
    """No value above OLD_LOGP_MAX where in_loss is set: a log-prob is <= 0, and positive values almost always mean
    probabilities were passed instead of log-probabilities. One sync; skipped while tracing under torch.compile."""
    if t.numel() == 0 or torch.compiler.is_compiling():
        return
    bad = (t > OLD_LOGP_MAX) & in_loss.to(t.device)
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"{name}: expected log-probabilities (<= 0; up to {OLD_LOGP_MAX} of rounding tolerated) at tokens in the "
            f"loss, got {int(bad.sum())} value(s) above that (first at index {first}: {float(t[first])}); "
            f"probabilities passed instead of log-probabilities? (pass torch.log(p))"
        )


def _check_values(t: Mapping[str, Any], opts: LossOptions, targets: torch.Tensor | None, vocab: int | None) -> bool:
    """Value checks (one sync each) and the tensors some options need; returns whether some targets are
    IGNORE_INDEX (all outside loss_mask)."""
    ignored = _check_targets(targets, t["loss_mask"], vocab) if targets is not None else False
    # logits rows are not checked here: that would be one more pass over [N, V]; check_logits_rows_defined does it
    # from the forward's output instead (after the log-prob launch, before anything else)
    # per-token values are read only where the token enters the loss: a masked token's old/behav/ref log-prob and
    # advantage may hold anything (NaN, inf), as its logits may; the loss never reads them (docs/loss.md section 3)
    in_loss = t["loss_mask"] != 0
    if opts.offpolicy_train == "none" and t["retrieved_mask"] is not None:
        in_loss = in_loss & (t["retrieved_mask"] == 0)
    adv = t["advantages"]
    C.check_finite("advantages", adv, in_loss=in_loss if adv.shape == in_loss.shape else None)
    C.check_finite("old_logp", t["old_logp"], allow_inf=True, in_loss=in_loss)
    _check_logp_not_positive("old_logp", t["old_logp"], in_loss)
    if opts.offpolicy_train == "truncated" and t["behav_logp"] is None:
        raise ValueError(
            "behav_logp: expected the behaviour log-probs of the retrieved tokens when offpolicy_train='truncated', "
            "got None"
        )
    if opts.tis_cap is not None and t["behav_logp"] is None:
        raise ValueError("behav_logp: expected a tensor when tis_cap is set (truncated importance sampling), got None")
    if opts.beta != 0.0 and t["ref_logp"] is None:
        raise ValueError(f"ref_logp: expected a tensor when beta != 0 ({opts.beta}), got None")
    for k in ("behav_logp", "ref_logp"):
        if t[k] is not None:
            C.check_finite(k, t[k], allow_inf=True, in_loss=in_loss)
    return ignored


def check_logits_rows_defined(logp: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor) -> None:
    """The logits= path's check of docs/loss.md section 3: every token in the loss (loss_mask != 0) has a logits row
    whose log-sum-exp is finite: no NaN, no +inf, not only -inf (and no overflow of logits / temperature); any of
    those would give a NaN loss. Masked tokens may hold anything: they contribute exactly zero.

    Decided from the forward's own output rather than from a pass of its own over the [N, V] logits (which cost
    about 2 ms of a 5.5 ms loss at N=16k, V=152k): `logp` is token_logprobs' log-prob, which on every path is NaN
    exactly where the row's lse is not finite (docs/loss.md section 2). So: one [N] comparison and one sync, after
    the log-prob launch and before the policy op and any backward; skipped while tracing under torch.compile (as
    check_loss_logp_defined). The error path alone reads one logits row, for the message."""
    if logp.numel() == 0 or torch.compiler.is_compiling():
        return
    bad = torch.isnan(logp.detach()).reshape(loss_mask.shape) & (loss_mask != 0)
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        row_max = float(logits.detach()[first].amax())  # one row, on the error path only
        why = "" if not math.isfinite(row_max) else ": logits / temperature overflow the float range"
        raise ValueError(
            f"logits: expected a finite log-sum-exp on the row of every token in the loss (loss_mask != 0), got "
            f"{int(bad.sum())} row(s) with NaN or +inf, or only -inf (first at index {first}, row max {row_max}{why}): "
            "their log-prob is undefined"
        )


def check_loss_logp_defined(undefined: torch.Tensor) -> None:
    """The hidden= path's check of docs/loss.md section 3: `undefined` [N] bool marks the tokens in the loss whose
    log-prob came out NaN (their logits row, h W^T + b, has a log-sum-exp that is not finite: h W^T overflowed, or NaN
    in hidden/weight). The logits never exist as a whole there, so this runs after the log-prob pass (one sync) and
    before any backward; skipped while tracing."""
    if undefined.numel() == 0 or torch.compiler.is_compiling():
        return
    if bool(undefined.any()):
        first = int(torch.nonzero(undefined.reshape(-1))[0])
        raise ValueError(
            f"hidden: expected logits (hidden @ weight^T + bias) with a finite log-sum-exp at every token in the loss, "
            f"got {int(undefined.sum())} token(s) whose log-sum-exp is not finite (first at flat token index {first}): "
            "hidden @ weight^T overflowed the float range or hidden/weight/bias hold NaN"
        )


def _check_global_num_tokens(g: Any, dev: torch.device | None) -> None:
    """A finite count > 0, whether given as a number or as a 1-element tensor (whose value is read: one sync,
    skipped while tracing under torch.compile). A negative count would flip the loss's sign, 0 or NaN give NaN,
    inf gives 0: one check for both forms."""
    if g is None:
        return
    if isinstance(g, torch.Tensor):
        if g.numel() != 1 or g.dtype == torch.bool or g.is_complex():
            raise ValueError(
                f"global_num_tokens: expected a number or a 1-element numeric tensor, got shape "
                f"{tuple(g.shape)} dtype {g.dtype}"
            )
        if g.device != dev and g.device.type != "cpu":
            raise ValueError(f"global_num_tokens: expected device {dev} or cpu, got {g.device}")
        if torch.compiler.is_compiling():
            return
        g = g.detach().reshape(()).item()
    C.check_float("global_num_tokens", g, min_value=0.0, min_inclusive=False)


def check_inputs(entry: str, opts: LossOptions, t: Mapping[str, Any]) -> InputFacts:
    """Check every tensor argument `t` (by name, each present, None if not given) of rapo_loss or
    policy_loss_from_logp (`entry`): logits/hidden/weight/bias/targets, or logp/entropy, and the per-token tensors,
    cu_seqlens, global_num_tokens, against the (already checked) options; return the facts the launcher needs."""
    if entry == "policy_loss_from_logp":  # log-probs (and entropy) given, no logits/hidden/targets
        tshape, targets, vocab = _check_logp_inputs(t, opts), None, None
    else:
        vocab = C.check_model_inputs(t["logits"], t["hidden"], t["weight"], t["bias"], t["targets"])
        targets, tshape = t["targets"], tuple(t["targets"].shape)
    _check_per_token(t, tshape)
    cu, flat = t["cu_seqlens"], len(tshape) == 1  # rows: the sequences of padded [B, T] or flat [N] (+ cu_seqlens)
    if cu is not None and not flat:
        raise ValueError(
            f"cu_seqlens: expected None with padded inputs (it is for flat targets / logp [N]), got shape {tshape}"
        )
    rows = C.check_cu_seqlens("cu_seqlens", cu, tshape[0]) if cu is not None else (1 if flat else tshape[0])
    adv = C.check_tensor("advantages", t["advantages"], dtypes=C.FLOAT_DTYPES)
    if tuple(adv.shape) not in (tshape, (rows,)):
        raise ValueError(
            f"advantages: expected shape {tshape} (per token) or ({rows},) (per sequence), got {tuple(adv.shape)}"
        )
    dev = C.check_same_device(**{k: v for k, v in t.items() if k != "global_num_tokens"})
    ignored = _check_values(t, opts, targets, vocab)
    _check_global_num_tokens(t["global_num_tokens"], dev)
    return InputFacts(shape=tshape, flat=flat, rows=rows, device=dev, vocab=vocab, ignored_targets=ignored)
