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
Usage: `rapo-fast bench loss [--quick] [--gpu] [--dtype D] [--out DIR | --record]`. Rows (with device, date and
commit) are appended to <DIR>/loss.csv, to bench/results/loss.csv with --record, or to a new temporary folder.
Plot with bench/plot_loss.py; predictions and readings in bench/NOTES_loss.md.
What this is not: a correctness test (tests/loss/ does that); it only checks that providers agree to a loose
tolerance so that a broken provider cannot post a fast time.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
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

GRID_GPU = [(n, 4096, v) for n in (4096, 16384, 65536) for v in (32768, 152064)]
GRID_CPU_QUICK = [(256, 128, 1000), (512, 96, 4099)]
GRID_CPU = [(1024, 256, 8192), (2048, 512, 32768)]
EPS = 0.2


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """N tokens as B sequences of T = min(512, N) (a GRPO batch): hidden [B, T, H], per-sequence advantages [B]."""
    t = min(512, n)
    b = n // t
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g) / math.sqrt(h)).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (b, t), generator=g).to(device)
    old_logp = (-torch.rand(b, t, generator=g) * 8).to(device)
    adv = torch.randn(b, generator=g).to(device)
    mask = (torch.rand(b, t, generator=g) > 0.1).to(device)
    return hidden, weight, targets, old_logp, adv, mask


def _eager_loss(hidden, weight, targets, old_logp, adv, mask):
    """Without fused kernels: materialised fp32 logits, log-softmax, clipped surrogate, token-mean."""
    from rapo_fast.reference import linear_token_logprobs_ref

    return _surrogate(linear_token_logprobs_ref(hidden, weight, targets), old_logp, adv, mask)


def _surrogate(logp, old_logp, adv, mask):
    ratio = torch.exp(torch.clamp(logp - old_logp, -20, 20))
    a = adv[:, None]
    token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
    m = mask.to(token.dtype)
    return (token * m).sum() / m.sum().clamp_min(1)


def _torch_linear_ce_loss(hidden, weight, targets, old_logp, adv, mask):
    """The clipped surrogate on log-probs from torch's chunked F.linear_cross_entropy (fp32, as our fallback)."""
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=256, chunking_method=None)
    h = hidden.reshape(-1, hidden.shape[-1]).float()
    lce = torch.nn.functional.linear_cross_entropy(
        h, weight.float(), targets.reshape(-1), reduction="none", options=opts
    )
    return _surrogate(-lce.view(targets.shape), old_logp, adv, mask)


def _rapo_fast():
    import rapo_fast

    return rapo_fast


def _ours(targets, old_logp, adv, mask, **inputs):
    """rapo_loss with the bench's options (clip EPS, token-mean) on the given logits= or hidden=/weight= inputs."""
    return _rapo_fast().rapo_loss(
        targets=targets, old_logp=old_logp, advantages=adv, loss_mask=mask, eps_low=EPS, eps_high=EPS,
        loss_agg="token-mean", **inputs,
    )  # fmt: skip


def _ours_logits_lmhead(hidden, weight, targets, old_logp, adv, mask, inplace=False):
    """rapo_loss(logits=) on logits formed in the call (a trainer's lm_head), so that the in-place option applies."""
    return _ours(targets, old_logp, adv, mask, logits=hidden @ weight.T, inplace_backward=inplace)


def _ours_logits_lmhead_inplace(*args):
    return _ours_logits_lmhead(*args, inplace=True)


def _liger_provider(device: torch.device):
    """Liger-Kernel's LigerFusedLinearGRPOLoss as a provider, or None (printed why) where it is unavailable."""
    provs: dict = {}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # loss_type "dapo" = token-mean over the batch; no reference model (beta 0); compiled (Liger's fast path) on
        # CUDA only, its plain-torch chunked path on the CPU.
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

        provs["liger"] = liger_fn
    except Exception as exc:  # not installed, or an API change: say so in the table, never fake a number
        print(f"liger: unavailable ({exc!r})")
    return provs.get("liger")


def _providers(device: torch.device, n: int, v: int):

    def ours_hidden(hidden, weight, targets, old_logp, adv, mask):
        return _ours(targets, old_logp, adv, mask, hidden=hidden, weight=weight)

    def ours_hidden_2pass(*args):
        old = os.environ.get("RAPO_FAST_FUSED_LINEAR_LOSS")
        os.environ["RAPO_FAST_FUSED_LINEAR_LOSS"] = "0"
        try:
            return ours_hidden(*args)
        finally:
            if old is None:
                del os.environ["RAPO_FAST_FUSED_LINEAR_LOSS"]
            else:
                os.environ["RAPO_FAST_FUSED_LINEAR_LOSS"] = old

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

    # torch_eager first: the other providers' losses are checked against its value
    provs = {
        "torch_eager": _eager_loss,
        "rapo_fast_hidden": ours_hidden,
        "rapo_fast_logits": ours_logits,
        "rapo_fast_logits_lmhead": _ours_logits_lmhead,
        "rapo_fast_logits_lmhead_inplace": _ours_logits_lmhead_inplace,
    }
    if device.type == "cuda":  # the two variants differ only where Triton runs
        provs["rapo_fast_hidden_2pass"] = ours_hidden_2pass
    provs["torch_compile"] = torch.compile(_eager_loss, dynamic=False)
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        provs["torch_linear_ce"] = _torch_linear_ce_loss
    else:
        print(f"torch_linear_ce: unavailable (torch {torch.__version__} has no chunked F.linear_cross_entropy)")
    liger = _liger_provider(device)
    if liger is not None:
        provs["liger"] = liger
    return provs


def run(shapes, dtype, device, out_dir: Path, reps_ms: int, providers: list[str] | None = None) -> list[dict]:
    rows = []
    dev_name = device_name(device)
    bw = measure_copy_bandwidth_gbs(device)
    for n, h, v in shapes:
        hidden, weight, targets, old_logp, adv, mask = _inputs(n, h, v, dtype, device)
        ref_loss = None
        for name, fn in _providers(device, n, v).items():
            if providers is not None and name not in providers:
                continue
            if name == "torch_eager" or name == "torch_compile":
                # the eager reference holds [N, V] fp32 logits plus their grad: skip where that cannot fit
                need = n * v * 4 * 3
                if device.type == "cuda" and need > 0.8 * torch.cuda.get_device_properties(device).total_memory:
                    rows.append({"provider": name, "N": n, "H": h, "V": v, "status": "skipped: OOM by design"})
                    continue
            hh = hidden.detach().requires_grad_(True)
            ww = weight.detach().requires_grad_(True)

            def step(fn=fn, hh=hh, ww=ww, rest=(targets, old_logp, adv, mask)):
                hh.grad = None
                ww.grad = None
                loss = fn(hh, ww, *rest)
                loss.backward()
                return loss

            try:
                loss = step().detach()
                if ref_loss is None:
                    ref_loss = float(loss)
                agree = abs(float(loss) - ref_loss) <= 5e-2 * max(1.0, abs(ref_loss))
                t = time_fn(step, device, rep_ms=reps_ms)
                mem = peak_memory_mb(step, device)
                status = "ok" if agree else f"DISAGREES: loss {float(loss):.5g} vs {ref_loss:.5g}"
            except Exception as exc:
                rows.append({"provider": name, "N": n, "H": h, "V": v, "status": f"error: {exc!r}"[:200]})
                continue
            row = {
                "provider": name,
                "N": n,
                "H": h,
                "V": v,
                "dtype": str(dtype).replace("torch.", ""),
                "median_ms": round(t["median_ms"], 4),
                "p20_ms": round(t["p20_ms"], 4),
                "p80_ms": round(t["p80_ms"], 4),
                "peak_mem_mb": round(mem, 1),
                "loss": float(loss),
                "status": status,
            }
            if name == "rapo_fast_logits":
                esize = torch.empty((), dtype=dtype).element_size()
                gbs = 3 * n * v * esize / (t["median_ms"] * 1e-3) / 1e9  # read twice (fwd, bwd) + write grad once
                row.update(achieved_gbs=round(gbs, 1), copy_bw_gbs=round(bw, 1))
                row["pct_of_copy_bw"] = round(100 * gbs / bw, 1)
            rows.append(row)
            print({k: row.get(k) for k in ("provider", "N", "H", "V", "median_ms", "peak_mem_mb", "status")})
            gc.collect()
    meta = {"device": dev_name, "date": now(), "commit": commit()}
    rows = [{**r, **meta} for r in rows]
    print(f"rows appended to {append_rows('loss', rows, out_dir)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rapo-fast bench loss", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: every provider once at two tiny CPU shapes (seconds; the times mean nothing)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="run on the CUDA device at LLM shapes: N in 4k/16k/64k tokens, H=4096, V in 32k/152k, bf16 "
        "(default: the CPU at N<=2048, V<=32k, fp32)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="dtype of hidden states and lm_head weight (default bfloat16 with --gpu, float32 on the CPU)",
    )
    add_grid_args(p, "N,H,V")
    add_output_args(p, "loss.csv")
    args = p.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        p.error("--gpu: no CUDA device is visible")
    out = output_dir(args, "loss")
    if args.gpu:
        device, shapes, dtype, reps = torch.device("cuda"), GRID_GPU, torch.bfloat16, 300
    else:
        device = torch.device("cpu")
        shapes = GRID_CPU_QUICK if args.quick else GRID_CPU
        # bf16 matmul on CPU is emulated and slow: the CPU default is fp32 (numbers are CPU numbers either way)
        dtype, reps = torch.float32, (50 if args.quick else 300)
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    shapes, reps = args.shape or shapes, args.rep_ms or reps
    rows = run(shapes, dtype, device, out, reps, args.providers)
    bad = [r for r in rows if str(r.get("status", "")).startswith(("DISAGREES", "error"))]
    print(f"bench loss: {len(rows)} rows, {len(bad)} disagreeing/erroring providers, device {device_name(device)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
