"""Queries/s of exact step retrieval: StepBuffer.search against faiss and plain torch, side by side.

Providers at each shape, timed round-robin in one run (so a shared machine's load hits all of them alike):
- CPU: `ours` (C++ backend, fp32 keys; `ours_fp16` with fp16 keys; `ours_excl` with a per-query exclusion filter),
  `faiss_flat` (faiss-cpu IndexFlatIP / IndexFlatL2, BLAS sgemm blocks + heaps), `torch` (matmul + topk over key
  chunks of 65536, merged).
- GPU (--gpu): `ours` (fp16 keys, the backend the crossover table picks; `ours_excl` with the filter; `ours_triton` and
  `ours_cuda` force the Triton kernel or the CUDA backend), `torch` (fp16 matmul + topk in chunks that fit memory) and
  `floor`, the bandwidth floor C * D * bytes / measured copy bandwidth.
Order: the paper's scale first (C=170k steps, D=384 MiniLM, Q=256 = 32 prompts x 8 hybrid rollouts, k in {1, 3}),
then (CPU) the few-query shapes SMALL_Q, then the grid C in {100k, 1M, 4M} x D in {256, 768} x Q in
{64, 1024, 4096} x k in {8, 64} (on the CPU a subset, see
GRID_CPU; --quick is a smoke subset for CI). Rows (with device, date, commit and the load average) are appended to
<DIR>/retrieval_{cpu,gpu}.csv, to bench/results/ with --record, or to a new temporary folder; every provider's ids
are compared with `ours` (agree = fraction of equal ids) so a broken provider cannot post a fast time.
Usage: `rapo-fast bench retrieval [--quick] [--gpu] [--repeats N] [--out DIR | --record]`; plot with
bench/plot_retrieval.py; readings in bench/NOTES_retrieval.md.
What this is not: a correctness test (tests/retrieval/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

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
    positive_int,
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


def _time_round_robin(fns: dict, repeats: int) -> dict[str, dict]:
    """CPU timing: one warm-up each, then `repeats` rounds over all providers; medians and 20/80% quantiles in ms.

    A provider whose warm-up takes over SLOW_S seconds is timed by that one run only (repeats = 1 in the row): at
    such durations warm-up effects are negligible and repeats would take many minutes."""
    times: dict[str, list[float]] = {n: [] for n in fns}
    for n, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if dt > SLOW_S:
            times[n].append(dt * 1e3)
    for _ in range(repeats):
        for n, fn in fns.items():
            if times[n] and len(times[n]) == 1 and times[n][0] > SLOW_S * 1e3:
                continue
            t0 = time.perf_counter()
            fn()
            times[n].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for n, ts in times.items():
        ts.sort()
        out[n] = {
            "median_ms": statistics.median(ts),
            "p20_ms": ts[int(0.2 * (len(ts) - 1))],
            "p80_ms": ts[int(0.8 * (len(ts) - 1))],
            "repeats": len(ts),
        }
    return out


def _cpu_case(C, D, Q, k, metric, repeats, faiss_mod) -> list[dict]:
    from rapo_fast import StepBuffer

    g = torch.Generator().manual_seed(0)
    buf = StepBuffer(C, D, dtype=torch.float32, metric=metric)
    for c0 in range(0, C, 262_144):  # build in pieces to bound the temporary memory
        n = min(262_144, C - c0)
        buf.add(torch.randn(n, D, generator=g), torch.arange(c0, c0 + n), torch.randint(0, N_GROUPS, (n,), generator=g))
    buf16 = None
    if C * D <= 100_000_000:  # the fp16 variant doubles memory; only at sizes that fit comfortably
        buf16 = StepBuffer(C, D, dtype=torch.float16, metric=metric)
        buf16.add(buf.embeddings, buf.payload_ids, buf.group_ids)
    q = torch.randn(Q, D, generator=g)
    excl = torch.randint(0, N_GROUPS, (Q,), generator=g)
    keys = buf.embeddings
    fns = {
        "ours": lambda: buf.search(q, k),
        "ours_excl": lambda: buf.search(q, k, exclude_groups=excl),
        "torch": lambda: _torch_topk(keys, q, k, metric, 65_536),
    }
    if buf16 is not None:
        fns["ours_fp16"] = lambda: buf16.search(q, k)
    index = None
    if faiss_mod is not None and metric in ("ip", "l2"):
        index = (faiss_mod.IndexFlatIP if metric == "ip" else faiss_mod.IndexFlatL2)(D)
        index.add(keys.numpy())
        qn = q.numpy()
        fns["faiss_flat"] = lambda: index.search(qn, k)
        # Our op over faiss's own copy of the keys: the same bytes in the same pages, so that a difference between the
        # two is the kernels' and not where the two buffers' pages landed (worth up to 20% at Q=1 here, NOTES).
        from rapo_fast.retrieval.op import METRIC_CODES, retrieval_search

        xb = torch.from_numpy(faiss_mod.rev_swig_ptr(index.get_xb(), C * D).reshape(C, D))
        aux, grp = buf._aux[:C], buf._group[:C]
        fns["ours_faiss_mem"] = lambda: retrieval_search(xb, aux, grp, q, None, k, METRIC_CODES[metric], float("-inf"))
    ref_s, ref_p = buf.search(q, k)
    agree = {"ours": 1.0, "ours_excl": float("nan"), "torch": _agree(_torch_topk(keys, q, k, metric, 65_536)[1], ref_p)}
    if buf16 is not None:
        agree["ours_fp16"] = _agree(buf16.search(q, k)[1], ref_p)
    if index is not None:
        agree["faiss_flat"] = _agree(torch.from_numpy(index.search(q.numpy(), k)[1]), ref_p)
        slots = fns["ours_faiss_mem"]()[1]  # slots = payload ids here (payload i sits in slot i)
        agree["ours_faiss_mem"] = _agree(slots, ref_p)
    res = _time_round_robin(fns, repeats)
    rows = []
    for name, r in res.items():
        rows.append(
            dict(
                provider=name,
                metric=metric,
                dtype="float16" if name == "ours_fp16" else "float32",
                C=C,
                D=D,
                Q=Q,
                k=k,
                qps=Q / (r["median_ms"] * 1e-3),
                agree=round(agree[name], 4),
                **r,
            )
        )
    base = res.get("faiss_flat", res["torch"])["median_ms"]
    for row in rows:
        row["ratio_vs_faiss" if "faiss_flat" in res else "ratio_vs_torch"] = round(row["median_ms"] / base, 3)
    return rows


_GPU_BUF: dict = {}


def _forced(backend: str, fn, *args):
    """fn(*args) with RAPO_FAST_RETRIEVAL_BACKEND set to `backend` (the override the search reads per call)."""
    from rapo_fast.retrieval.triton_search import BACKEND_ENV

    before = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = backend
    try:
        return fn(*args)
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before


def _gpu_case(C, D, Q, k, metric, device, bw_gbs, rep_ms: int = 200) -> list[dict]:
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
    keys = buf.embeddings
    free, _ = torch.cuda.mem_get_info(device)
    # Score chunk [Q, chunk] in fp16 + its fp32 copy within an eighth of free memory each, so topk's workspace fits too.
    chunk = int(max(4096, min(C, free // 8 // max(1, Q * 4))))
    fns = {
        "ours": lambda: buf.search(q, k),
        "ours_excl": lambda: buf.search(q, k, exclude_groups=excl),
        "torch": lambda: _torch_topk(keys, q, k, metric, chunk),
        # `ours` follows the crossover table; these two force each backend (rapo_fast/retrieval/triton_search.py).
        "ours_triton": lambda: _forced("triton", buf.search, q, k),
        "ours_cuda": lambda: _forced("cuda", buf.search, q, k),
    }
    _, ref_p = buf.search(q, k)
    agree = {"ours": 1.0, "ours_excl": float("nan"), "torch": _agree(_torch_topk(keys, q, k, metric, chunk)[1], ref_p)}
    agree.update({n: _agree(fns[n]()[1], ref_p) for n in ("ours_triton", "ours_cuda")})
    floor_ms = C * D * 2 / (bw_gbs * 1e9) * 1e3
    rows = []
    for name, fn in fns.items():
        r = time_fn(fn, device, rep_ms=rep_ms)
        rows.append(
            dict(
                provider=name,
                metric=metric,
                dtype="float16",
                C=C,
                D=D,
                Q=Q,
                k=k,
                qps=Q / (r["median_ms"] * 1e-3),
                agree=round(agree[name], 4),
                pct_of_copy_bw=round(100 * floor_ms / r["median_ms"], 1),
                **r,
            )
        )
    rows.append(
        dict(
            provider="floor",
            metric=metric,
            dtype="float16",
            C=C,
            D=D,
            Q=Q,
            k=k,
            median_ms=floor_ms,
            qps=Q / (floor_ms * 1e-3),
            copy_bw_gbs=round(bw_gbs, 1),
        )
    )
    base = rows[2]["median_ms"]
    for row in rows:
        row["ratio_vs_torch"] = round(row["median_ms"] / base, 3)
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rapo-fast bench retrieval", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: every provider at two tiny shapes (C <= 20k keys; seconds, the times mean nothing)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="run on the first CUDA device (ours, torch and the bandwidth floor; fp16 keys) instead of the CPU",
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
    add_grid_args(p, "C,D,Q,k", providers=False)
    add_output_args(p, "retrieval_cpu.csv (retrieval_gpu.csv with --gpu)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpu and not torch.cuda.is_available():
        p.error("--gpu: no CUDA device is visible")
    out = output_dir(args, "retrieval")
    rows = _run_gpu(args) if args.gpu else _run_cpu(args)
    path = append_rows("retrieval_gpu" if args.gpu else "retrieval_cpu", rows, out)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


def _run_gpu(args: argparse.Namespace) -> list[dict]:
    stamp = dict(date=now(), commit=commit())
    device = torch.device("cuda", 0)
    bw = measure_copy_bandwidth_gbs(device)
    shapes = args.shape or (QUICK if args.quick else (PAPER if args.paper_only else PAPER + GRID_FULL))
    rows = []
    for C, D, Q, k in shapes:
        case = _gpu_case(C, D, Q, k, args.metric, device, bw, args.rep_ms or 200)
        rows += [dict(device=device_name(device), **stamp, **r) for r in case]
        _print(case)
    return rows


def _run_cpu(args: argparse.Namespace) -> list[dict]:
    stamp = dict(date=now(), commit=commit())
    # faiss-cpu bundles its own OpenBLAS, whose threads would otherwise oversubscribe the cores next to faiss's OpenMP
    # threads (measured here: 2-4x slower on a loaded 2-core machine); it reads this variable when faiss is imported.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(torch.get_num_threads()))
    try:
        import faiss
    except ImportError:
        faiss = None
    from rapo_fast._ext import extension

    if faiss is not None:
        faiss.omp_set_num_threads(torch.get_num_threads())
    if args.quick or args.small_q or args.paper_only:
        shapes = QUICK if args.quick else SMALL_Q if args.small_q else PAPER
    else:
        shapes = PAPER + SMALL_Q + GRID_CPU
    shapes = args.shape or shapes
    repeats = args.repeats or (3 if args.quick else 5)
    isa = extension().retrieval_cpu_isa(-1)
    rows = []
    for C, D, Q, k in shapes:
        load = os.getloadavg()[0]
        case = _cpu_case(C, D, Q, k, args.metric, repeats, faiss)
        extra = dict(
            device=device_name(torch.device("cpu")),
            **stamp,
            isa=isa,
            threads=torch.get_num_threads(),
            load_avg_1m=round(load, 2),
        )
        rows += [dict(extra, **r) for r in case]
        _print(case)
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        ratio = r.get("ratio_vs_faiss", r.get("ratio_vs_torch"))
        print(
            f"C={r['C']:>8} D={r['D']:>4} Q={r['Q']:>5} k={r['k']:>3} {r['provider']:>11}: "
            f"{r['median_ms']:10.2f} ms  {r['qps']:12.0f} q/s  ratio {ratio}  agree {r.get('agree', '')}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
