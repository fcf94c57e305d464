"""Every Triton launch of the loss part runs under rapo_fast._dispatch.device_guard for its tensors' device: a Triton
launch goes to the current CUDA device, not to its tensors' device, so without the guard a tensor on cuda:1 would be
computed by a launch on cuda:0.

On the CPU (kernels under TRITON_INTERPRET=1) the guard is replaced by a recorder and every kernel by a wrapper that
records, at launch time, which guards are open: each launch of token_logprobs (logits and hidden, forward and
backward), of the two-pass policy loss and of the fused hidden-state loss must happen inside a guard entered with the
device of the launch's tensors. The guard's own CUDA branch is checked by replacing torch.cuda.device. With two or
more GPUs (marked gpu) the same paths run on cuda:1 while cuda:0 is current and are compared with cuda:0's results.
Not here: the numerics of these paths (test_logprobs.py, test_fused_linear_loss.py, test_loss.py).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from helpers.loss_cases import make_batch

import rapo_fast
from rapo_fast import _dispatch
from rapo_fast.loss import logprobs as lp_mod
from rapo_fast.loss import policy_loss as loss_mod
from rapo_fast.loss import policy_op, tiles

LOGPROB_KERNELS = ("token_logprobs_fwd_kernel", "token_logprobs_bwd_kernel")
POLICY_KERNELS = ("policy_loss_fwd_kernel", "policy_loss_bwd_kernel")
# the modules that launch Triton kernels, each of which imports device_guard by name
LAUNCHING_MODULES = (lp_mod, tiles, policy_op)


class _Recorder:
    """Stands in for device_guard (the devices of the guards open now) and wraps each kernel (one row per launch:
    kernel name, the guards open at launch, the devices of the launch's tensor arguments)."""

    def __init__(self):
        self.open: list[torch.device] = []
        self.launches: list[tuple[str, tuple[torch.device, ...], set[torch.device]]] = []

    @contextlib.contextmanager
    def guard(self, x):
        self.open.append(x.device)
        try:
            yield
        finally:
            self.open.pop()

    def wrap(self, kernel, name: str):
        rec = self

        class _Launcher:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def call(*args, **kwargs):
                    devices = {a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
                    rec.launches.append((name, tuple(rec.open), devices))
                    return launch(*args, **kwargs)

                return call

        return _Launcher()

    def module(self, real, names):
        return types.SimpleNamespace(**{n: self.wrap(getattr(real, n), n) for n in names})


@pytest.fixture
def recorder(monkeypatch):
    if not _dispatch.use_triton(torch.device("cpu")):
        pytest.skip("needs Triton under TRITON_INTERPRET=1 on the CPU")
    rec = _Recorder()
    for mod in LAUNCHING_MODULES:
        monkeypatch.setattr(mod, "device_guard", rec.guard)
    lp_kernels = rec.module(tiles.logprob_kernels(), LOGPROB_KERNELS)
    pl_kernels = rec.module(policy_op._kernels(), POLICY_KERNELS)
    monkeypatch.setattr(tiles, "logprob_kernels", lambda: lp_kernels)
    monkeypatch.setattr(policy_op, "_kernels", lambda: pl_kernels)
    return rec


def _assert_guarded(rec: _Recorder, device: torch.device, expected: set[str]) -> None:
    assert rec.launches, "no kernel was launched: the path under test did not run Triton"
    assert {name for name, _, _ in rec.launches} == expected
    for name, open_guards, devices in rec.launches:
        assert open_guards, f"{name} launched outside a device guard"
        assert open_guards[-1] == device, f"{name} launched under a guard for {open_guards[-1]}, inputs on {device}"
        assert devices == {device}, f"{name} launched with tensors on {devices}"
    assert not rec.open  # every guard was left


@pytest.mark.parametrize("with_entropy", [False, True])
def test_token_logprobs_from_logits_is_guarded(recorder, with_entropy):
    logits = torch.randn(2, 5, 37, requires_grad=True)
    targets = torch.randint(0, 37, (2, 5))
    out = rapo_fast.token_logprobs(logits, targets=targets, return_entropy=with_entropy)
    (sum(o.sum() for o in out) if with_entropy else out.sum()).backward()
    assert logits.grad is not None
    _assert_guarded(recorder, logits.device, set(LOGPROB_KERNELS))


def test_token_logprobs_from_hidden_is_guarded(recorder, monkeypatch):
    # several row and vocabulary tiles, so that every tile launch of forward and backward is recorded
    monkeypatch.setitem(tiles.TILE_BYTES, "cpu", 4 * 16 * 4)
    monkeypatch.setitem(tiles.MAX_VOCAB_TILE, "cpu", 16)
    hidden = torch.randn(11, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    logp, ent = rapo_fast.token_logprobs(
        hidden=hidden, weight=weight, bias=bias, targets=torch.randint(0, 40, (11,)), return_entropy=True
    )
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None and bias.grad is not None
    n_tiles = 3 * 3  # ceil(11 / 4) row tiles x ceil(40 / 16) vocabulary tiles
    assert sum(name == "token_logprobs_fwd_kernel" for name, _, _ in recorder.launches) == n_tiles
    assert sum(name == "token_logprobs_bwd_kernel" for name, _, _ in recorder.launches) == n_tiles
    _assert_guarded(recorder, hidden.device, set(LOGPROB_KERNELS))


@pytest.mark.parametrize("hidden", [False, True], ids=["two-pass", "fused-linear"])
def test_policy_loss_is_guarded(recorder, monkeypatch, hidden):
    fused = []
    real = loss_mod._use_fused
    monkeypatch.setattr(loss_mod, "_use_fused", lambda *a: fused.append(real(*a)) or fused[-1])
    d = make_batch(3, 7, 19, H=13 if hidden else None, response=not hidden)
    leaves = [d[k].requires_grad_(True) for k in ("logits", "hidden", "weight", "bias") if k in d]
    rapo_fast.rapo_loss(**d, entropy_coef=0.01).backward()
    assert fused == [hidden], "rapo_loss took the fused path on the logits or not on the hidden state"
    assert all(t.grad is not None for t in leaves)
    _assert_guarded(recorder, leaves[0].device, set(LOGPROB_KERNELS + POLICY_KERNELS))


def test_guard_enters_the_tensors_cuda_device(monkeypatch):
    entered = []

    class _FakeCudaDevice(contextlib.nullcontext):
        def __init__(self, device):
            super().__init__()
            entered.append(device)

    monkeypatch.setattr(torch.cuda, "device", _FakeCudaDevice)
    with _dispatch.device_guard(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]
    with _dispatch.device_guard(torch.zeros(2)), _dispatch.device_guard(torch.device("meta")):
        pass
    assert entered == [torch.device("cuda", 1)]  # nothing entered for CPU or meta


def _run_paths(device: torch.device) -> list[torch.Tensor]:
    """token_logprobs (logits, hidden) and rapo_loss (two-pass, fused) forward and backward on `device`."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g).to(device).requires_grad_(True)
    targets = torch.randint(0, 50, (6,), generator=g).to(device)
    lp, ent = rapo_fast.token_logprobs(logits, targets=targets, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    hidden = torch.randn(6, 16, generator=g).to(device).requires_grad_(True)
    weight = torch.randn(50, 16, generator=g).to(device).requires_grad_(True)
    lp_h = rapo_fast.token_logprobs(hidden=hidden, weight=weight, targets=targets)
    lp_h.sum().backward()
    outs = [lp, ent, logits.grad, lp_h, hidden.grad, weight.grad]
    for h in (None, 13):
        d = {k: v.to(device) for k, v in make_batch(3, 7, 19, H=h).items()}
        leaves = [d[k].requires_grad_(True) for k in ("logits", "hidden", "weight") if k in d]
        loss = rapo_fast.rapo_loss(**d, entropy_coef=0.01)
        outs += [loss, *torch.autograd.grad(loss, leaves)]
    return outs


@pytest.mark.gpu
def test_launches_follow_the_tensors_device_not_the_current_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(0)
    expected = _run_paths(torch.device("cuda", 0))
    got = _run_paths(torch.device("cuda", 1))
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0  # the guards restored the current device
    for e, x in zip(expected, got, strict=True):
        assert x.device == torch.device("cuda", 1)
        torch.testing.assert_close(x.cpu(), e.cpu(), atol=1e-5, rtol=1e-5)
