"""Tests of the registered tensor-level op `rapo_fast::kv_splice_` (rapo_fast/kv/splice.py), on CPU tensors.

Checks: torch.library.opcheck (schema, fake, mutation declarations, autograd registration, AOT dispatch) for the HF
and paged layouts; a torch.compile(fullgraph=True) function calling the op on plain tensors leaves the same caches as
eager and as splice_kv's reference backend. Not here: splice_kv's argument checks and numerics
(tests/kv/test_kv_splice.py), models (tests/kv/test_kv_splice_hf.py), CUDA (tests/kv/test_kv_splice_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from rapo_fast import _ext
from rapo_fast.kv.splice import kv_splice_
from rapo_fast.reference.kv_splice import rotate_keys_ref

pytestmark = pytest.mark.skipif(
    not (_ext.has_extension() and hasattr(_ext.extension(), "kv_splice_cpu")), reason="rapo_fast._C without kv_splice"
)

LAYERS, HEADS, D, B, S = 2, 2, 16, 3, 12


def _inputs(dtype=torch.float32, paged=False, interleaved=False):
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(LAYERS, 10, HEADS, D, generator=g).to(dtype)
    v_pool = torch.randn(LAYERS, 10, HEADS, D, generator=g).to(dtype)
    # (pool offset, tokens, batch row, slot, rope delta)
    requests = torch.tensor([[0, 4, 0, 2, 2], [4, 3, 2, 0, 5], [7, 3, 1, 5, 9]], dtype=torch.int64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12))  # partial rotary: 12 of 16
    if paged:
        bs, nb = 4, 10
        keys = [torch.randn(nb, bs, HEADS, D, generator=g).to(dtype) for _ in range(LAYERS)]
        values = [torch.randn(nb, bs, HEADS, D, generator=g).to(dtype) for _ in range(LAYERS)]
        block_table = torch.tensor([[3, 1, 7], [0, 9, 2], [5, 4, 6]], dtype=torch.int32)
    else:
        keys = [torch.randn(B, HEADS, S, D, generator=g).to(dtype) for _ in range(LAYERS)]
        values = [torch.randn(B, HEADS, S, D, generator=g).to(dtype) for _ in range(LAYERS)]
        block_table = None
    return keys, values, k_pool, v_pool, requests, inv_freq, block_table, interleaved, 4


def _expected_hf(args):
    keys, values, k_pool, v_pool, requests, inv_freq, _bt, interleaved, _mt = args
    ek, ev = [k.clone() for k in keys], [v.clone() for v in values]
    for off, n, row, slot, delta in requests.tolist():
        for layer in range(LAYERS):
            rk = rotate_keys_ref(
                k_pool[layer, off : off + n],
                delta,
                inv_freq,
                rotary_dim=2 * inv_freq.numel(),
                layout="interleaved" if interleaved else "rotate_half",
            )
            ek[layer][row, :, slot : slot + n] = rk.transpose(0, 1).to(ek[layer].dtype)
            ev[layer][row, :, slot : slot + n] = v_pool[layer, off : off + n].transpose(0, 1)
    return ek, ev


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_opcheck(paged, interleaved):
    torch.library.opcheck(torch.ops.rapo_fast.kv_splice_.default, _inputs(paged=paged, interleaved=interleaved))


def test_eager_op_matches_reference():
    args = _inputs()
    ek, ev = _expected_hf(args)
    kv_splice_(*args)
    for layer in range(LAYERS):
        torch.testing.assert_close(args[0][layer], ek[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(args[1][layer], ev[layer], rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph_matches_eager(paged, dtype):
    def step(keys, values, k_pool, v_pool, requests, inv_freq, block_table):
        # Ops around the splice so that the compiled graph is more than the op alone.
        kv_splice_(keys, values, k_pool * 1, v_pool, requests, inv_freq, block_table, False, 4)
        return keys[0].float().sum() + values[-1].float().sum()

    eager = _inputs(dtype=dtype, paged=paged)
    comp = _inputs(dtype=dtype, paged=paged)
    torch._dynamo.reset()
    out_e = step(*eager[:7])
    out_c = torch.compile(step, fullgraph=True)(*comp[:7])
    for a, b in zip(eager[0] + eager[1], comp[0] + comp[1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(out_c, out_e)
