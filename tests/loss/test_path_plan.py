"""The named log-prob / loss paths (rapo_fast/loss/path_plan.py): for every path, inputs on which backend="auto" takes
it, with the path reported by rapo_loss's metrics.path / token_logprobs(return_path=True) / the "rapo_fast"
logger; explicit backends; the environment switches that steer "auto" only; the refusals (ValueError naming backend,
its value and why) of a backend that cannot run on the inputs. Under TRITON_INTERPRET=1 the Triton paths run on the CPU.
Not here: each path's numerics (test_logprobs*.py, test_loss.py, test_fused_linear_loss.py, ...).
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.loss_cases import make_batch

import rapo_fast
from rapo_fast import _dispatch
from rapo_fast.loss.path_plan import BACKENDS, Path, plan_path
from rapo_fast.loss.policy_loss import policy_loss_from_logp
from rapo_fast.loss.torch_linear_ce import torch_linear_ce_available

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not _dispatch.use_triton(DEV), reason="no Triton here (CUDA or TRITON_INTERPRET=1)")
needs_lce = pytest.mark.skipif(not torch_linear_ce_available(), reason="torch has no chunked F.linear_cross_entropy")


def _batch(hidden=False, grad=True, dtype=torch.float32):
    d = {k: v.to(DEV) for k, v in make_batch(2, 3, 7, H=5 if hidden else None).items()}
    for k in ("logits", "hidden", "weight", "bias"):
        if k in d:
            d[k] = d[k].to(dtype).requires_grad_(grad)
    if dtype == torch.float64:
        d = {k: (v.double() if v.is_floating_point() else v) for k, v in d.items()}
    return d


def _loss_path(d, **kw):
    loss, m = rapo_fast.rapo_loss(**d, return_metrics=True, **kw)
    assert torch.isfinite(loss)
    assert isinstance(m.path, str) and all(torch.is_tensor(v) for v in m.scalars().values())
    return m.path


def _lp_path(d, **kw):
    x = {"hidden": d["hidden"], "weight": d["weight"], "bias": d["bias"]} if "hidden" in d else {"logits": d["logits"]}
    *out, path = rapo_fast.token_logprobs(**x, targets=d["targets"], return_path=True, **kw)
    assert len(out) == (2 if kw.get("return_entropy") else 1) and out[0].shape == d["targets"].shape
    return path


def _no_triton(mp):
    mp.setenv("RAPO_FAST_DISABLE_TRITON", "1")


def _loss_logged_path(caplog, d, **kw):
    """rapo_loss without metrics (so no entropy is asked for): the path from the debug line."""
    with caplog.at_level(logging.DEBUG, logger="rapo_fast"):
        caplog.clear()
        rapo_fast.rapo_loss(**d, **kw)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rapo_loss: path ")]
    assert len(lines) == 1, lines
    return lines[0].split()[2]


# For each path: how "auto" gets there, and the path the call reports.
def _auto_cases(mp, caplog):
    lp, f64 = policy_loss_from_logp, torch.float64
    kw = lambda d: {k: d[k] for k in ("old_logp", "advantages", "loss_mask", "retrieved_mask")}  # noqa: E731
    logp = lambda d: torch.log_softmax(d["logits"].detach(), -1).gather(-1, d["targets"][..., None])[..., 0]  # noqa
    return {
        Path.TRITON_LOGITS: (True, lambda: _loss_path(_batch())),
        Path.TRITON_LINEAR: (True, lambda: _loss_path(_batch(hidden=True), importance_sampling_level="sequence")),
        Path.TRITON_FUSED_LINEAR: (True, lambda: _loss_path(_batch(hidden=True))),
        Path.TRITON_POLICY: (True, lambda: lp(logp(d := _batch()), **kw(d), return_metrics=True)[1].path),
        Path.TORCH_LINEAR_CE: (False, lambda: _no_triton(mp) or _loss_logged_path(caplog, _batch(hidden=True))),
        Path.REFERENCE_CHUNKED: (False, lambda: _no_triton(mp) or _loss_path(_batch())),
        Path.REFERENCE_FP64: (False, lambda: _loss_path(_batch(dtype=f64))),
        Path.TORCH_POLICY: (False, lambda: lp(logp(d := _batch(dtype=f64)), **kw(d), return_metrics=True)[1].path),
    }


def test_every_path_has_a_case(monkeypatch, caplog):
    assert set(_auto_cases(monkeypatch, caplog)) == set(Path)


@pytest.mark.parametrize("path", list(Path), ids=[p.value for p in Path])
def test_auto_takes_and_reports_each_path(path, monkeypatch, caplog):
    triton, case = _auto_cases(monkeypatch, caplog)[path]
    if triton and not _dispatch.use_triton(DEV):
        pytest.skip("no Triton here")
    if path is Path.TORCH_LINEAR_CE and not torch_linear_ce_available():
        pytest.skip("torch has no chunked F.linear_cross_entropy")
    assert case() == path.value


@needs_triton
def test_token_logprobs_auto_paths():
    assert _lp_path(_batch()) == "triton_logits"
    assert _lp_path(_batch(), return_entropy=True) == "triton_logits"
    assert _lp_path(_batch(hidden=True)) == "triton_linear"
    assert _lp_path(_batch(hidden=True), return_entropy=True) == "triton_linear"
    # the paths of rapo_loss that are not a log-prob path of their own: no gradient, or the fused switch off
    with torch.no_grad():
        assert _loss_path(_batch(hidden=True)) == "triton_linear"


@needs_lce
def test_token_logprobs_torch_paths(monkeypatch):
    _no_triton(monkeypatch)
    assert _lp_path(_batch(hidden=True)) == "torch_linear_ce"
    assert _lp_path(_batch(hidden=True), return_entropy=True) == "reference_chunked"
    assert _lp_path(_batch()) == "reference_chunked"
    assert _lp_path(_batch(hidden=True), backend="reference") == "reference_chunked"
    # a row torch's linear CE cannot serve exactly (NaN hidden): handed to the reference, and reported so
    d = _batch(hidden=True, grad=False)
    d["hidden"][0, 1] = float("nan")
    assert _lp_path(d) == "reference_chunked"


@needs_triton
def test_fused_switch_steers_auto_only(monkeypatch):
    monkeypatch.setenv("RAPO_FAST_FUSED_LINEAR_LOSS", "0")
    assert _loss_path(_batch(hidden=True)) == "triton_linear"
    assert _loss_path(_batch(hidden=True), backend="triton") == "triton_fused_linear"


@needs_triton
def test_explicit_backends_on_a_triton_device():
    d = _batch()
    ref, _ = rapo_fast.rapo_loss(**d, return_metrics=True, backend="reference")
    for backend, want in [
        ("triton", "triton_logits"),
        ("torch", "reference_chunked"),
        ("reference", "reference_chunked"),
    ]:
        loss, m = rapo_fast.rapo_loss(**d, return_metrics=True, backend=backend)
        assert m.path == want
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    h = _batch(hidden=True)
    assert _loss_path(h, backend="triton") == "triton_fused_linear"
    assert _loss_path(h, backend="triton", importance_sampling_level="sequence") == "triton_linear"
    assert _loss_path(h, backend="torch") == "reference_chunked"  # metrics ask for entropy: not torch's linear CE
    assert _lp_path(_batch(), backend="triton") == "triton_logits"
    assert _lp_path(h, backend="torch", return_entropy=True) == "reference_chunked"
    assert rapo_fast.RAPOLoss(return_metrics=True)(**d, backend="torch")[1].path == "reference_chunked"


@needs_lce
def test_explicit_torch_takes_torch_linear_ce(caplog):
    h = _batch(hidden=True)
    assert _lp_path(h, backend="torch") == "torch_linear_ce"
    assert _loss_logged_path(caplog, h, backend="torch") == "torch_linear_ce"
    assert _loss_logged_path(caplog, h, backend="reference") == "reference_chunked"


def test_float64_paths():
    d = _batch(dtype=torch.float64)
    for backend in ("auto", "torch", "reference"):
        assert _loss_path(d, backend=backend) == "reference_fp64"
    with pytest.raises(
        ValueError, match=r"backend: expected a backend that can run on these inputs, got 'triton': float64"
    ):
        rapo_fast.rapo_loss(**d, backend="triton")


def test_triton_refused_where_it_cannot_run(monkeypatch):
    cpu = {k: v.cpu() for k, v in make_batch(2, 3, 7).items()}
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors outside the interpreter
    with pytest.raises(
        ValueError,
        match=r"backend: expected a backend that can run on these inputs, got 'triton': .*TRITON_INTERPRET=1",
    ):
        rapo_fast.rapo_loss(**cpu, backend="triton")
    with pytest.raises(ValueError, match=r"backend: expected .*, got 'triton': .*TRITON_INTERPRET=1"):
        rapo_fast.token_logprobs(cpu["logits"], targets=cpu["targets"], backend="triton")
    assert _loss_path(cpu) == "reference_chunked"  # auto falls back, and says so
    assert _lp_path(cpu) == "reference_chunked"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    with pytest.raises(ValueError, match=r"backend: expected .*, got 'triton': .*RAPO_FAST_DISABLE_TRITON=1"):
        rapo_fast.rapo_loss(**_batch(), backend="triton")
    d = _batch()
    logp = torch.log_softmax(d["logits"].detach(), -1).gather(-1, d["targets"][..., None])[..., 0]
    with pytest.raises(ValueError, match=r"backend: expected .*, got 'triton'"):
        policy_loss_from_logp(
            logp, old_logp=d["old_logp"], advantages=d["advantages"], loss_mask=d["loss_mask"], backend="triton"
        )


@pytest.mark.parametrize("bad,exc", [("cuda", ValueError), ("Triton", ValueError), (1, TypeError), (None, TypeError)])
def test_unknown_backend_is_refused_by_name(bad, exc):
    d = make_batch(2, 3, 7)
    with pytest.raises(exc, match=r"backend: expected one of \['auto', 'triton', 'torch', 'reference'\]"):
        rapo_fast.rapo_loss(**d, backend=bad)
    with pytest.raises(exc, match="backend"):
        rapo_fast.token_logprobs(d["logits"], targets=d["targets"], backend=bad)
    with pytest.raises(TypeError, match="return_path: expected a bool"):
        rapo_fast.token_logprobs(d["logits"], targets=d["targets"], return_path=1)


def test_plan_gives_a_reason_and_the_family():
    plan = plan_path("rapo_loss", "reference", device=torch.device("cpu"), dtype=torch.float32, hidden=True)
    assert plan.path is Path.REFERENCE_CHUNKED and plan.backend == "reference" and "reference" in plan.reason
    assert BACKENDS == ("auto", "triton", "torch", "reference")
    assert all(p.triton == p.value.startswith("triton") for p in Path)


@needs_triton
def test_debug_line_names_the_path(caplog):
    with caplog.at_level(logging.DEBUG, logger="rapo_fast"):
        rapo_fast.rapo_loss(**_batch(hidden=True), importance_sampling_level="sequence")
    msgs = [r.getMessage() for r in caplog.records if r.name == "rapo_fast"]
    assert any(m.startswith("rapo_loss: path triton_linear (") and "GSPO" in m for m in msgs), msgs
    assert not any(m.startswith("token_logprobs:") for m in msgs), msgs  # one front desk: rapo_loss's line only
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="rapo_fast"):
        d = _batch(hidden=True)
        rapo_fast.token_logprobs(hidden=d["hidden"], weight=d["weight"], targets=d["targets"])
    msgs = [r.getMessage() for r in caplog.records if r.name == "rapo_fast"]
    assert any(m.startswith("token_logprobs: path triton_linear (") for m in msgs), msgs
