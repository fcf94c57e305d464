"""Small cases of every kernel the GPU run launches, for compute-sanitizer (memcheck, racecheck) to watch: the CUDA
retrieval kernels (score_topk_kernel on the WMMA fp16/bf16 and FMA fp32 paths, the few-query split path and its
merge_kernel, filters), the Triton retrieval kernel, the CUDA KV splice (HF layout, vector and scalar paths; paged),
and the Triton loss kernels (token log-probs and policy loss, forward and backward, logits and hidden paths).

Each case runs on `--device` (cuda under the sanitizer; cpu in the smoke run, which checks the script itself) and
compares with the CPU backend or reference loosely: the sanitizer looks for bad accesses and races, the tests
(pytest -m gpu) grade the numbers. Prints `case NAME ok` or `case NAME FAILED: ...`; exits 1 if any failed.
Usage: `python bench/gpu/sanitizer_cases.py --device cuda [--cases A,B]`. What this is not: a test (no assertion of
exactness) nor a benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

CASES = (
    "retrieval_ip_fp16_many",
    "retrieval_cosine_bf16_many",
    "retrieval_l2_fp32",
    "retrieval_few_queries_splits",
    "retrieval_filters",
    "retrieval_triton",
    "kv_splice_hf_vector",
    "kv_splice_hf_scalar",
    "kv_splice_paged",
    "loss_logits",
    "loss_hidden",
)


def _search(dev, c, d, q, k, dtype, metric="ip", backend="cuda", filters=False):
    import torch

    from rapo_fast import StepBuffer

    g = torch.Generator().manual_seed(c + d + q)
    keys, qs = torch.randn(c, d, generator=g), torch.randn(q, d, generator=g)
    groups = torch.randint(0, 7, (c,), generator=g)
    exclude = torch.randint(-1, 7, (q,), generator=g)
    out = []
    for device in (dev, "cpu"):
        buf = StepBuffer(c + 3, d, dtype=dtype, device=device, metric=metric)
        buf.add(keys.to(device), torch.arange(c, device=device), groups.to(device))
        kw = dict(exclude_groups=exclude.to(device), min_score=-0.5) if filters else {}
        # The forced backend applies to CUDA tensors only (the CPU has one backend); set for this search alone.
        forced = backend is not None and device != "cpu"
        if forced:
            os.environ["RAPO_FAST_RETRIEVAL_BACKEND"] = backend
        try:
            s, _ = buf.search(qs.to(device), k, **kw)
        finally:
            if forced:
                os.environ.pop("RAPO_FAST_RETRIEVAL_BACKEND", None)
        out.append(s.cpu())
    a, b = out
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin) or not torch.allclose(a[fin], b[fin], rtol=2e-2, atol=2e-2):
        raise AssertionError(f"scores differ from the CPU backend by {(a[fin] - b[fin]).abs().max():.3g}")


def _splice(dev, d, paged):
    import torch

    from rapo_fast.kv.splice import PagedKVCache, RopeSpec, StepKVStore, splice_kv

    layers, heads, dtype = 2, 4, torch.bfloat16
    store = StepKVStore(layers, heads, d, dtype=dtype, device=dev)
    lens = [17, 1, 40]
    store.add([0, 1, 2], *([torch.randn(layers, n, heads, d).to(dtype).to(dev) for n in lens] for _ in range(2)))
    rope = RopeSpec.from_theta(d, 10000.0, rotary_dim=d - d % 2)
    if paged:
        bs, nb = 16, 24
        table = torch.randperm(nb)[:16].view(4, 4).to(torch.int32).to(dev)
        kk, vv = (torch.randn(layers, nb, bs, heads, d).to(dtype).to(dev) for _ in range(2))
        splice_kv(PagedKVCache(kk, vv, table), store, [(0, 0, 7), (1, 1, 16), (2, 3, 20)], rope, backend="auto")
        return
    from transformers import DynamicCache

    base = [tuple(torch.randn(3, heads, 80, d).to(dtype).to(dev) for _ in range(2)) for _ in range(layers)]
    cache = DynamicCache(ddp_cache_data=base)
    splice_kv(cache, store, [(0, 0, 3), (1, 0, 40), (2, 2, 30)], rope, backend="auto")


def _loss(dev, hidden):
    import torch

    import rapo_fast

    g = torch.Generator().manual_seed(1)
    n, h, v = 37, 48, 1003
    y = torch.randint(0, v, (n,), generator=g).to(dev)
    adv, old = torch.randn(n, generator=g).to(dev), -torch.rand(n, generator=g).to(dev) * 5
    mask = (torch.rand(n, generator=g) > 0.2).float().to(dev)
    dtype = torch.bfloat16 if dev != "cpu" else torch.float32
    if hidden:
        x = torch.randn(n, h, generator=g).to(dtype).to(dev).requires_grad_()
        w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).to(dev).requires_grad_()
        loss = rapo_fast.rapo_loss(hidden=x, weight=w, targets=y, old_logp=old, advantages=adv, loss_mask=mask)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.backward()
        return
    z = torch.randn(n, v, generator=g).to(dtype).to(dev).requires_grad_()
    lp, ent = rapo_fast.token_logprobs(z, targets=y, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    z.grad = None
    loss = rapo_fast.rapo_loss(z, targets=y, old_logp=old, advantages=adv, loss_mask=mask)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()


def run_case(name: str, dev: str) -> None:
    import torch

    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    table = {
        "retrieval_ip_fp16_many": lambda: _search(dev, 3001, 72, 130, 5, f16),
        "retrieval_cosine_bf16_many": lambda: _search(dev, 2049, 64, 70, 9, bf16, "cosine"),
        "retrieval_l2_fp32": lambda: _search(dev, 1999, 40, 33, 4, f32, "l2"),
        "retrieval_few_queries_splits": lambda: _search(dev, 60001, 64, 2, 7, f16),
        "retrieval_filters": lambda: _search(dev, 3000, 32, 40, 6, f16, filters=True),
        "retrieval_triton": lambda: _search(dev, 3001, 64, 300, 5, f16, backend="triton"),
        "kv_splice_hf_vector": lambda: _splice(dev, 128, paged=False),
        "kv_splice_hf_scalar": lambda: _splice(dev, 59, paged=False),
        "kv_splice_paged": lambda: _splice(dev, 128, paged=True),
        "loss_logits": lambda: _loss(dev, hidden=False),
        "loss_hidden": lambda: _loss(dev, hidden=True),
    }
    table[name]()
    if dev != "cpu":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    args = p.parse_args(argv)
    bad = 0
    for name in [c for c in args.cases.split(",") if c]:
        if name not in CASES:
            p.error(f"unknown case {name!r}")
        try:
            run_case(name, args.device)
            print(f"case {name} ok", flush=True)
        except Exception as exc:  # every case runs; the sanitizer's report and this line say which failed
            traceback.print_exc()
            print(f"case {name} FAILED: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
