"""rapo_loss(logits=...)'s refusal of a token in the loss whose logits row has no finite log-sum-exp (NaN, +inf, only
-inf, or logits / temperature overflowing), decided from the log-prob forward's own output
(rapo_fast/loss/options.py `check_logits_rows_defined`) instead of a pass of its own over the [N, V] logits.

Checked: such a row in the loss raises the ValueError naming `logits`, the count, the first index and the reason,
before the policy op and any backward, on the Triton path (the interpreter here), the CPU fallback, the fp64 path and
with inplace_backward=True, padded and flat; the invariant the check rests on (logp NaN exactly where the row's lse
is not finite, kernel and reference); and that the forward reads the logits once, in the log-prob pass, with no
reduction of its own over them (a TorchDispatchMode records every op on the logits' storage). Not here: the other
argument checks (test_loss_checks.py), the same rows masked (test_masked_rows.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.loss_cases import make_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import rapo_fast
from rapo_fast._dispatch import use_triton
from rapo_fast.loss import policy_loss as loss_mod
from rapo_fast.reference import token_logprobs_ref

# "triton" runs the kernels where they run: on CUDA when there is a GPU, else in the interpreter (TRITON_INTERPRET=1)
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PATHS = ["triton", "fallback", "fp64", "inplace"]
POISONS = {
    "nan_row": (float("nan"), False),
    "nan_entry": (float("nan"), True),  # one NaN among finite logits
    "pos_inf_row": (float("inf"), False),
    "pos_inf_entry": (float("inf"), True),
    "neg_inf_row": (float("-inf"), False),  # a row of only -inf: lse = -inf
}
MESSAGE = (
    r"logits: expected a finite log-sum-exp on the row of every token in the loss \(loss_mask != 0\), got {n} "
    r"row\(s\) with NaN or \+inf, or only -inf \(first at index {first}, row max {rmax}.*\): "
    r"their log-prob is undefined"
)


def _setup(path, monkeypatch):
    """The device and dtype of `path`; skips a Triton path where Triton cannot run."""
    if path == "fallback":
        monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
        return torch.device("cpu"), torch.float32
    if path in ("triton", "inplace") and not use_triton(TRITON_DEVICE):
        pytest.skip("no Triton device (TRITON_INTERPRET=1 or CUDA)")
    dev = TRITON_DEVICE if path in ("triton", "inplace") else torch.device("cpu")
    return dev, torch.float64 if path == "fp64" else torch.float32


def _batch(flat: bool):
    d = make_batch(seg_lens=[4, 6], V=37, seed=11) if flat else make_batch(2, 5, 37, seed=11)
    d["loss_mask"][...] = True
    return d


def _poison(d, positions, name, in_loss: bool):
    """A copy of d whose logits rows at `positions` hold the poison `name`, in the loss or masked out."""
    p = {k: v.clone() for k, v in d.items()}
    value, entry = POISONS[name]
    for pos in positions:
        if entry:
            p["logits"][pos][3] = value
        else:
            p["logits"][pos] = value
        p["loss_mask"][pos] = in_loss
    return p


def _leaf(d, dev, dtype):
    return d["logits"].to(dev, dtype).clone().requires_grad_(True)


def _loss_and_grad(path, d, x, **opts):
    """rapo_loss on `path` with logits leaf x (inplace: its non-leaf copy x * 1.0, so that the backward writes the
    gradient over that copy; x.grad is that gradient all the same). Returns (loss, x.grad)."""
    args = {k: v.to(x.device) for k, v in d.items() if k != "logits"}
    if x.dtype == torch.float64:
        args = {k: (v.double() if v.is_floating_point() else v) for k, v in args.items()}
    inplace = path == "inplace"
    loss = rapo_fast.rapo_loss(x * 1.0 if inplace else x, **args, inplace_backward=inplace, **opts)
    loss.backward()
    return loss.detach(), x.grad


@pytest.fixture
def no_policy_op(monkeypatch):
    """The loss must be refused before the policy op (hence before any backward) runs."""

    def boom(*a, **k):
        raise AssertionError("the policy op ran: the logits rows were not checked first")

    monkeypatch.setattr(loss_mod, "policy_loss_op", boom)
    monkeypatch.setattr(loss_mod, "torch_policy_loss", boom)


@pytest.mark.parametrize("flat", [False, True], ids=["padded", "flat"])
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("path", PATHS)
def test_bad_row_in_the_loss_is_refused(path, poison, flat, monkeypatch, no_policy_op):
    dev, dtype = _setup(path, monkeypatch)
    d = _batch(flat)
    positions = [(7,), (3,)] if flat else [(1, 2), (0, 4)]
    p = _poison(d, positions, poison, in_loss=True)
    value = POISONS[poison][0]
    rmax = {"nan": "nan", "inf": "inf", "-inf": "-inf"}[str(value)]
    first = r"\(3,\)" if flat else r"\(0, 4\)"
    x = _leaf(p, dev, dtype)
    with pytest.raises(ValueError, match=MESSAGE.format(n=2, first=first, rmax=rmax)):
        _loss_and_grad(path, p, x)
    assert x.grad is None


@pytest.mark.parametrize("path", PATHS)
def test_overflow_at_the_temperature_is_refused(path, monkeypatch, no_policy_op):
    """Finite logits whose row overflows fp32 once divided by the temperature have no finite lse either (their loss
    would be NaN): refused too; the same row at temperature 1 is fine up to the policy op. fp64 does not overflow."""
    dev, dtype = _setup(path, monkeypatch)
    d = _batch(False)
    d["logits"][1, 3] = 3e38
    if dtype == torch.float64:
        with pytest.raises(AssertionError, match="the policy op ran"):
            _loss_and_grad(path, d, _leaf(d, dev, dtype), temperature=0.5)
        return
    with pytest.raises(ValueError, match=MESSAGE.format(n=1, first=r"\(1, 3\)", rmax=r"3\.\d+e\+38: .*overflow")):
        _loss_and_grad(path, d, _leaf(d, dev, dtype), temperature=0.5)
    with pytest.raises(AssertionError, match="the policy op ran"):
        _loss_and_grad(path, d, _leaf(d, dev, dtype), temperature=1.0)


def _rows_of_every_kind():
    """Logits rows of every kind, and targets that hit a -inf entry of a finite row (logp -inf, lse finite)."""
    z = torch.randn(9, 37)
    z[0], z[1, 3] = float("nan"), float("nan")
    z[2], z[3, 5] = float("inf"), float("inf")
    z[4] = float("-inf")
    z[5, :] = float("-inf")
    z[5, 2] = 0.5
    z[6] = 3e38  # finite; overflows at temperature 0.5
    z[7, 10:] = float("-inf")
    y = torch.tensor([1, 1, 1, 5, 1, 4, 1, 20, 0])
    return z, y


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logp_is_nan_exactly_where_the_lse_is_not_finite(temperature):
    """The invariant check_logits_rows_defined rests on: logp is NaN exactly on the rows whose lse is not finite, in
    the kernel (its own (m, log s) output, lse = m + log s) and in the reference (the lse of logits / temperature);
    -inf logp of a finite row is not NaN."""
    z, y = _rows_of_every_kind()
    ref = token_logprobs_ref(z, y, temperature)
    bad = ~torch.isfinite(torch.logsumexp(z / temperature, -1))
    assert torch.equal(torch.isnan(ref), bad) and bool(bad[:5].all()) and not bool(bad[[5, 7, 8]].any())
    assert bool(bad[6]) == (temperature != 1.0)
    if use_triton(TRITON_DEVICE):
        logp, stats, _ = torch.ops.rapo_fast.token_logprobs_fwd(
            z.to(TRITON_DEVICE), y.to(TRITON_DEVICE), temperature, False
        )
        # stats = (row max m, log s): the row's lse = m + log s is finite exactly when both are
        assert torch.equal(torch.isnan(logp).cpu(), (~torch.isfinite(stats).all(0)).cpu())
        assert torch.equal(torch.isnan(logp).cpu(), bad)


class _LogitsOps(TorchDispatchMode):
    """Records every aten / custom op called on a tensor that shares the logits' storage (the logits or a view of
    them): (op, is a view op, elements of that tensor). A custom op counts as one op: the mode is off while it runs,
    so the ops inside its implementation are not seen."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.ptr = logits.untyped_storage().data_ptr()
        self.ops: list[tuple[str, bool, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        for t in flat:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.ptr:
                self.ops.append((str(func), bool(getattr(func, "is_view", False)), t.numel()))
        return func(*args, **(kwargs or {}))

    def reads(self) -> list[tuple[str, int]]:
        return [(name, n) for name, view, n in self.ops if not view]


def test_the_spy_sees_a_read_of_the_logits():
    z = torch.randn(6, 37)
    with _LogitsOps(z) as spy:  # a pre-launch check would read them so: a row max, then isfinite on [N]
        z.detach().amax(-1)
    assert spy.reads() == [("aten.amax.default", z.numel())]


# the one read of the logits the forward may make: the Triton op, or the reference's first (elementwise) op
FORWARD_READS = {
    "triton": {"rapo_fast.token_logprobs_fwd.default"},
    "inplace": {"rapo_fast.token_logprobs_fwd.default"},
    "fallback": {"aten.div.Tensor", "aten._to_copy.default"},
    "fp64": {"aten.div.Tensor", "aten._to_copy.default"},
}


READ_CASES = [(p, t) for p in PATHS if p != "fp64" for t in (torch.float32, torch.bfloat16)] + [("fp64", None)]


@pytest.mark.parametrize("path, dtype", READ_CASES, ids=[f"{p}-{str(t).replace('torch.', '')}" for p, t in READ_CASES])
def test_forward_reads_the_logits_once(path, dtype, monkeypatch):
    """rapo_loss's forward (validation, log-probs, row check, policy op) reads the [N, V] logits exactly once, in the
    log-prob pass: the elements read by every non-view op on the logits' storage add up to N x V, and each of those
    ops is the log-prob pass's own (no amax / max / isfinite / any over the vocabulary besides it)."""
    dev, cd = _setup(path, monkeypatch)
    d = _batch(False)
    d["loss_mask"][0, 1:3] = False
    d["logits"][0, 2] = float("nan")  # a masked poisoned row: let through by the check, which never reads it
    x = _leaf(d, dev, dtype or cd)
    zin = x * 1.0 if path == "inplace" else x  # inplace: a non-leaf, so that the option takes effect
    args = {k: v.to(dev) for k, v in d.items() if k != "logits"}
    if x.dtype == torch.float64:
        args = {k: (v.double() if v.is_floating_point() else v) for k, v in args.items()}
    with _LogitsOps(zin) as spy:
        loss = rapo_fast.rapo_loss(zin, **args, entropy_coef=0.01, inplace_backward=path == "inplace")
    reads = spy.reads()
    assert sum(n for _, n in reads) == zin.numel(), f"not exactly one pass over the logits: {reads}"
    assert {name for name, _ in reads} <= FORWARD_READS[path], f"a read of the logits besides the forward's: {reads}"
    if path in ("triton", "inplace"):
        assert reads == [("rapo_fast.token_logprobs_fwd.default", zin.numel())]
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and bool((x.grad[0, 2] == 0).all())
