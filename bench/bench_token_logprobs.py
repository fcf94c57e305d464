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

- `cce`: Apple's Cut Cross-Entropy, -linear_cross_entropy(hidden, weight, targets, reduction="none") (CUDA only:
  Triton kernels on CUDA tensors; its backward needs bf16/fp16 hidden states).

Every provider's log-probs (and, in fwd+bwd, its input gradients) are compared with a reference computed once per shape,
untimed, in fp32 from row chunks (bench/_reference.py: never the whole fp32 [N, V]), of the logits given for the
logits providers and of hidden @ weight^T for the hidden ones, whatever the providers' order. Rows, errors, `--plan`,
`--out`/`--record` and the plot (bench/plot_logprobs.py): as every bench (bench/_common.py); CSV token_logprobs.csv.
A provider's own warnings are caught into its row's `warnings` column. Readings: bench/NOTES_token_logprobs.md.
What this is not: a correctness test (tests/loss/test_logprobs*.py), nor the policy loss (bench/bench_loss.py).
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable

import _reference as ref
import torch
from _loss_providers import cce_linear_ce
from plot_logprobs import plot

from _args import add_bench_args, add_dtype_arg, add_grid_args, check_providers, grid_of, ordered, positive_int
from _common import (
    RowWriter,
    Unavailable,
    env_var,
    error_status,
    exit_process,
    free_device_memory,
    measure_copy_bandwidth_gbs,
    peak_memory_mb,
    run_bench,
    time_fn,
)

GRID_GPU = [(n, 4096, v) for n in (4096, 16384) for v in (32768, 152064)]
GRID_CPU = [(512, 256, 8192), (1024, 256, 32768)]
GRID_CPU_QUICK = [(64, 32, 500), (96, 48, 1031)]
MODES = ("fwd", "fwd+bwd")
PARITY_REPEATS, PARITY_REPEATS_QUICK = 400, 60  # --parity: calls of each side per shape and mode
PARITY_RSS_REPEATS = 3  # --parity: fresh processes per side, shape and mode for the extra peak RSS (1 with --quick)
MIN_SAMPLES = 5  # CPU: timed blocks per provider and mode at least (slow providers get exactly this many)
# provider -> the input it takes, in the default order of a run
INPUT = {
    "torch_eager_logits": "logits",
    "rapo_fast_logits": "logits",
    "torch_eager_hidden": "hidden",
    "torch_chunked_hidden": "hidden",
    "rapo_fast_hidden": "hidden",
    "cce": "hidden",
}
COLUMNS = ["input", "mode", "dtype", "path", "median_ms", "p20_ms", "p80_ms", "samples", "peak_mem_mb"]
COLUMNS += ["max_abs_diff_logp", "grad_rel_err", "achieved_gbs", "copy_bw_gbs", "pct_of_copy_bw"]
ECHO = ("provider", "mode", "N", "V", "median_ms", "peak_mem_mb", "status")


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0, logits=True) -> dict:
    """hidden [N, H], weight [V, H] (scaled so logits have O(1) spread), their logits [N, V] (when a logits provider
    runs), targets, upstream grad; made on the device by its own generator (deterministic per seed and device)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device, dtype=dtype).div_(math.sqrt(h))
    weight = torch.randn(v, h, generator=g, device=device, dtype=dtype).mul_(2.0)
    return {
        "hidden": hidden,
        "weight": weight,
        "logits": (hidden @ weight.T).contiguous() if logits else None,
        "targets": torch.randint(0, v, (n,), generator=g, device=device),
        "grad_logp": torch.randn(n, generator=g, device=device),
    }


def _eager_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _chunked(t):
    """torch's own chunked F.linear_cross_entropy, 256-row chunks."""
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=256, chunking_method=None)
    lce = torch.nn.functional.linear_cross_entropy
    return -lce(t["hidden"], t["weight"], t["targets"], reduction="none", options=opts)


def _cce(device: torch.device) -> Callable:
    linear_cross_entropy = cce_linear_ce(device)
    return lambda t: -linear_cross_entropy(t["hidden"], t["weight"], t["targets"], reduction="none", impl="cce")


def _provider(name: str, device: torch.device) -> tuple[str, Callable]:
    """(path taken, fn(tensors) -> logp [N] fp32) of provider `name`; Unavailable where it cannot run here."""
    from rapo_fast import token_logprobs
    from rapo_fast._dispatch import use_triton
    from rapo_fast.loss.torch_linear_ce import torch_linear_ce_available

    ours_path = "triton" if use_triton(device) else "chunked reference fallback (no Triton on this device)"
    if name == "torch_eager_logits":
        return "eager", lambda t: _eager_logp(t["logits"], t["targets"])
    if name == "rapo_fast_logits":
        return ours_path, lambda t: token_logprobs(t["logits"], targets=t["targets"])
    if name == "torch_eager_hidden":
        return "eager", lambda t: _eager_logp(t["hidden"] @ t["weight"].T, t["targets"])
    if name == "torch_chunked_hidden":
        if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
            raise Unavailable(f"torch {torch.__version__} has no F.linear_cross_entropy options")
        return "torch chunked (F.linear_cross_entropy)", _chunked
    if name == "rapo_fast_hidden":
        path = ours_path
        if not use_triton(device) and torch_linear_ce_available():
            path = "torch chunked linear CE (rapo_fast/loss/torch_linear_ce.py)"
        return path, lambda t: token_logprobs(hidden=t["hidden"], weight=t["weight"], targets=t["targets"])
    if name == "cce":
        return "Cut Cross-Entropy (Triton)", _cce(device)
    raise ValueError(f"unknown provider {name!r}")


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


def _rel_err(got: torch.Tensor, ref_rows: Callable[[int, int], torch.Tensor], rows: int = 1024) -> float:
    """|got - ref| / |ref| (Frobenius), in fp32 over row blocks (ref_rows(r0, r1) gives the reference's rows): no fp32
    copy of a whole [N, V] gradient."""
    num = den = 0.0
    for r0 in range(0, got.shape[0], rows):
        r1 = min(got.shape[0], r0 + rows)
        g, r = got[r0:r1].float(), ref_rows(r0, r1)
        num += float((g - r).square().sum())
        den += float(r.square().sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


class _Refs:
    """The reference of one shape, each part computed once, when a provider first needs it (untimed)."""

    def __init__(self, t: dict):
        self.t, self.cache = t, {}

    def logp(self, kind: str) -> torch.Tensor:
        if kind not in self.cache:
            t = self.t
            src = {"logits": t["logits"]} if kind == "logits" else {"hidden": t["hidden"], "weight": t["weight"]}
            self.cache[kind] = ref.token_logp(t["targets"], **src)
        return self.cache[kind]

    def grad_rows(self, name: str) -> Callable[[int, int], torch.Tensor]:
        t = self.t
        if name == "logits":  # rebuilt per row block from the logits: the [N, V] reference is never held
            z, y, g = t["logits"], t["targets"], t["grad_logp"]
            return lambda r0, r1: ref.logits_grad(z[r0:r1].float(), y[r0:r1], g[r0:r1])
        if "grads" not in self.cache:
            self.cache["grads"] = ref.hidden_grads(t["hidden"], t["weight"], t["targets"], t["grad_logp"])
        g = self.cache["grads"][name]
        return lambda r0, r1: g[r0:r1]


def _check(logp, grads: dict, kind: str, refs: _Refs, dtype: torch.dtype) -> tuple[dict, str]:
    """Compare with the reference of the same input kind."""
    tol_logp, tol_grad = _tolerances(dtype)
    diff = float((logp.float() - refs.logp(kind)).abs().max()) if logp.numel() else 0.0
    gerr = max((_rel_err(g, refs.grad_rows(k)) for k, g in grads.items()), default=0.0)
    out = {"max_abs_diff_logp": round(diff, 7), "grad_rel_err": round(gerr, 7) if grads else ""}
    if diff > tol_logp or gerr > tol_grad:
        return out, f"DISAGREES: max|dlogp| {diff:.3g} (tol {tol_logp}), grad rel err {gerr:.3g} (tol {tol_grad})"
    return out, "ok"


def _bytes_moved(n: int, v: int, dtype: torch.dtype, mode: str) -> int:
    """The least a logits-path op moves: read [N, V] once (fwd), or read it twice and write its gradient (fwd+bwd)."""
    esize = torch.empty((), dtype=dtype).element_size()
    return n * v * esize * (1 if mode == "fwd" else 3)


def _measure(row: dict, fn, t: dict, refs: _Refs, dtype, device, reps_ms: int, bw: dict) -> dict:
    """Run one provider in one mode: check it against the reference, time it, read its peak memory. What was measured
    before an error stays in the row beside the error's status."""
    kind, mode = row["input"], row["mode"]
    names = ("logits",) if kind == "logits" else ("hidden", "weight")
    leaves = {k: t[k].detach().requires_grad_(mode == "fwd+bwd") for k in names}
    rest = {k: x for k, x in t.items() if k not in leaves}
    step = _step_fn(fn, leaves, rest, mode)
    phase = "first call"
    try:
        with warnings.catch_warnings(record=True) as caught:  # a provider falling back to another path says so
            warnings.simplefilter("always")
            logp = step().detach()
        if caught:
            row["warnings"] = "; ".join(sorted({str(w.message)[:120] for w in caught}))
        grads = {k: x.grad.detach() for k, x in leaves.items() if x.grad is not None}
        phase = "check"
        extra, status = _check(logp, grads, kind, refs, dtype)
        row.update(extra)
        del logp, grads
        phase = "timing"
        tm = time_fn(step, device, rep_ms=reps_ms, min_runs=MIN_SAMPLES)
        row.update({k: round(tm[k], 4) for k in ("median_ms", "p20_ms", "p80_ms")}, samples=tm.get("samples", ""))
        phase = "peak memory"
        row["peak_mem_mb"] = round(peak_memory_mb(step, device), 1)
        if kind == "logits":
            phase = "copy bandwidth"
            if "gbs" not in bw:
                bw["gbs"] = measure_copy_bandwidth_gbs(device)
            gbs = _bytes_moved(row["N"], row["V"], dtype, mode) / (row["median_ms"] * 1e-3) / 1e9
            row.update(achieved_gbs=round(gbs, 2), copy_bw_gbs=round(bw["gbs"], 2))
            row["pct_of_copy_bw"] = round(100 * gbs / bw["gbs"], 1)
        row["status"] = status
    except Exception as exc:  # say so in the table, never fake a number; the next provider still runs
        row["status"] = error_status(exc, phase)
    return row


def _shape(writer: RowWriter, names: list[str], n, h, v, dtype, device, reps_ms: int, bw: dict) -> None:
    """Every provider in both modes at one shape, each row written as soon as it is measured."""
    base = {"N": n, "H": h, "V": v, "dtype": str(dtype).replace("torch.", "")}
    rows = [{"provider": p, **base, "mode": m, "input": INPUT[p]} for m in MODES for p in names]
    try:
        t = _inputs(n, h, v, dtype, device, logits=any(INPUT[p] == "logits" for p in names))
    except Exception as exc:
        status = error_status(exc, "inputs")
        for row in rows:
            writer.write({**row, "status": status}, ECHO)
        return
    refs = _Refs(t)
    for row in rows:
        try:
            row["path"], fn = _provider(row["provider"], device)
        except Unavailable as exc:
            writer.write({**row, "status": f"unavailable: {exc}"}, ECHO)
            continue
        except Exception as exc:
            writer.write({**row, "status": error_status(exc, "setup")}, ECHO)
            continue
        writer.write(_measure(row, fn, t, refs, dtype, device, reps_ms, bw), ECHO)
        del fn
        free_device_memory(device)
    del t, refs
    free_device_memory(device)


def run(writer: RowWriter, shapes, names: list[str], dtype, device, reps_ms: int) -> None:
    bw: dict = {}  # the copy bandwidth, measured once when a logits row needs it
    for n, h, v in shapes:
        _shape(writer, names, n, h, v, dtype, device, reps_ms, bw)


def _triton_off(device: torch.device):
    """RAPO_FAST_DISABLE_TRITON=1 while timing on the CPU (its fallback, not Triton's interpreter), then as before."""
    return env_var("RAPO_FAST_DISABLE_TRITON", "1" if device.type == "cpu" else None)


def _parity(shapes, repeats: int, rss_repeats: int) -> int:
    """token_logprobs(hidden=...) on the CPU against torch's F.linear_cross_entropy, in fp32, two ways: as our wrapper
    calls it at that shape (rapo_fast/loss/torch_linear_ce.py: unchunked when the logits fit in SMALL_BYTES, else with
    our chunk rows), and chunked with our chunk rows at every shape (what a caller who wants torch's memory bound
    writes). Time: all three in one loop, the order rotating per repeat, each call timed on its own (where the op as
    called is the chunked one, its times are the chunked side's); prints the medians and the ratios ours / each. Ours /
    "as called" is the cost of our front desk (checks, plan, the targets range check, the finite-loss check). Timed as
    the CPU time of this thread with torch on one thread, so that a loaded machine (other processes taking the cores)
    does not enter the numbers; torch's thread count is restored after. Memory: the extra peak RSS of one call of ours
    and of the chunked op, each in `rss_repeats` fresh processes (bench/cpu_peak_rss.py, torch on one thread there
    too), the median and the ratio."""
    from rapo_fast.loss import torch_linear_ce

    if not torch_linear_ce.torch_linear_ce_available():
        print(f"--parity: torch {torch.__version__} has no F.linear_cross_entropy options")
        return 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _parity_rows(shapes, repeats, rss_repeats)
    finally:
        torch.set_num_threads(threads)
    return 0


def _parity_fns(n: int, v: int) -> dict:
    """--parity's sides at N, V: fn(tensors) -> logp; "called" is None where the op as called is the chunked one."""
    from rapo_fast import token_logprobs
    from rapo_fast.loss import torch_linear_ce as tlce

    lce = torch.nn.functional.linear_cross_entropy
    chunked = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=tlce.chunk_rows(n, v), chunking_method=None)
    unchunked = 4 * n * v <= tlce.SMALL_BYTES
    return {
        "chunked": lambda t: -lce(t["hidden"], t["weight"], t["targets"], reduction="none", options=chunked),
        "called": (lambda t: -lce(t["hidden"], t["weight"], t["targets"], reduction="none", options=None))
        if unchunked
        else None,
        "ours": lambda t: token_logprobs(hidden=t["hidden"], weight=t["weight"], targets=t["targets"]),
    }


# a fresh process's --parity side: its inputs and one step of `mode` (bench/cpu_peak_rss.py runs it twice)
RSS_SETUP = """
import torch, rapo_fast
import bench_token_logprobs as b
torch.set_num_threads(1)
t = b._inputs({n}, {h}, {v}, torch.float32, torch.device("cpu"), logits=False)
leaves = {{k: t[k].detach().requires_grad_({mode!r} == "fwd+bwd") for k in ("hidden", "weight")}}
s = b._step_fn(b._parity_fns({n}, {v})[{side!r}], leaves, {{k: t[k] for k in ("targets", "grad_logp")}}, {mode!r})
"""


def _parity_rss(n: int, h: int, v: int, mode: str, repeats: int) -> dict:
    """Extra peak RSS (MiB) of one call of the chunked op and of ours, `repeats` fresh processes each."""
    from cpu_peak_rss import extra_peak_rss_mib

    mib: dict = {"chunked": [], "ours": []}
    for r in range(repeats):
        for side in ("chunked", "ours") if r % 2 == 0 else ("ours", "chunked"):
            setup = RSS_SETUP.format(n=n, h=h, v=v, mode=mode, side=side)
            mib[side].append(extra_peak_rss_mib(setup, "s()", "for x in leaves.values(): x.grad = None"))
    return mib


def _parity_rows(shapes, repeats: int, rss_repeats: int) -> None:
    import statistics
    import time

    head = f"{'N':>6} {'H':>5} {'V':>6} {'mode':>8} {'chunked ms':>10} {'as called':>10} {'ours ms':>10}"
    head += f" {'/chunked':>8} {'/called':>8} {'chunk MiB':>9} {'ours MiB':>9} {'/chunked':>8}"
    print(f"{head}  (time: {repeats} repeats; extra peak RSS: median of {rss_repeats} fresh processes)")
    for n, h, v in shapes:
        t = _inputs(n, h, v, torch.float32, torch.device("cpu"), logits=False)
        fns = {k: fn for k, fn in _parity_fns(n, v).items() if fn is not None}
        for mode in MODES:
            leaves = {k: t[k].detach().requires_grad_(mode == "fwd+bwd") for k in ("hidden", "weight")}
            rest = {k: x for k, x in t.items() if k not in leaves}
            steps = {k: _step_fn(fn, leaves, rest, mode) for k, fn in fns.items()}
            times: dict = {k: [] for k in steps}
            for k in steps:  # warm-up
                steps[k]()
            order = list(steps)
            for r in range(repeats):
                for k in order[r % len(order) :] + order[: r % len(order)]:
                    t0 = time.thread_time_ns()
                    steps[k]()
                    times[k].append(time.thread_time_ns() - t0)
            times.setdefault("called", times["chunked"])
            a, c, b = (statistics.median(times[k]) * 1e-6 for k in ("chunked", "called", "ours"))
            mib = _parity_rss(n, h, v, mode, rss_repeats)
            ma, mb = (statistics.median(mib[k]) for k in ("chunked", "ours"))
            row = f"{n:>6} {h:>5} {v:>6} {mode:>8} {a:>10.4f} {c:>10.4f} {b:>10.4f} {b / a:>8.3f} {b / c:>8.3f}"
            ratio = mb / ma if ma > 0 else float("nan")  # tiny shapes: within resident pages, 0 MiB either side
            print(f"{row} {ma:>9.1f} {mb:>9.1f} {ratio:>8.3f}")
            q = {k: statistics.quantiles(x, n=5) if len(x) > 1 else x * 4 for k, x in times.items()}
            spread = ", ".join(f"{k} {q[k][0] * 1e-6:.4g}-{q[k][3] * 1e-6:.4g}" for k in ("chunked", "ours"))
            rss = ", ".join(f"{k} {' '.join(f'{x:.1f}' for x in mib[k])}" for k in ("chunked", "ours"))
            print(f"  spread: ms p20-p80 {spread}; MiB per process {rss}", flush=True)


def _parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="rapo-fast bench logprobs", description=__doc__.splitlines()[0])
    add_bench_args(
        p,
        quick="a smoke run: every provider in both modes at two tiny CPU shapes (seconds; the times mean nothing)",
        gpu="run on the CUDA device at LLM shapes: N in 4k/16k tokens, H=4096, V in 32k/152k, bf16 "
        "(default: the CPU at N=512/1024, H=256, V=8k/32k, fp32)",
        png="token_logprobs.png",
        files="token_logprobs.csv and token_logprobs.png",
    )
    add_dtype_arg(p, "logits, hidden states and lm_head weight")
    p.add_argument(
        "--parity",
        action="store_true",
        help="only compare token_logprobs(hidden=...) with the torch op it wraps on the CPU: time (interleaved) and "
        "extra peak RSS (fresh processes), medians and ratios (with --quick: tiny shapes; --shape picks others; "
        "nothing is written)",
    )
    p.add_argument("--repeats", type=positive_int, help="timed calls of each side per shape and mode (with --parity)")
    p.add_argument("--rss-repeats", type=positive_int, help="fresh processes per side, shape and mode (with --parity)")
    add_grid_args(p, "N,H,V")
    args = p.parse_args(argv)
    check_providers(p, args.providers, list(INPUT))
    return p, args


def main(argv: list[str] | None = None) -> int:
    p, args = _parse(argv)
    device, shapes, dtype, reps = grid_of(args, GRID_GPU, GRID_CPU, GRID_CPU_QUICK, (300, 20, 500))
    if args.parity:  # the CPU path without Triton: torch's op is what runs there
        with _triton_off(torch.device("cpu")):
            repeats = args.repeats or (PARITY_REPEATS_QUICK if args.quick else PARITY_REPEATS)
            return _parity(shapes, repeats, args.rss_repeats or (1 if args.quick else PARITY_RSS_REPEATS))
    names = ordered(args.providers, list(INPUT))
    keys = [dict(provider=p_, N=n, H=h, V=v, mode=m) for n, h, v in shapes for m in MODES for p_ in names]
    with _triton_off(device):
        rc, writer = run_bench(
            p,
            args,
            keys,
            bench="logprobs",
            csv_name="token_logprobs",
            device=device,
            columns=COLUMNS,
            body=lambda w: run(w, shapes, names, dtype, device, reps),
            plot=plot,
            dtype=str(dtype).replace("torch.", ""),
        )
    if writer is not None:
        dev, bad = writer.meta["device"], len(writer.bad())
        print(f"bench logprobs: {len(writer.rows)} rows, {bad} disagreeing/erroring/interrupted, device {dev}")
    return rc


if __name__ == "__main__":
    exit_process(main())
