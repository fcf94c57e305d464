"""Queries/s of exact step retrieval: StepBuffer.search against faiss and plain torch, side by side.

Providers at each shape, timed round-robin in one run (so a shared machine's load hits all of them alike):
- CPU: `ours` (C++ backend, fp32 keys; `ours_fp16` with fp16 keys; `ours_excl` with a per-query exclusion filter),
  `faiss_flat` (faiss-cpu IndexFlatIP / IndexFlatL2, BLAS sgemm blocks + heaps), `torch` (matmul + topk over key
  chunks of 65536, merged).
- GPU (--gpu): `ours` (fp16 keys, the backend the crossover table picks; `ours_excl` with the filter; `ours_triton` and
  `ours_cuda` force the Triton kernel or the CUDA backend), `torch` (fp16 matmul + topk in chunks that fit memory) and
  `floor`, the bandwidth floor C * D * bytes / measured copy bandwidth.
Order: the paper's scale first (C=170k steps, D=384 MiniLM, Q=256 = 32 prompts x 8 hybrid rollouts, k in {1, 3}), then
(CPU) the few-query shapes SMALL_Q, then the grid C in {100k, 1M, 4M} x D in {256, 768} x Q in {64, 1024, 4096} x k in
{8, 64} (on the CPU a subset, see GRID_CPU; --quick is a smoke subset for CI). CSV retrieval_{cpu,gpu}.csv (rows carry
the load average too), plot bench/plot_retrieval.py. Every provider's ids are compared with `ours`'s:
`frac_ids_equal_to_ours` = the fraction of the Q x k returned ids equal to ours's, position by position (exact equality,
no tolerance; blank for ours_excl, whose filter changes the answer), so a broken provider cannot post a fast time.
`time_over_faiss` / `time_over_torch` = this row's median_ms / the faiss_flat (torch) row's median_ms at the same shape
(below 1: faster than that anchor); on the CPU the faiss one when faiss ran, else the torch one. Rows, errors, `--plan`
and `--out`/`--record`: as every bench (bench/_common.py), except that on the CPU a shape's rows are appended together
when its round-robin timing ends (on the GPU `torch` goes first by default, so that every later row carries its
time_over_torch). Readings in bench/NOTES_retrieval.md.
What this is not: a correctness test (tests/retrieval/).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from plot_retrieval import plot

from _args import add_bench_args, add_grid_args, check_providers, ordered, positive_int
from _common import (
    RowWriter,
    Unavailable,
    env_var,
    error_status,
    exit_process,
    measure_copy_bandwidth_gbs,
    quantiles_ms,
    run_bench,
    time_fn,
)

PAPER = [(170_000, 384, 256, k) for k in (1, 3)]
GRID_FULL = [
    (c, d, q, k) for c in (100_000, 1_000_000, 4_000_000) for d in (256, 768) for q in (64, 1024, 4096) for k in (8, 64)
]
# CPU: 4M keys and Q=4096 take minutes per provider on a few cores; the acceptance point (1M, 768, 1024, 64) is kept.
GRID_CPU = [(100_000, d, q, k) for d in (256, 768) for q in (64, 1024) for k in (8, 64)] + [
    (1_000_000, 768, 64, 64),
    (1_000_000, 768, 1024, 64),
]
# Per-step retrieval of one prompt's hybrid rollouts (Q = 1..16) at the paper's buffer size: the few-query path.
SMALL_Q = [(170_000, 384, q, 3) for q in (1, 2, 4, 6, 8, 16, 32)]
QUICK = [(20_000, 64, 32, 8), (5_000, 48, 7, 3)]
N_GROUPS = 1000
# The providers of each device in their default order. GPU: `torch` first, so that every row after it carries its
# time_over_torch (rows are written as they are measured); `ours` is the headline and comes next.
CPU_PROVIDERS = ["ours", "ours_excl", "torch", "ours_fp16", "faiss_flat", "ours_faiss_mem"]
GPU_PROVIDERS = ["torch", "ours", "ours_excl", "ours_triton", "ours_cuda", "floor"]
FP16_MAX = 100_000_000  # CPU: the fp16 copy of the keys doubles memory; built only up to C * D of this
AGREE = "frac_ids_equal_to_ours"  # fraction of returned ids equal to ours's, position by position
COLUMNS = ["metric", "dtype", "median_ms", "p20_ms", "p80_ms", "qps", AGREE]
CPU_COLUMNS = [*COLUMNS, "repeats", "time_over_faiss", "time_over_torch", "isa", "threads", "load_avg_1m"]
GPU_COLUMNS = [*COLUMNS, "time_over_torch", "pct_of_copy_bw", "copy_bw_gbs"]


class _Skip(Exception):
    """A provider left out at this shape by design: its row says "skipped: ..."."""


def _torch_topk(keys: torch.Tensor, queries: torch.Tensor, k: int, metric: str, chunk: int):
    """What a trainer writes without us: scores chunk by chunk, a running top-k merged with torch.topk."""
    best_s = best_i = None
    q = queries.to(keys.dtype)
    for c0 in range(0, keys.shape[0], chunk):
        kc = keys[c0 : c0 + chunk]
        s = (q @ kc.T).float()
        if metric == "l2":
            s = 2 * s - kc.float().square().sum(1) - q.float().square().sum(1, keepdim=True)
        ts, ti = torch.topk(s, min(k, s.shape[1]), dim=1)
        ti = ti + c0
        if best_s is None:
            best_s, best_i = ts, ti
        else:
            best_s, j = torch.topk(torch.cat([best_s, ts], 1), k, dim=1)
            best_i = torch.gather(torch.cat([best_i, ti], 1), 1, j)
    return best_s, best_i


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu() == b.cpu()).double().mean())


SLOW_S = 10.0


def _time_round_robin(fns: dict, repeats: int, errors: dict) -> dict[str, dict]:
    """CPU timing: one warm-up each, then `repeats` rounds over all providers; medians and 20/80% quantiles in ms. A
    provider that raises is dropped from the rounds, its status in `errors`.

    A provider whose warm-up takes over SLOW_S seconds is timed by that one run only (repeats = 1 in the row): at
    such durations warm-up effects are negligible and repeats would take many minutes."""
    times: dict[str, list[float]] = {n: [] for n in fns}
    slow: set[str] = set()
    for phase, rounds in (("warm-up", 1), ("timing", repeats)):
        for _ in range(rounds):
            for n, fn in fns.items():
                if n in errors or (phase == "timing" and n in slow):
                    continue
                t0 = time.perf_counter()
                try:
                    fn()
                except Exception as exc:
                    errors[n] = error_status(exc, phase)
                    continue
                dt = time.perf_counter() - t0
                if phase == "warm-up" and dt > SLOW_S:
                    slow.add(n)
                    times[n].append(dt * 1e3)
                elif phase == "timing":
                    times[n].append(dt * 1e3)
    out = {}
    for n, ts in times.items():
        if n in errors or not ts:
            continue
        out[n] = {**quantiles_ms(ts), "repeats": len(ts)}
    return out


def _cpu_buffer(C, D, Q, metric):
    from rapo_fast import StepBuffer

    g = torch.Generator().manual_seed(0)
    buf = StepBuffer(C, D, dtype=torch.float32, metric=metric)
    for c0 in range(0, C, 262_144):  # build in pieces to bound the temporary memory
        n = min(262_144, C - c0)
        buf.add(torch.randn(n, D, generator=g), torch.arange(c0, c0 + n), torch.randint(0, N_GROUPS, (n,), generator=g))
    return buf, torch.randn(Q, D, generator=g), torch.randint(0, N_GROUPS, (Q,), generator=g)


def _cpu_fn(name: str, st: dict, k: int, metric: str, faiss_mod):
    """The timed call of CPU provider `name` on the shape's state `st` (buffer, queries, filter)."""
    buf, q, excl, C, D = st["buf"], st["q"], st["excl"], st["C"], st["D"]
    if name == "ours":
        return lambda: buf.search(q, k)
    if name == "ours_excl":
        return lambda: buf.search(q, k, exclude_groups=excl)
    if name == "torch":
        return lambda: _torch_topk(buf.embeddings, q, k, metric, 65_536)
    if name == "ours_fp16":
        if C * D > FP16_MAX:
            raise _Skip(f"the fp16 copy of the keys is built only up to C*D = {FP16_MAX:.0e}")
        from rapo_fast import StepBuffer

        buf16 = StepBuffer(C, D, dtype=torch.float16, metric=metric)
        buf16.add(buf.embeddings, buf.payload_ids, buf.group_ids)
        return lambda: buf16.search(q, k)
    if faiss_mod is None:
        raise Unavailable("faiss is not importable (pip install faiss-cpu)")
    if "index" not in st:
        index = (faiss_mod.IndexFlatIP if metric == "ip" else faiss_mod.IndexFlatL2)(D)
        index.add(buf.embeddings.numpy())
        st["index"] = index
    index, qn = st["index"], q.numpy()
    if name == "faiss_flat":
        return lambda: index.search(qn, k)
    # ours_faiss_mem: our op over faiss's own copy of the keys, the same bytes in the same pages, so that a difference
    # between the two is the kernels' and not where the two buffers' pages landed (worth up to 20% at Q=1, NOTES).
    from rapo_fast.retrieval.op import METRIC_CODES, retrieval_search

    xb = torch.from_numpy(faiss_mod.rev_swig_ptr(index.get_xb(), C * D).reshape(C, D))
    aux, grp = buf._aux[:C], buf._group[:C]
    return lambda: retrieval_search(xb, aux, grp, q, None, k, METRIC_CODES[metric], float("-inf"))


def _ids(out) -> torch.Tensor:
    """The ids of a provider's (scores, ids) result: payload ids, faiss labels (numpy) or slots (= payload ids here:
    payload i sits in slot i)."""
    return torch.as_tensor(out[1])


def _cpu_case(writer: RowWriter, names, C, D, Q, k, metric, repeats, faiss_mod, extra: dict) -> None:
    """One CPU shape: every provider built and checked, then timed round-robin, then its rows written in order."""
    keys = [dict(provider=n, C=C, D=D, Q=Q, k=k) for n in names]
    writer.measuring(keys)  # timed together: a stop now interrupts all of them
    rows = {key["provider"]: {**key, **extra, "metric": metric, "dtype": "float32"} for key in keys}
    rows.get("ours_fp16", {})["dtype"] = "float16"
    fns, errors = {}, {}
    try:
        st = dict(zip(("buf", "q", "excl"), _cpu_buffer(C, D, Q, metric)), C=C, D=D)
        ref = _ids(st["buf"].search(st["q"], k))
    except Exception as exc:
        errors = dict.fromkeys(names, error_status(exc, "inputs"))
    for name in names:
        if name in errors:
            continue
        phase = "setup"
        try:
            fn = _cpu_fn(name, st, k, metric, faiss_mod)
            phase = "first call"
            rows[name][AGREE] = float("nan") if name == "ours_excl" else round(_agree(_ids(fn()), ref), 4)
            fns[name] = fn
        except Unavailable as exc:
            errors[name] = f"unavailable: {exc}"
        except _Skip as exc:
            errors[name] = f"skipped: {exc}"
        except Exception as exc:
            errors[name] = error_status(exc, phase)
    res = _time_round_robin(fns, repeats, errors)
    base = res.get("faiss_flat", res.get("torch", {})).get("median_ms")
    for name in names:
        row = rows[name]
        if name in res:
            r = res[name]
            row.update(qps=Q / (r["median_ms"] * 1e-3), **r, status="ok")
            if base is not None:
                row["time_over_faiss" if "faiss_flat" in res else "time_over_torch"] = round(r["median_ms"] / base, 3)
        else:
            row["status"] = errors.get(name, "error: not timed")
        writer.write(row)
        _print(row)
    writer.measuring(None)


_GPU_BUF: dict = {}


def _forced(backend: str, fn, *args):
    """fn(*args) with RAPO_FAST_RETRIEVAL_BACKEND set to `backend` (the override the search reads per call)."""
    from rapo_fast.retrieval.triton_search import BACKEND_ENV

    with env_var(BACKEND_ENV, backend):
        return fn(*args)


def _gpu_state(C, D, Q, metric, device) -> dict:
    """The shape's buffer (kept across the Q and k of one (C, D)), queries and filter, made on the device."""
    from rapo_fast import StepBuffer

    g = torch.Generator(device=device).manual_seed(0)
    key = (C, D, metric)
    if _GPU_BUF.get("key") != key:  # the grid walks Q and k for each (C, D): build each buffer once
        _GPU_BUF.clear()
        torch.cuda.empty_cache()
        buf = StepBuffer(C, D, dtype=torch.float16, metric=metric, device=device)
        for c0 in range(0, C, 1_048_576):
            n = min(1_048_576, C - c0)
            buf.add(
                torch.randn(n, D, generator=g, device=device),
                torch.arange(c0, c0 + n, device=device),
                torch.randint(0, N_GROUPS, (n,), generator=g, device=device),
            )
        _GPU_BUF.update(key=key, buf=buf)
    buf = _GPU_BUF["buf"]
    q = torch.randn(Q, D, generator=g, device=device)
    excl = torch.randint(0, N_GROUPS, (Q,), generator=g, device=device)
    free, _ = torch.cuda.mem_get_info(device)
    # Score chunk [Q, chunk] in fp16 + its fp32 copy within an eighth of free memory each, so topk's workspace fits too.
    chunk = int(max(4096, min(C, free // 8 // max(1, Q * 4))))
    return dict(buf=buf, q=q, excl=excl, chunk=chunk)


def _gpu_fn(name: str, st: dict, k: int, metric: str):
    buf, q = st["buf"], st["q"]
    return {
        "ours": lambda: buf.search(q, k),
        "ours_excl": lambda: buf.search(q, k, exclude_groups=st["excl"]),
        "torch": lambda: _torch_topk(buf.embeddings, q, k, metric, st["chunk"]),
        # `ours` follows the crossover table; these two force each backend (rapo_fast/retrieval/triton_search.py).
        "ours_triton": lambda: _forced("triton", buf.search, q, k),
        "ours_cuda": lambda: _forced("cuda", buf.search, q, k),
    }[name]


def _gpu_row(name, row: dict, st: dict, ref: dict, k, metric, device, floor_ms: float, rep_ms: int) -> dict:
    """Check one GPU provider against `ours`'s ids (computed once, untimed, when first needed) and time it."""
    phase = "setup"
    try:
        fn = _gpu_fn(name, st, k, metric)
        phase = "first call"
        ids = _ids(fn())
        if name == "ours_excl":
            row[AGREE] = float("nan")
        else:
            if "ids" not in ref:
                phase = "reference (ours)"
                ref["ids"] = _ids(st["buf"].search(st["q"], k))
            row[AGREE] = round(_agree(ids, ref["ids"]), 4)
        phase = "timing"
        r = time_fn(fn, device, rep_ms=rep_ms)
        row.update(qps=row["Q"] / (r["median_ms"] * 1e-3), pct_of_copy_bw=round(100 * floor_ms / r["median_ms"], 1))
        row.update(**r, status="ok")
    except Exception as exc:  # one provider's failure (a Triton compile, a CUDA error) is its own row
        row["status"] = error_status(exc, phase)
    return row


def _gpu_case(writer: RowWriter, names, C, D, Q, k, metric, device, bw_gbs, rep_ms: int = 200) -> None:
    """One GPU shape: each provider checked, timed and its row written in turn."""
    base = dict(metric=metric, dtype="float16", C=C, D=D, Q=Q, k=k)
    try:
        st = _gpu_state(C, D, Q, metric, device)
    except Exception as exc:
        status = error_status(exc, "inputs")
        for name in names:
            writer.write(dict(provider=name, **base, status=status))
        return
    floor_ms = C * D * 2 / (bw_gbs * 1e9) * 1e3
    ref: dict = {}
    torch_ms = None
    for name in names:
        row = dict(provider=name, **base)
        if name == "floor":
            row.update(median_ms=floor_ms, qps=Q / (floor_ms * 1e-3), copy_bw_gbs=round(bw_gbs, 1), status="ok")
        else:
            row = _gpu_row(name, row, st, ref, k, metric, device, floor_ms, rep_ms)
        if name == "torch" and row["status"] == "ok":
            torch_ms = row["median_ms"]
        if torch_ms and "median_ms" in row:
            row["time_over_torch"] = round(row["median_ms"] / torch_ms, 3)
        writer.write(row)
        _print(row)
    torch.cuda.empty_cache()


def _parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="rapo-fast bench retrieval", description=__doc__.split("\n")[0])
    add_bench_args(
        p,
        quick="a smoke run: every provider at two tiny shapes (C <= 20k keys; seconds, the times mean nothing)",
        gpu="run on the first CUDA device (ours, torch and the bandwidth floor; fp16 keys) instead of the CPU",
        png="retrieval_cpu.png (retrieval_gpu.png with --gpu)",
        files="retrieval_cpu.csv and .png (retrieval_gpu.* with --gpu)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU timing rounds per provider; the median is reported (default 5, with --quick 3)",
    )
    p.add_argument(
        "--paper-only",
        action="store_true",
        help="only the paper's scale: 170k steps, 384-dim keys, 256 queries, k in {1, 3}",
    )
    p.add_argument(
        "--small-q",
        action="store_true",
        help="only the few-query shapes of per-step retrieval: 1 to 32 queries against 170k steps (CPU)",
    )
    p.add_argument(
        "--metric",
        default="ip",
        choices=["ip", "l2"],
        help="similarity of the grid: inner product or (negative) squared L2 distance (default ip)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads given to every provider, faiss included (default: torch's thread count)",
    )
    add_grid_args(p, "C,D,Q,k")
    args = p.parse_args(argv)
    check_providers(p, args.providers, GPU_PROVIDERS if args.gpu else CPU_PROVIDERS)
    return p, args


def _shapes(args: argparse.Namespace) -> list[tuple[int, int, int, int]]:
    if args.shape:
        return args.shape
    if args.quick:
        return QUICK
    if args.gpu:
        return PAPER if args.paper_only else PAPER + GRID_FULL
    if args.small_q or args.paper_only:
        return SMALL_Q if args.small_q else PAPER
    return PAPER + SMALL_Q + GRID_CPU


def main(argv: list[str] | None = None) -> int:
    p, args = _parse(argv)
    shapes = _shapes(args)
    names = ordered(args.providers, GPU_PROVIDERS if args.gpu else CPU_PROVIDERS)
    keys = [dict(provider=n, C=C, D=D, Q=Q, k=k) for C, D, Q, k in shapes for n in names]
    if args.threads and not args.plan:
        torch.set_num_threads(args.threads)
    body = _run_gpu if args.gpu else _run_cpu
    rc, writer = run_bench(
        p,
        args,
        keys,
        bench="retrieval",
        plan="retrieval",
        csv_name="retrieval_gpu" if args.gpu else "retrieval_cpu",
        device=torch.device("cuda", 0) if args.gpu else torch.device("cpu"),
        columns=GPU_COLUMNS if args.gpu else CPU_COLUMNS,
        body=lambda w: body(w, args, shapes, names),
        plot=plot,
        metric=args.metric,
    )
    if writer is not None:
        print(f"wrote {len(writer.rows)} rows to {writer.out_dir / writer.csv_name}.csv")
    return rc


def _run_gpu(writer: RowWriter, args: argparse.Namespace, shapes, names) -> None:
    device = torch.device("cuda", 0)
    bw = measure_copy_bandwidth_gbs(device)
    for C, D, Q, k in shapes:
        _gpu_case(writer, names, C, D, Q, k, args.metric, device, bw, args.rep_ms or 200)


def _run_cpu(writer: RowWriter, args: argparse.Namespace, shapes, names) -> None:
    # faiss-cpu bundles its own OpenBLAS, whose threads would otherwise oversubscribe the cores next to faiss's OpenMP
    # threads (measured here: 2-4x slower on a loaded 2-core machine); it reads this variable when faiss is imported.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(torch.get_num_threads()))
    faiss = None
    if any(n in ("faiss_flat", "ours_faiss_mem") for n in names):
        try:
            import faiss
        except ImportError:
            faiss = None
    if faiss is not None:
        faiss.omp_set_num_threads(torch.get_num_threads())
    from rapo_fast._ext import extension

    isa = extension().retrieval_cpu_isa(-1)
    repeats = args.repeats or (3 if args.quick else 5)
    for C, D, Q, k in shapes:
        extra = dict(isa=isa, threads=torch.get_num_threads(), load_avg_1m=round(os.getloadavg()[0], 2))
        _cpu_case(writer, names, C, D, Q, k, args.metric, repeats, faiss, extra)


def _print(r: dict) -> None:
    if r.get("status") != "ok":
        print(f"C={r['C']:>8} D={r['D']:>4} Q={r['Q']:>5} k={r['k']:>3} {r['provider']:>11}: {r['status']}")
        return
    anchor, ratio = next(((a, r[f"time_over_{a}"]) for a in ("faiss", "torch") if r.get(f"time_over_{a}")), ("", ""))
    print(
        f"C={r['C']:>8} D={r['D']:>4} Q={r['Q']:>5} k={r['k']:>3} {r['provider']:>11}: "
        f"{r['median_ms']:10.2f} ms  {r['qps']:12.0f} q/s  {ratio}x {anchor or '?'}'s time  "
        f"ids equal to ours {r.get(AGREE, '')}",
        flush=True,
    )


if __name__ == "__main__":
    exit_process(main())
