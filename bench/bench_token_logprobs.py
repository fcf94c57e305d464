"""Time and peak memory of rapo_fast.token_logprobs on its own (forward, and forward+backward) against plain torch.

Providers, side by side in one run at each shape, each timed in two modes: `fwd` (under torch.no_grad, as when a
trainer computes old or reference log-probs) and `fwd+bwd` (gradients enabled, backward with a fixed random upstream
gradient dL/dlogp, as in the policy update):
- `torch_eager_logits`: log_softmax(logits.float()).gather(targets), the logits given ([N, V] leaf tensor).
- `rapo_fast_logits`: token_logprobs(logits, targets=...), the same logits.
- `torch_eager_hidden`: logits = hidden @ weight.T materialised in the input dtype, then as torch_eager_logits.
- `torch_chunked_hidden`: -torch.nn.functional.linear_cross_entropy(..., reduction="none", options=
  torch.nn.LinearCrossEntropyOptions(batch_chunk_size=256)), torch's own chunked path that never holds [N, V] (torch
  >= 2.13; skipped with a printed note where torch lacks it). 256 rows, not torch's default chunking, which gives 16
  rows for fp32 on the CPU at N=2048, V=32768 and runs about 3x slower.
- `rapo_fast_hidden`: token_logprobs(hidden=, weight=, targets=...), never an [N, V] tensor.
Which path ours took is in the `path` column: Triton kernels on CUDA; on the CPU, from hidden states without entropy,
torch's chunked F.linear_cross_entropy with our chunk size (rapo_fast/loss/torch_linear_ce.py), else the chunked
reference fallback (row chunks of a 64 MiB budget, each under torch.utils.checkpoint when a gradient is needed),
because Triton runs on CPU
tensors only in its interpreter (TRITON_INTERPRET=1, for tests; this bench switches Triton off on the CPU rather than
time the interpreter). Liger's fused linear cross-entropy is not a provider: it is a loss whose backward assumes a
scalar upstream gradient, not a per-token op (bench/bench_loss.py compares against Liger's GRPO loss).

Every provider's log-probs (and, in fwd+bwd, its input gradients) are compared with the eager provider of the same
input; one that disagrees is marked DISAGREES and the run exits 1, so a broken provider cannot post a fast time.
Usage: `rapo-fast bench logprobs [--quick] [--gpu] [--dtype D] [--plot] [--out DIR | --record]`. Rows (with device,
date and commit) are appended to <DIR>/token_logprobs.csv, to bench/results/token_logprobs.csv with --record, or to a
new temporary folder. Predictions and readings: bench/NOTES_token_logprobs.md.
What this is not: a correctness test (tests/loss/test_logprobs*.py), nor the policy loss (bench/bench_loss.py).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from _common import (
    add_grid_args,
    add_output_args,
    append_rows,
    commit,
    device_name,
    measure_copy_bandwidth_gbs,
    now,
    output_dir,
    peak_memory_mb,
    time_fn,
)

GRID_GPU = [(n, 4096, v) for n in (4096, 16384) for v in (32768, 152064)]
GRID_CPU = [(512, 256, 8192), (1024, 256, 32768)]
GRID_CPU_QUICK = [(64, 32, 500), (96, 48, 1031)]
MODES = ("fwd", "fwd+bwd")
MIN_SAMPLES = 5  # CPU: timed blocks per provider and mode at least (slow providers get exactly this many)


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """hidden [N, H], weight [V, H] (scaled so logits have O(1) spread), their logits [N, V], targets, upstream grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) / math.sqrt(h)).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * 2.0).to(device=device, dtype=dtype)
    return {
        "hidden": hidden,
        "weight": weight,
        "logits": (hidden @ weight.T).contiguous(),
        "targets": torch.randint(0, v, (n,), generator=g).to(device),
        "grad_logp": torch.randn(n, generator=g).to(device),
    }


def _eager_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _providers(device: torch.device) -> dict[str, tuple[str, str, Callable]]:
    """name -> (input kind "logits" | "hidden", path taken, fn(tensors) -> logp [N] fp32)."""
    from rapo_fast import token_logprobs
    from rapo_fast._dispatch import use_triton

    ours_path = "triton" if use_triton(device) else "chunked reference fallback (no Triton on this device)"
    provs: dict[str, tuple[str, str, Callable]] = {
        "torch_eager_logits": ("logits", "eager", lambda t: _eager_logp(t["logits"], t["targets"])),
        "rapo_fast_logits": ("logits", ours_path, lambda t: token_logprobs(t["logits"], targets=t["targets"])),
        "torch_eager_hidden": ("hidden", "eager", lambda t: _eager_logp(t["hidden"] @ t["weight"].T, t["targets"])),
    }
    lce = getattr(torch.nn.functional, "linear_cross_entropy", None)
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if lce is not None and options is not None:

        def chunked(t):
            opts = options(batch_chunk_size=256, chunking_method=None)
            return -lce(t["hidden"], t["weight"], t["targets"], reduction="none", options=opts)

        provs["torch_chunked_hidden"] = ("hidden", "torch chunked (F.linear_cross_entropy)", chunked)
    else:
        print(f"torch_chunked_hidden: unavailable (torch {torch.__version__} has no F.linear_cross_entropy options)")
    from rapo_fast.loss.torch_linear_ce import torch_linear_ce_available

    hidden_path = ours_path
    if not use_triton(device) and torch_linear_ce_available():
        hidden_path = "torch chunked linear CE (rapo_fast/loss/torch_linear_ce.py)"
    provs["rapo_fast_hidden"] = (
        "hidden",
        hidden_path,
        lambda t: token_logprobs(hidden=t["hidden"], weight=t["weight"], targets=t["targets"]),
    )
    return provs


def _step_fn(fn: Callable, leaves: dict, rest: dict, mode: str) -> Callable[[], torch.Tensor]:
    """One timed call: the forward under no_grad, or forward + backward of sum(logp * grad_logp) into `leaves`."""
    tensors = {**rest, **leaves}

    def fwd():
        with torch.no_grad():
            return fn(tensors)

    def fwd_bwd():
        for x in leaves.values():
            x.grad = None
        logp = fn(tensors)
        (logp * rest["grad_logp"]).sum().backward()
        return logp

    return fwd if mode == "fwd" else fwd_bwd


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(max |logp - ref|, relative norm of the gradient error) allowed: loose, only to catch a broken provider."""
    return (2e-3, 1e-3) if dtype == torch.float32 else (0.15, 3e-2)


def _rel_err(got: torch.Tensor, ref: torch.Tensor, rows: int = 1024) -> float:
    """|got - ref| / |ref| (Frobenius), in fp32 over row blocks: no fp32 copy of a whole [N, V] gradient."""
    num = den = 0.0
    for r0 in range(0, ref.shape[0], rows):
        g, r = got[r0 : r0 + rows].float(), ref[r0 : r0 + rows].float()
        num += float((g - r).square().sum())
        den += float(r.square().sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def _check(logp, grads: dict, ref: dict | None, dtype: torch.dtype) -> tuple[dict, str]:
    """Compare with the eager provider of the same input kind (ref None: no reference ran)."""
    if ref is None:
        return {"max_abs_diff_logp": "", "grad_rel_err": ""}, "ok (unchecked: the eager reference did not run)"
    tol_logp, tol_grad = _tolerances(dtype)
    diff = float((logp.float() - ref["logp"]).abs().max()) if logp.numel() else 0.0
    gerr = max((_rel_err(g, ref["grads"][k]) for k, g in grads.items()), default=0.0)
    out = {"max_abs_diff_logp": round(diff, 7), "grad_rel_err": round(gerr, 7) if grads else ""}
    if diff > tol_logp or gerr > tol_grad:
        return out, f"DISAGREES: max|dlogp| {diff:.3g} (tol {tol_logp}), grad rel err {gerr:.3g} (tol {tol_grad})"
    return out, "ok"


def _bytes_moved(n: int, v: int, dtype: torch.dtype, mode: str) -> int:
    """The least a logits-path op moves: read [N, V] once (fwd), or read it twice and write its gradient (fwd+bwd)."""
    esize = torch.empty((), dtype=dtype).element_size()
    return n * v * esize * (1 if mode == "fwd" else 3)


def _measure(name, kind, path, fn, t, mode, refs, dtype, device, reps_ms) -> dict:
    """Run one provider in one mode: check it against the eager provider of its input kind, then time it."""
    names = ("logits",) if kind == "logits" else ("hidden", "weight")
    leaves = {k: t[k].detach().requires_grad_(mode == "fwd+bwd") for k in names}
    rest = {k: x for k, x in t.items() if k not in leaves}
    step = _step_fn(fn, leaves, rest, mode)
    with warnings.catch_warnings(record=True) as caught:  # a provider falling back to another path says so
        warnings.simplefilter("always")
        logp = step().detach()
    grads = {k: x.grad.detach() for k, x in leaves.items() if x.grad is not None}
    if name.startswith("torch_eager"):  # the reference of its input kind: the providers after it are checked on it
        refs[(kind, mode)] = {"logp": logp.float(), "grads": {k: g.clone() for k, g in grads.items()}}
    extra, status = _check(logp, grads, refs.get((kind, mode)), dtype)
    tm = time_fn(step, device, rep_ms=reps_ms, min_runs=MIN_SAMPLES)
    row = {
        "provider": name,
        "input": kind,
        "mode": mode,
        "path": path,
        "median_ms": round(tm["median_ms"], 4),
        "p20_ms": round(tm["p20_ms"], 4),
        "p80_ms": round(tm["p80_ms"], 4),
        "samples": tm.get("samples", ""),
        "peak_mem_mb": round(peak_memory_mb(step, device), 1),
        **extra,
        "status": status,
    }
    if caught:
        row["warnings"] = "; ".join(sorted({str(w.message)[:120] for w in caught}))
    return row


def _row(name, kind, path, fn, t, mode, refs, dtype, device, reps_ms, bw) -> dict:
    """One CSV row: the shape, the measurement (or the error), and for the logits inputs the bandwidth reached."""
    n, h = t["hidden"].shape
    v = t["weight"].shape[0]
    shape = {"N": n, "H": h, "V": v, "dtype": str(dtype).replace("torch.", "")}
    try:
        row = {**shape, **_measure(name, kind, path, fn, t, mode, refs, dtype, device, reps_ms)}
    except Exception as exc:  # say so in the table, never fake a number
        return {**shape, "provider": name, "input": kind, "mode": mode, "status": f"error: {exc!r}"[:200]}
    if kind == "logits":
        gbs = _bytes_moved(n, v, dtype, mode) / (row["median_ms"] * 1e-3) / 1e9
        row.update(achieved_gbs=round(gbs, 2), copy_bw_gbs=round(bw, 2), pct_of_copy_bw=round(100 * gbs / bw, 1))
    return row


def run(
    shapes, dtype: torch.dtype, device: torch.device, out_dir: Path, reps_ms: int, providers: list[str] | None = None
) -> list[dict]:
    rows = []
    bw = measure_copy_bandwidth_gbs(device)
    for n, h, v in shapes:
        t = _inputs(n, h, v, dtype, device)
        refs: dict = {}
        for mode in MODES:
            for name, (kind, path, fn) in _providers(device).items():
                if providers is not None and name not in providers:
                    continue
                row = _row(name, kind, path, fn, t, mode, refs, dtype, device, reps_ms, bw)
                rows.append(row)
                print({k: row.get(k) for k in ("provider", "mode", "N", "V", "median_ms", "peak_mem_mb", "status")})
                gc.collect()
        del t, refs
    meta = {"device": device_name(device), "date": now(), "commit": commit()}
    rows = [{**r, **meta} for r in rows]
    print(f"rows appended to {append_rows('token_logprobs', rows, out_dir)}")
    return rows


def plot(csv_path: Path, png_path: Path) -> Path:
    """Median time and peak memory per provider and mode, for the latest row of each (device, shape, provider)."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest: dict[tuple, dict] = {}
    for r in csv.DictReader(csv_path.open()):
        if r.get("status") == "ok":
            latest[(r["device"], r["dtype"], r["mode"], r["provider"], int(r["N"]), int(r["H"]), int(r["V"]))] = r
    panels = sorted({(k[0], k[1], k[2]) for k in latest})
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.4 * len(panels)), squeeze=False)
    for (dev, dt, mode), row_axes in zip(panels, axes):
        keys = [k for k in latest if k[:3] == (dev, dt, mode)]
        shapes, provs = sorted({k[4:] for k in keys}), sorted({k[3] for k in keys})
        width = 0.8 / max(len(provs), 1)
        for metric, ax in zip(("median_ms", "peak_mem_mb"), row_axes):
            for i, p in enumerate(provs):
                vals = [
                    float(latest[(dev, dt, mode, p, *s)][metric]) if (dev, dt, mode, p, *s) in latest else math.nan
                    for s in shapes
                ]
                ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=p)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
            ax.set_xticklabels([f"N{n} H{h} V{v}" for n, h, v in shapes], fontsize=8)
            ax.set_ylabel(metric)
            ax.set_title(f"token_logprobs {mode}, {dt}: {metric}\n{dev[:60]}", fontsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rapo-fast bench logprobs", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: every provider in both modes at two tiny CPU shapes (seconds; the times mean nothing)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="run on the CUDA device at LLM shapes: N in 4k/16k tokens, H=4096, V in 32k/152k, bf16 "
        "(default: the CPU at N=512/1024, H=256, V=8k/32k, fp32)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="dtype of logits, hidden states and lm_head weight (default bfloat16 with --gpu, float32 on the CPU)",
    )
    p.add_argument(
        "--plot", action="store_true", help="also draw time and memory per provider as token_logprobs.png by the CSV"
    )
    add_grid_args(p, "N,H,V")
    add_output_args(p, "token_logprobs.csv (and token_logprobs.png with --plot)")
    args = p.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        p.error("--gpu: no CUDA device is visible")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = output_dir(args, "logprobs")
    if args.gpu:
        device, shapes, dtype, reps = torch.device("cuda"), GRID_GPU, torch.bfloat16, 300
    else:
        # bf16 matmul on the CPU is emulated and slow: the CPU default is fp32 (numbers are CPU numbers either way)
        device, dtype = torch.device("cpu"), torch.float32
        shapes, reps = (GRID_CPU_QUICK, 20) if args.quick else (GRID_CPU, 500)
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    saved = os.environ.get("RAPO_FAST_DISABLE_TRITON")
    if device.type == "cpu":
        os.environ["RAPO_FAST_DISABLE_TRITON"] = "1"  # time the CPU fallback, not Triton's interpreter
    try:
        rows = run(args.shape or shapes, dtype, device, out, args.rep_ms or reps, args.providers)
    finally:
        if saved is None:
            os.environ.pop("RAPO_FAST_DISABLE_TRITON", None)
        else:
            os.environ["RAPO_FAST_DISABLE_TRITON"] = saved
    if args.plot:
        print(f"plot written to {plot(out / 'token_logprobs.csv', out / 'token_logprobs.png')}")
    bad = [r for r in rows if str(r.get("status", "")).startswith(("DISAGREES", "error"))]
    print(f"bench logprobs: {len(rows)} rows, {len(bad)} disagreeing/erroring, device {device_name(device)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
