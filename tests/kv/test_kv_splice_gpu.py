"""CUDA backend of the KV splice (runs only on a machine with a GPU; every test is marked gpu and skipped without one).

Checks: the CUDA kernel equals the CPU backend and the float64 reference (docs/testing.md rule 1) on HF-layout and paged
caches, fp32/fp16/bf16, both pair layouts, the 16-byte vector path (head dim 128) and the scalar path (odd head dim,
misaligned strides), positions up to 10^6; values bit-exact; a tiny Llama on the GPU splices and continues generation.
Not here: CPU numerics (tests/kv/test_kv_splice.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose, assert_within_ref_error
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from rapo_fast.kv.splice import PagedKVCache, RopeSpec, StepKVStore, insert_segment, splice_kv

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _setup(n_layers, heads, d, dtype, lengths, device):
    store = StepKVStore(n_layers, heads, d, dtype=dtype, device=device)
    ks = [torch.randn(n_layers, n, heads, d, device=device).to(dtype) for n in lengths]
    vs = [torch.randn(n_layers, n, heads, d, device=device).to(dtype) for n in lengths]
    store.add(list(range(len(lengths))), ks, vs)
    return store


def _to(store: StepKVStore, device, dtype=None) -> StepKVStore:
    out = StepKVStore(store.num_layers, store.num_kv_heads, store.head_dim, dtype=dtype or store.dtype, device=device)
    for pid in store.payload_ids():
        k, v = store.get(pid)
        out.add([pid], [k.to(device)], [v.to(device)])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("d,rd", [(128, 128), (128, 64), (59, 58), (80, 32)])
def test_cuda_matches_cpu_and_fp64_hf_layout(dtype, layout, d, rd):
    n_layers, heads, b, s = 3, 4, 5, 300
    store = _setup(n_layers, heads, d, dtype, [17, 1, 128, 64], "cuda")
    rope = RopeSpec.from_theta(d, 10000.0, rotary_dim=rd, layout=layout)
    reqs = [(0, 0, 3), (1, 0, 40), (2, 1, 100), (3, 4, 236), (2, 3, 0)]
    deltas = [3, 40, 1_000_000, 236, 0]
    base = [
        (torch.randn(b, heads, s, d, device="cuda").to(dtype), torch.randn(b, heads, s, d, device="cuda").to(dtype))
        for _ in range(n_layers)
    ]
    gpu = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in base])
    cpu = DynamicCache(ddp_cache_data=[(k.cpu(), v.cpu()) for k, v in base])
    f64 = DynamicCache(ddp_cache_data=[(k.cpu().float(), v.cpu().float()) for k, v in base])
    splice_kv(gpu, store, reqs, rope, rope_positions=deltas, backend="cuda")
    splice_kv(cpu, _to(store, "cpu"), reqs, rope, rope_positions=deltas, backend="cpu")
    splice_kv(f64, _to(store, "cpu", torch.float32), reqs, rope, rope_positions=deltas, backend="reference")
    torch.cuda.synchronize()
    for layer in range(n_layers):
        assert_within_ref_error(
            gpu.layers[layer].keys, cpu.layers[layer].keys, f64.layers[layer].keys, dtype, name=f"K{layer}"
        )
        assert torch.equal(gpu.layers[layer].values.cpu(), cpu.layers[layer].values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_paged_matches_cpu(dtype):
    n_layers, heads, d, bs, nb = 2, 8, 128, 16, 64
    store = _setup(n_layers, heads, d, dtype, [40, 16, 5], "cuda")
    rope = RopeSpec.from_theta(d, 500000.0)
    table = torch.randperm(nb)[:48].view(4, 12).to(torch.int32)
    reqs = [(0, 0, 7), (1, 1, 16), (2, 3, 180), (0, 2, 100)]
    kk = torch.randn(n_layers, nb, bs, heads, d).to(dtype)
    vv = torch.randn(n_layers, nb, bs, heads, d).to(dtype)
    gpu = PagedKVCache(kk.cuda(), vv.cuda(), table.cuda())
    cpu = PagedKVCache(kk.clone(), vv.clone(), table)
    splice_kv(gpu, store, reqs, rope, backend="cuda")
    splice_kv(cpu, _to(store, "cpu"), reqs, rope, backend="cpu")
    assert_close_verbose(gpu.keys.cpu(), cpu.keys, atol=1e-5 if dtype == torch.float32 else 1e-2, name="paged K")
    assert torch.equal(gpu.values.cpu(), cpu.values)


def test_cuda_llama_splice_and_generate():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=1000,
    )
    model = LlamaForCausalLM(cfg).eval().cuda()
    store = StepKVStore.for_model(model)
    seg = list(range(100, 140))
    store.add_from_model(model, [5], [seg])
    ctx = torch.randint(0, 1000, (2, 50), device="cuda")
    logits = {}
    for mode in ("exact", "splice"):
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
        r = insert_segment(model, cache, [seg, seg], [0, 1], [50, 50], mode=mode, store=store, payload_ids=[5, 5])
        logits[mode] = r.logits
        if mode == "splice":
            full = DynamicCache(config=cfg)
            with torch.no_grad():
                model(input_ids=torch.cat([ctx, torch.tensor([seg, seg], device="cuda")], 1), past_key_values=full)
            assert_close_verbose(cache.layers[0].keys, full.layers[0].keys, atol=1e-4, name="layer-0 K on cuda")
    kl = (
        torch.log_softmax(logits["exact"], -1).exp()
        * (torch.log_softmax(logits["exact"], -1) - torch.log_softmax(logits["splice"], -1))
    ).sum(-1)
    print(f"cuda tiny llama: KL(exact || splice) = {kl.mean().item():.4g}")
    assert torch.isfinite(kl).all()
