"""KV splice time (rapo_fast.splice_kv) against re-prefill, a plain-torch splice and the copy-bandwidth floor.

Providers, side by side in one run at one shape (segments x tokens into a batch of HF-layout caches, all layers):
- `rapo_fast`: rapo_fast.splice_kv (CUDA kernel on GPU, C++/OpenMP on CPU), one call for all segments and layers.
- `torch_plain`: what one writes without us: per layer, gather the segments from the pool, rotate with cos/sin
  tables (fp32), scatter into the cache by advanced indexing.
- `reprefill`: running the segments' tokens through a model of the same shape (what mode="exact" costs).
- `copy_floor`: the bytes the splice must move (pool read + cache write, K and V) over the measured copy bandwidth.
GPU shape: 32 layers, 8 KV heads, head dim 128, bf16, 256 segments x 128 tokens into 64 caches, 7B-shaped prefill
model. CPU: the same structure scaled down (printed in the CSV). Rows, errors, `--plan`, `--out`/`--record` and the
plot (bench/plot_kv.py): as every bench (bench/_common.py); CSV kv_splice.csv. `time_over_rapo_fast` = this row's
median_ms / rapo_fast's in the same run (blank in rows before rapo_fast's). The two splices are each checked, untimed,
against rapo_fast.reference.kv_splice on layer 0, whatever their order. Readings in bench/NOTES_kv.md.
What this is not: a correctness test (tests/kv/); providers are only cross-checked loosely.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_kv import plot  # noqa: E402

from _args import add_bench_args, add_grid_args, check_providers, ordered  # noqa: E402
from _common import RowWriter, error_status, exit_process, measure_copy_bandwidth_gbs, run_bench, time_fn  # noqa: E402

PROVIDERS = ["rapo_fast", "torch_plain", "reprefill", "copy_floor"]
DIMS = ("layers", "kv_heads", "head_dim", "segs", "seg_len", "batch")  # the shape's fields in each row and plan line
COLUMNS = ["shape_desc", "dtype", "bytes", "copy_bw_gbs", "median_ms", "p20_ms", "p80_ms", "gbs", "pct_copy_bw"]
COLUMNS += ["samples", "time_over_rapo_fast", "max_abs_diff"]
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
    g = torch.Generator(device=device).manual_seed(0)  # on the device, deterministic per device
    store.keys_pool.normal_(generator=g)
    store.values_pool.normal_(generator=g)
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


def _key(provider: str, shape_name: str) -> dict:
    return dict(provider=provider, shape=shape_name, **{k: SHAPES[shape_name][k] for k in DIMS})


def _reference_layer0(store, cache, reqs, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's keys and values after the splice, from the library's reference rotation, one segment at a time
    (untimed): what both splices are checked against, whichever runs first."""
    from rapo_fast.reference.kv_splice import rotate_keys_ref

    keys = torch.zeros_like(cache.layers[0].keys)
    values = torch.zeros_like(cache.layers[0].values)
    inv = rope.inv_freq_on(store.device)
    for pid, row, pos in reqs:
        start, t = store.locate(pid)
        k = store.keys_pool[0][start : start + t]  # [T, H, D], stored at rotation 0..T-1
        k = rotate_keys_ref(k, pos, inv, rotary_dim=rope.rotary_dim, layout=rope.layout)
        keys[row, :, pos : pos + t] = k.transpose(0, 1)
        values[row, :, pos : pos + t] = store.values_pool[0][start : start + t].transpose(0, 1)
    return keys, values


def _splice_row(fn, row: dict, cache, ref, device, reps: dict) -> dict:
    """Check one splice on layer 0 against the reference (the cache's layer 0 cleared first, so a splice that writes
    nothing is caught), then time it."""
    phase = "first call"
    try:
        lay = cache.layers[0]
        lay.keys.zero_()
        lay.values.zero_()
        fn()
        phase = "check"
        diff = float((lay.keys.float() - ref[0].float()).abs().max())
        wrong_values = int((lay.values != ref[1]).sum())  # a copy: exact
        row["max_abs_diff"] = round(diff, 5)
        status = "ok"
        if diff > 0.1 or wrong_values:
            status = f"DISAGREES: layer 0 keys max |diff| {diff:.3g}, {wrong_values} values differ from the reference"
        phase = "timing"
        row.update(time_fn(fn, device, **reps), status=status)
    except Exception as exc:
        row["status"] = error_status(exc, phase)
    return row


def _prefill_row(shape: dict, row: dict, dtype, device, rep_ms: int | None) -> dict:
    """Re-prefill: the segments' tokens through a model of the same shape (what mode="exact" costs)."""
    phase = "setup"
    try:
        model = _prefill_model(shape, dtype, device)
        g = torch.Generator(device=device).manual_seed(1)
        ids = torch.randint(0, shape["vocab"], (shape["segs"], shape["seg_len"]), generator=g, device=device)

        def prefill():
            with torch.no_grad():
                model(input_ids=ids, use_cache=True)

        phase = "timing"
        ms = rep_ms or (400 if device.type == "cuda" else 1000)
        row.update(time_fn(prefill, device, rep_ms=ms, min_runs=3), status="ok")
    except Exception as exc:
        row["status"] = error_status(exc, phase)
    return row


def _finish_row(row: dict, nbytes: int, floor_ms: float | None, ours_ms: float | None) -> dict:
    """Rounded times, GB/s, % of the copy floor and time over rapo_fast's (blank where unknown)."""
    if "median_ms" not in row:
        return row
    ms = row["median_ms"]
    row.update({k: round(row[k], 4) for k in ("median_ms", "p20_ms", "p80_ms")})
    row["gbs"] = round(nbytes / (ms * 1e-3) / 1e9, 2)
    if floor_ms:
        row["pct_copy_bw"] = round(100 * floor_ms / ms, 1)
    if ours_ms:
        row["time_over_rapo_fast"] = round(ms / ours_ms, 2)
    return row


def run(writer: RowWriter, device: torch.device, shape_name: str, names: list[str], rep_ms: int | None) -> None:
    from rapo_fast.kv.splice import splice_kv

    shape = SHAPES[shape_name]
    dtype = torch.bfloat16
    nl, h, d, r, t = (shape[k] for k in ("layers", "kv_heads", "head_dim", "segs", "seg_len"))
    nbytes = 2 * 2 * nl * r * t * h * d * dtype.itemsize  # K and V, read from the pool and written to the cache
    meta = dict(shape_desc=f"L{nl} Hkv{h} D{d} {r}x{t} into B{shape['batch']}", dtype="bf16", bytes=nbytes)
    try:
        store, cache, reqs, rope = _build(shape, dtype, device)
        bw = measure_copy_bandwidth_gbs(device)
        ref = _reference_layer0(store, cache, reqs, rope)
    except Exception as exc:
        status = error_status(exc, "inputs")
        for name in names:
            writer.write({**_key(name, shape_name), **meta, "status": status}, ("provider", "status"))
        return
    floor_ms = nbytes / (bw * 1e9) * 1e3
    meta["copy_bw_gbs"] = round(bw, 2)
    backend = "cuda" if device.type == "cuda" else "cpu"
    fns = {
        "rapo_fast": lambda: splice_kv(cache, store, reqs, rope, backend=backend),
        "torch_plain": lambda: _torch_plain(cache, store, reqs, rope),
    }
    reps = {} if rep_ms is None else {"rep_ms": rep_ms}
    ours_ms = None
    for name in names:
        row = {**_key(name, shape_name), **meta}
        if name in fns:
            row = _splice_row(fns[name], row, cache, ref, device, reps)
        elif name == "reprefill":
            row = _prefill_row(shape, row, dtype, device, rep_ms)
        else:  # copy_floor: the bytes over the measured copy bandwidth
            row.update(median_ms=floor_ms, p20_ms=floor_ms, p80_ms=floor_ms, status="ok")
        if name == "rapo_fast" and row["status"] == "ok":
            ours_ms = row["median_ms"]
        row = writer.write(_finish_row(row, nbytes, floor_ms, ours_ms))
        _print(row)


def _print(row: dict) -> None:
    if row.get("status") != "ok" and not str(row.get("status")).startswith("DISAGREES"):
        print(f"{row['provider']:>12}: {row['status']}", flush=True)
        return
    print(
        f"{row['provider']:>12}: {row['median_ms']:10.3f} ms  {row['gbs']:8.2f} GB/s  "
        f"{row['pct_copy_bw']:5.1f}% of copy bw  ({row['time_over_rapo_fast'] or '?'}x rapo_fast's time)  "
        f"{row['status']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rapo-fast bench kv", description=__doc__.split("\n")[0])
    add_bench_args(
        ap,
        quick="a smoke run at a smaller CPU shape (seconds; the times mean nothing)",
        gpu="run on the CUDA device at a 7B model's shape: 32 layers, 8 KV heads, head dim 128, 256 segments of "
        "128 tokens into 64 caches (default: the CPU at 8 layers, 32 segments of 32 tokens)",
        png="kv_splice.png",
        files="kv_splice.csv and kv_splice.png",
    )
    add_grid_args(ap, None)  # one shape per device; --rep-ms defaults to 200, and 400 / 1000 for re-prefill (GPU / CPU)
    args = ap.parse_args(argv)
    check_providers(ap, args.providers, PROVIDERS)
    shape_name = "gpu" if args.gpu else ("cpu_quick" if args.quick else "cpu")
    names = ordered(args.providers, PROVIDERS)
    keys = [_key(name, shape_name) for name in names]
    device = torch.device("cuda" if args.gpu else "cpu")
    rc, writer = run_bench(
        ap,
        args,
        keys,
        bench="kv",
        csv_name="kv_splice",
        device=device,
        columns=COLUMNS,
        body=lambda w: run(w, device, shape_name, names, args.rep_ms),
        plot=plot,
    )
    if writer is not None:
        print(f"rows appended to {writer.out_dir / 'kv_splice.csv'}")
    return rc


if __name__ == "__main__":
    exit_process(main())
