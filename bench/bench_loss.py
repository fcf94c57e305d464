"""Forward+backward time and peak memory of the fused policy loss (rapo_loss) against what a trainer does without it.

Providers, side by side in one run at each shape:
- `rapo_fast_hidden`: rapo_loss(hidden=, weight=) — chunked, never an [N, V] tensor; on Triton devices the one-pass
  fused variant (gradients formed in the forward, 3 GEMM families).
- `rapo_fast_hidden_2pass`: the same with RAPO_FAST_FUSED_LINEAR_LOSS=0 (backward recomputes the logits: 4 GEMMs).
- `rapo_fast_logits`: rapo_loss(logits=) — the logits path; its bytes (logits read twice, grad written once) are
  compared with the measured copy bandwidth.
- `rapo_fast_logits_lmhead` / `rapo_fast_logits_lmhead_inplace`: logits = hidden @ W^T formed inside the timed call
  (as a trainer does), then rapo_loss(logits=) with inplace_backward False / True: the in-place option writes the
  logits gradient over the logits and saves one [N, V] buffer (it has no effect on a leaf, hence not the provider
  above).
- `torch_eager`: what a trainer does without us: logits = hidden @ W^T materialised, fp32 log-softmax, gather,
  clipped surrogate (rapo_fast.reference), token-mean.
- `torch_compile`: the same function under torch.compile.
- `torch_linear_ce`: the same loss with the log-probs from torch's own chunked op, -F.linear_cross_entropy(hidden, W,
  targets, reduction="none", options=LinearCrossEntropyOptions(batch_chunk_size=256)) (torch >= 2.13): what a
  trainer gets from PyTorch core without [N, V] logits. (torch's default chunking for fp32 on the CPU gives 16-row
  chunks and runs about 3x slower; 256 rows is the tuned anchor.)
- `liger`: Liger-Kernel's LigerFusedLinearGRPOLoss (when liger_kernel is importable; compiled on CUDA).
- `cce`: Apple's Cut Cross-Entropy: log-probs = -linear_cross_entropy(hidden, W, targets, reduction="none"), then the
  same clipped surrogate, backward through CCE (CUDA only: its kernels are Triton on CUDA tensors).
The providers themselves live in bench/_loss_providers.py. Every provider's loss is checked against `ref_loss`,
computed once per shape, untimed, in fp32 from row chunks of the logits (bench/_reference.py), whatever the order.
Rows, errors, `--plan`, `--out`/`--record` and the plot (bench/plot_loss.py): as every bench (bench/_common.py); CSV
loss.csv. `--quick` skips the torch.compile providers (`torch_compile`; Liger on CUDA) unless --providers names them:
their row says "skipped: ...". Readings in bench/NOTES_loss.md.
What this is not: a correctness test (tests/loss/ does that); it only checks that providers agree to a loose
tolerance so that a broken provider cannot post a fast time.
"""

from __future__ import annotations

import argparse
import math

import _loss_providers as lp
import torch
from plot_loss import plot

from _args import add_bench_args, add_dtype_arg, add_grid_args, check_providers, grid_of, ordered
from _common import (
    RowWriter,
    Unavailable,
    error_status,
    exit_process,
    free_device_memory,
    measure_copy_bandwidth_gbs,
    peak_memory_mb,
    run_bench,
    time_fn,
)

GRID_GPU = [(n, 4096, v) for n in (4096, 16384, 65536) for v in (32768, 152064)]
GRID_CPU_QUICK = [(256, 128, 1000), (512, 96, 4099)]
GRID_CPU = [(1024, 256, 8192), (2048, 512, 32768)]
COLUMNS = ["dtype", "median_ms", "p20_ms", "p80_ms", "peak_mem_mb", "loss", "ref_loss"]
COLUMNS += ["achieved_gbs", "copy_bw_gbs", "pct_of_copy_bw"]
ECHO = ("provider", "N", "H", "V", "median_ms", "peak_mem_mb", "status")
QUICK_MIN_RUNS = 3  # --quick: timed blocks per provider (5 otherwise)
SKIP_COMPILED = "skipped: torch.compile is not run in a --quick smoke run (name it in --providers to run it)"


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """N tokens as B sequences of T = min(512, N) (a GRPO batch; one sequence of N when 512 does not divide N):
    hidden [B, T, H], per-sequence advantages [B]. Made on the device by its own generator (deterministic per seed
    and device): a 152k x 4096 weight made on the CPU and copied took ~5 s."""
    t = min(512, n) if n % min(512, n) == 0 else n
    b = n // t
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, device=device, dtype=dtype).div_(math.sqrt(h))
    weight = torch.randn(v, h, generator=g, device=device, dtype=dtype).mul_(0.5)
    targets = torch.randint(0, v, (b, t), generator=g, device=device)
    old_logp = torch.rand(b, t, generator=g, device=device).mul_(-8)
    adv = torch.randn(b, generator=g, device=device)
    mask = torch.rand(b, t, generator=g, device=device) > 0.1
    return hidden, weight, targets, old_logp, adv, mask


def _too_big(name: str, n: int, v: int, device: torch.device) -> bool:
    """The eager providers hold [N, V] fp32 logits plus their grad: skipped where that cannot fit."""
    if name not in lp.EAGER_LOGITS or device.type != "cuda":
        return False
    return n * v * 4 * 3 > 0.8 * torch.cuda.get_device_properties(device).total_memory


def _measure(name: str, fn, inputs, ref: float | None, row: dict, device, opts: dict, bw: dict) -> dict:
    """Check one provider against the reference, time it, read its peak memory: the row, with what was measured
    before an error kept beside the error's status."""
    hidden, weight, *rest = inputs
    n, v = hidden.numel() // hidden.shape[-1], weight.shape[0]
    hh = hidden.detach().requires_grad_(True)
    ww = weight.detach().requires_grad_(True)

    def step():
        hh.grad = None
        ww.grad = None
        loss = fn(hh, ww, *rest)
        loss.backward()
        return loss

    phase = "first call"
    try:
        loss = float(step().detach())
        row["loss"] = loss
        if ref is None:
            status = "ok (unchecked: the reference failed)"
        elif abs(loss - ref) <= 5e-2 * max(1.0, abs(ref)):
            status = "ok"
        else:
            status = f"DISAGREES: loss {loss:.5g} vs reference {ref:.5g}"
        phase = "timing"
        t = time_fn(step, device, rep_ms=opts["reps_ms"], min_runs=opts.get("min_runs", 5))
        row.update({k: round(t[k], 4) for k in ("median_ms", "p20_ms", "p80_ms")})
        phase = "peak memory"
        row["peak_mem_mb"] = round(peak_memory_mb(step, device), 1)
        if name == "rapo_fast_logits":
            phase = "copy bandwidth"
            if "gbs" not in bw:
                bw["gbs"] = measure_copy_bandwidth_gbs(device)
            esize = hidden.element_size()
            gbs = 3 * n * v * esize / (t["median_ms"] * 1e-3) / 1e9  # read twice (fwd, bwd) + write grad once
            row.update(achieved_gbs=round(gbs, 1), copy_bw_gbs=round(bw["gbs"], 1))
            row["pct_of_copy_bw"] = round(100 * gbs / bw["gbs"], 1)
        row["status"] = status
    except Exception as exc:  # say so in the table, never fake a number; the next provider still runs
        row["status"] = error_status(exc, phase)
    return row


def _shape(writer: RowWriter, names: list[str], n, h, v, dtype, device, opts: dict, bw: dict) -> None:
    """Every provider at one shape, each row written as soon as it is measured; those in opts["skip"] (compiled ones
    in a --quick run) get their "skipped: ..." row."""
    dt = str(dtype).replace("torch.", "")
    keys = [dict(provider=name, N=n, H=h, V=v) for name in names]
    try:
        inputs = _inputs(n, h, v, dtype, device)
    except Exception as exc:
        status = error_status(exc, "inputs")
        for key in keys:
            writer.write({**key, "dtype": dt, "status": status}, ECHO)
        return
    try:
        ref = lp.reference_loss(*inputs)
    except Exception as exc:
        print(f"loss N={n} V={v}: the reference failed: {error_status(exc)}")
        ref = None
    for key in keys:
        name, row = key["provider"], {**key, "dtype": dt, "ref_loss": "" if ref is None else ref}
        if _too_big(name, n, v, device) or name in opts.get("skip", ()):
            why = SKIP_COMPILED if name in opts.get("skip", ()) else "skipped: OOM by design"
            writer.write({**row, "status": why}, ECHO)
            continue
        try:
            fn = lp.make_provider(name, device)
        except Unavailable as exc:
            writer.write({**row, "status": f"unavailable: {exc}"}, ECHO)
            continue
        except Exception as exc:
            writer.write({**row, "status": error_status(exc, "setup")}, ECHO)
            continue
        writer.write(_measure(name, fn, inputs, ref, row, device, opts, bw), ECHO)
        del fn
        free_device_memory(device)
    del inputs
    free_device_memory(device)


def run(writer: RowWriter, shapes, names: list[str], dtype, device, opts: dict) -> None:
    """Every shape in turn. opts: reps_ms (time budget of a measurement), min_runs (timed blocks at least), skip
    (providers not run, with a "skipped" row)."""
    bw: dict = {}  # the copy bandwidth, measured once when a row needs it
    for n, h, v in shapes:
        _shape(writer, names, n, h, v, dtype, device, opts, bw)


def _parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="rapo-fast bench loss", description=__doc__.splitlines()[0])
    add_bench_args(
        p,
        quick="a smoke run: every provider at two tiny CPU shapes, without the torch.compile ones unless "
        "--providers names them (seconds; the times mean nothing)",
        gpu="run on the CUDA device at LLM shapes: N in 4k/16k/64k tokens, H=4096, V in 32k/152k, bf16 "
        "(default: the CPU at N<=2048, V<=32k, fp32)",
        png="loss.png",
        files="loss.csv and loss.png",
    )
    add_dtype_arg(p, "hidden states and lm_head weight")
    add_grid_args(p, "N,H,V")
    args = p.parse_args(argv)
    check_providers(p, args.providers, lp.ALL)
    return p, args


def main(argv: list[str] | None = None) -> int:
    p, args = _parse(argv)
    device, shapes, dtype, reps = grid_of(args, GRID_GPU, GRID_CPU, GRID_CPU_QUICK, (300, 50, 300))
    names = ordered(args.providers, lp.default_providers(args.gpu))
    keys = [dict(provider=name, N=n, H=h, V=v) for n, h, v in shapes for name in names]
    skip = {n for n in names if args.quick and lp.compiled(n, device) and n not in (args.providers or ())}
    opts = dict(reps_ms=reps, min_runs=QUICK_MIN_RUNS if args.quick else 5, skip=skip)
    rc, writer = run_bench(
        p,
        args,
        keys,
        bench="loss",
        csv_name="loss",
        device=device,
        columns=COLUMNS,
        body=lambda w: run(w, shapes, names, dtype, device, opts),
        plot=plot,
        dtype=str(dtype).replace("torch.", ""),
    )
    if writer is not None:
        bad, dev = writer.bad(), writer.meta["device"]
        print(f"bench loss: {len(writer.rows)} rows, {len(bad)} disagreeing/erroring/interrupted, device {dev}")
        print(f"rows appended to {writer.out_dir / 'loss.csv'}")
    return rc


if __name__ == "__main__":
    exit_process(main())
