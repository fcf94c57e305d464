"""KV splice time (rapo_fast.splice_kv) against re-prefill, a plain-torch splice and the copy-bandwidth floor.

Providers, side by side in one run at one shape (segments x tokens into a batch of HF-layout caches, all layers):
- `rapo_fast`: rapo_fast.splice_kv (CUDA kernel on GPU, C++/OpenMP on CPU), one call for all segments and layers.
- `torch_plain`: what one writes without us: per layer, gather the segments from the pool, rotate with cos/sin
  tables (fp32), scatter into the cache by advanced indexing.
- `reprefill`: running the segments' tokens through a model of the same shape (what mode="exact" costs).
- `copy_floor`: the bytes the splice must move (pool read + cache write, K and V) over the measured copy bandwidth.
GPU shape: 32 layers, 8 KV heads, head dim 128, bf16, 256 segments x 128 tokens into 64 caches, 7B-shaped prefill
model. CPU: the same structure scaled down (printed in the CSV). Usage: `rapo-fast bench kv [--gpu] [--quick] [--plot]
[--out DIR | --record]` (or `python bench/bench_kv_splice.py ...`); rows (with device, date and commit) are appended
to <DIR>/kv_splice.csv, to bench/results/kv_splice.csv with --record, or to a new temporary folder. Readings in
bench/NOTES_kv.md.
What this is not: a correctness test (tests/kv/); providers are only cross-checked loosely.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_output_args,
    append_rows,
    commit,
    device_name,
    measure_copy_bandwidth_gbs,
    now,
    output_dir,
    time_fn,
)

SHAPES = {
    "gpu": dict(
        layers=32,
        kv_heads=8,
        head_dim=128,
        segs=256,
        seg_len=128,
        batch=64,
        hidden=4096,
        heads=32,
        inter=11008,
        vocab=32000,
    ),
    "cpu": dict(
        layers=8, kv_heads=2, head_dim=64, segs=32, seg_len=32, batch=8, hidden=256, heads=4, inter=688, vocab=1000
    ),
    "cpu_quick": dict(
        layers=4, kv_heads=2, head_dim=64, segs=16, seg_len=16, batch=4, hidden=256, heads=4, inter=688, vocab=1000
    ),
}


def _build(shape: dict, dtype: torch.dtype, device: torch.device):
    from transformers import DynamicCache

    from rapo_fast.kv.splice import RopeSpec, StepKVStore

    nl, h, d, r, t, b = (shape[k] for k in ("layers", "kv_heads", "head_dim", "segs", "seg_len", "batch"))
    per_row = -(-r // b)
    s = per_row * t + 16
    store = StepKVStore(nl, h, d, dtype=dtype, device=device, capacity_tokens=r * t)
    store.keys_pool.normal_()
    store.values_pool.normal_()
    store._where = {i: (i * t, t) for i in range(r)}  # fill the pool in place: the bench times splicing, not adding
    store._free = []
    cache = DynamicCache(
        ddp_cache_data=[
            (torch.zeros(b, h, s, d, dtype=dtype, device=device), torch.zeros(b, h, s, d, dtype=dtype, device=device))
            for _ in range(nl)
        ]
    )
    reqs = [(i, i % b, (i // b) * t) for i in range(r)]
    return store, cache, reqs, RopeSpec.from_theta(d, 500000.0)


def _torch_plain(cache, store, reqs, rope):
    """Batched plain-torch splice: per layer, one gather, one fp32 rotation, one scatter for all segments."""
    t = store.locate(reqs[0][0])[1]
    dev = store.device
    src = torch.tensor([store.locate(p)[0] for p, _, _ in reqs], device=dev)[:, None] + torch.arange(t, device=dev)
    rows = torch.tensor([r for _, r, _ in reqs], device=dev)[:, None].expand(-1, t)
    slots = torch.tensor([p for _, _, p in reqs], device=dev)[:, None] + torch.arange(t, device=dev)
    ang = slots[:, :1].double()[..., None] * rope.inv_freq_on(dev).double()  # [R, 1, P]
    cos, sin = torch.cos(ang).float()[:, :, None], torch.sin(ang).float()[:, :, None]  # [R, 1, 1, P]
    half = rope.rotary_dim // 2
    for layer, lay in enumerate(cache.layers):
        k = store.keys_pool[layer][src].float()  # [R, T, H, D]
        k1, k2 = k[..., :half], k[..., half:]
        k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1).to(store.dtype)
        lay.keys[rows, :, slots] = k
        lay.values[rows, :, slots] = store.values_pool[layer][src]


def _prefill_model(shape: dict, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapo_fast.kv.splice import RopeSpec

    cfg = LlamaConfig(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["inter"],
        vocab_size=shape["vocab"],
        head_dim=shape["head_dim"],
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        # to_empty left the non-persistent rotary buffer uninitialised: refill it from the config
        model.model.rotary_emb.inv_freq.copy_(RopeSpec.from_config(cfg).inv_freq)
    return model


def run(device: torch.device, shape_name: str, out: Path, plot: bool, rep_ms: int | None = None) -> list[dict]:
    from rapo_fast.kv.splice import splice_kv

    shape = SHAPES[shape_name]
    dtype = torch.bfloat16
    store, cache, reqs, rope = _build(shape, dtype, device)
    nl, h, d, r, t = (shape[k] for k in ("layers", "kv_heads", "head_dim", "segs", "seg_len"))
    nbytes = 2 * 2 * nl * r * t * h * d * dtype.itemsize  # K and V, read from the pool and written to the cache
    backend = "cuda" if device.type == "cuda" else "cpu"
    bw = measure_copy_bandwidth_gbs(device)
    reps = {} if rep_ms is None else {"rep_ms": rep_ms}
    res = {"rapo_fast": time_fn(lambda: splice_kv(cache, store, reqs, rope, backend=backend), device, **reps)}
    got = [lay.keys.clone() for lay in cache.layers[:1]]
    res["torch_plain"] = time_fn(lambda: _torch_plain(cache, store, reqs, rope), device, **reps)
    diff = (cache.layers[0].keys.float() - got[0].float()).abs().max().item()
    if diff > 0.1:
        raise RuntimeError(f"providers disagree (max |diff| {diff}); not posting times")
    model = _prefill_model(shape, dtype, device)
    ids = torch.randint(0, shape["vocab"], (r, t), device=device)

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)

    prefill_ms = rep_ms or (400 if device.type == "cuda" else 1000)
    res["reprefill"] = time_fn(prefill, device, rep_ms=prefill_ms, min_runs=3)
    floor_ms = nbytes / (bw * 1e9) * 1e3
    rows = []
    meta = dict(
        device=device_name(device),
        date=now(),
        commit=commit(),
        shape=shape_name,
        shape_desc=f"L{nl} Hkv{h} D{d} {r}x{t} into B{shape['batch']}",
        dtype="bf16",
        bytes=nbytes,
        copy_bw_gbs=round(bw, 2),
    )
    for prov, tm in [*res.items(), ("copy_floor", {"median_ms": floor_ms, "p20_ms": floor_ms, "p80_ms": floor_ms})]:
        ms = tm["median_ms"]
        rows.append(
            dict(
                meta,
                provider=prov,
                median_ms=round(ms, 4),
                p20_ms=round(tm["p20_ms"], 4),
                p80_ms=round(tm["p80_ms"], 4),
                gbs=round(nbytes / (ms * 1e-3) / 1e9, 2),
                pct_copy_bw=round(100 * floor_ms / ms, 1),
                ours_speedup=round(ms / res["rapo_fast"]["median_ms"], 2),
            )
        )
    for row in rows:
        print(
            f"{row['provider']:>12}: {row['median_ms']:10.3f} ms  {row['gbs']:8.2f} GB/s  "
            f"{row['pct_copy_bw']:5.1f}% of copy bw  (rapo_fast is {row['ours_speedup']}x faster)"
        )
    path = append_rows("kv_splice", rows, out)
    print(f"rows appended to {path}")
    if plot:
        _plot(rows, path.with_suffix(".png"))
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r["provider"] for r in rows], [r["median_ms"] for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel("median ms (log)")
    ax.set_title(f"KV splice, {rows[0]['shape_desc']}\n{rows[0]['device'][:60]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rapo-fast bench kv", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="run on the CUDA device at a 7B model's shape: 32 layers, 8 KV heads, head dim 128, 256 segments of "
        "128 tokens into 64 caches (default: the CPU at 8 layers, 32 segments of 32 tokens)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run at a smaller CPU shape (seconds; the times mean nothing)"
    )
    ap.add_argument("--plot", action="store_true", help="also draw the times as kv_splice.png next to the CSV")
    ap.add_argument(
        "--rep-ms",
        type=int,
        default=None,
        metavar="MS",
        help="time budget of each measurement in ms (default: 200, and 400 / 1000 for re-prefill on GPU / CPU)",
    )
    add_output_args(ap, "kv_splice.csv (and kv_splice.png with --plot)")
    args = ap.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        ap.error("--gpu: no CUDA device is visible")
    out = output_dir(args, "kv")
    if args.gpu:
        run(torch.device("cuda"), "gpu", out, args.plot, args.rep_ms)
    else:
        run(torch.device("cpu"), "cpu_quick" if args.quick else "cpu", out, args.plot, args.rep_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
