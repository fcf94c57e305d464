"""grad_W accumulation and tile sizing of the fused hidden-state loss (rapo_fast/loss/fused_linear.py, tiles in
rapo_fast/loss/tiles.py): the tile budget as a pure function of the free device memory (and the tile shape it gives
at the paper shape), balanced token tiles, tiles.accumulate_fp32 against fp64 (the fp32-output GEMM path and the
fallback), and the fused loss in fp32 / fp16 / bf16 on odd shapes against the fp64 reference with one token tile
(grad_W written directly, no fp32 [V, H] accumulator) and with several (the fp32 accumulator, through the GEMM's own
fp32 output where torch has it, else the fallback).

The fp32-output GEMM (torch.addmm(..., out_dtype=torch.float32, out=acc)) exists on CUDA only, not on the CPU in torch
2.13. On the CPU its branch is exercised by registering, for the test only, a CPU kernel of aten::addmm.dtype_out that
computes what cuBLAS does (an fp32 product of the bf16/fp16 inputs plus beta * self): that checks our calls (beta,
aliasing of out and self, slices), not cuBLAS. The real kernel is checked by the gpu-marked tests.
Not here: the fused loss's semantics and equality with the two-pass path (test_fused_linear_loss.py), its memory
(test_logprobs_memory.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.loss_cases import FULL, check_case, make_batch

from rapo_fast.loss import fused_linear as fl
from rapo_fast.loss import tiles

GiB, MiB = 1 << 30, 1 << 20
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------------------------------------- tile sizing
@pytest.mark.parametrize(
    "free, cap, expected",
    [
        (80 * GiB, 8 * GiB, 8 * GiB),  # plenty free: the cap
        (16 * GiB, 8 * GiB, 4 * GiB),  # the fraction (1/4) of the free memory
        (100 * MiB, 8 * GiB, 64 * MiB),  # almost nothing free: the floor
        (0, 8 * GiB, 64 * MiB),
        (80 * GiB, 32 * MiB, 32 * MiB),  # a cap below the floor wins
    ],
)
def test_budget_from_free(free, cap, expected):
    assert tiles.budget_from_free(free, cap) == expected


def test_budget_is_monotone_in_free_memory():
    budgets = [tiles.budget_from_free(f * GiB, 8 * GiB) for f in range(0, 100)]
    assert budgets == sorted(budgets)
    assert budgets[0] == tiles.MIN_TILE_BYTES and budgets[-1] == 8 * GiB


@pytest.mark.parametrize("n, max_rows, rows", [(1, 1, 1), (10, 4, 4), (9, 4, 3), (16384, 7061, 5462), (5, 100, 5)])
def test_balanced_rows(n, max_rows, rows):
    got = tiles.balanced_rows(n, max_rows)
    assert got == rows and got <= max(1, max_rows)
    assert -(-n // got) == -(-n // max(1, max_rows))  # as few tiles as max_rows allows


@pytest.mark.parametrize(
    "free, shape",
    [
        (70 * GiB, (16384, 152064)),  # an idle H100: the whole [N, V] bf16 logits (5 GB) in one token tile
        (8 * GiB, (5462, 152064)),  # 2 GiB budget: 7061 rows at most -> 3 balanced token tiles
        (1 * GiB, (863, 152064)),  # 256 MiB budget: 882 rows at most -> 19 balanced token tiles
    ],
)
def test_tile_shape_follows_free_device_memory(free, shape, monkeypatch):
    """The fused path's tile at the paper shape (N=16384, V=152064, bf16) on a CUDA device is a function of its free
    memory (monkeypatched: no device is needed to compute the shape)."""
    monkeypatch.setattr(tiles, "free_device_bytes", lambda device: free)
    assert fl.tile_shape(16384, 152064, 2, torch.device("cuda")) == shape
    # the two-pass path's [rows, MAX_VOCAB_TILE] tiles take the same budget
    rows, cols = tiles.vocab_tiles(16384, 152064, 2, torch.device("cuda"))
    assert cols == tiles.MAX_VOCAB_TILE["gpu"]
    assert rows == tiles.balanced_rows(16384, tiles.tile_budget(torch.device("cuda")) // (cols * 2))


def test_cpu_budget_is_fixed(monkeypatch):
    monkeypatch.setattr(tiles, "free_device_bytes", lambda device: pytest.fail("the CPU budget reads no device"))
    assert tiles.tile_budget(torch.device("cpu")) == tiles.TILE_BYTES["cpu"]


# ---------------------------------------------------------------------------------------------- fp32 accumulation
@pytest.fixture
def cpu_fp32_addmm(monkeypatch):
    """A CPU kernel of aten::addmm.dtype_out for the duration of the test (what cuBLAS computes: the product of the
    low-precision inputs accumulated in fp32, plus beta * self), with a call counter."""
    if tiles.fp32_addmm_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this torch has a CPU addmm with out_dtype: the fixture would replace a real kernel")
    calls = []

    def impl(self, mat1, mat2, out_dtype, beta=1, alpha=1, *, out):
        assert out_dtype == torch.float32 and out.dtype == torch.float32 and mat1.dtype == mat2.dtype
        calls.append(float(beta))
        prod = torch.mm(mat1.float(), mat2.float()) * alpha
        out.copy_(prod if beta == 0 else prod + beta * self.float())
        return out

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("addmm.dtype_out", impl, "CPU")
    monkeypatch.setattr(tiles, "_FP32_ADDMM", {})
    assert all(tiles.fp32_addmm_supported(torch.device("cpu"), dt) for dt in (torch.float16, torch.bfloat16))
    calls.clear()  # the probes' calls
    yield calls
    lib._destroy()
    tiles._FP32_ADDMM.clear()


def _operands(dtype, k_tiles, seed=0):
    """k_tiles pairs (a_i [37, 23], b_i [23, 19]) in dtype: odd shapes."""
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(37, 23, generator=g).to(dtype) for _ in range(k_tiles)]
    b = [torch.randn(23, 19, generator=g).to(dtype) for _ in range(k_tiles)]
    return a, b


def _accumulate(dtype, k_tiles):
    """sum over k_tiles of a_i @ b_i with tiles.accumulate_fp32 (acc starts uninitialised: NaN) and in fp64."""
    a, b = _operands(dtype, k_tiles)
    acc = torch.full((37, 19), float("nan"))
    for i in range(k_tiles):
        tiles.accumulate_fp32(acc, a[i], b[i], first=i == 0, chunk=8)
    ref = sum(x.double() @ y.double() for x, y in zip(a, b))
    return acc, ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_fp32_fallback_matches_fp64(dtype):
    acc, ref = _accumulate(dtype, 6)
    assert acc.dtype == torch.float32 and torch.isfinite(acc).all()  # beta = 0 on the first tile ignores the NaN
    # the fallback rounds each tile's product to dtype once: error <= tiles * eps(dtype) * |product|
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(acc.double(), ref, atol=6 * eps * 8, rtol=6 * eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_accumulate_fp32_uses_the_gemm_fp32_output(dtype, cpu_fp32_addmm):
    """With the fp32-output GEMM each tile is one addmm into the accumulator (beta 0 then 1) and the sum keeps fp32
    precision: far below one rounding to bf16/fp16 of the product, which the fallback would make."""
    assert tiles.fp32_addmm_supported(torch.device("cpu"), dtype)
    acc, ref = _accumulate(dtype, 6)
    assert cpu_fp32_addmm == [0.0] + [1.0] * 5
    err = (acc.double() - ref).abs().max().item()
    assert err < 1e-4, f"fp32 accumulation error {err}"
    lowp = sum((x @ y).double() for x, y in zip(*_operands(dtype, 6)))
    assert (lowp - ref).abs().max().item() > 10 * err  # the bf16/fp16 round trip this path removes is much worse


# -------------------------------------------------------------------------------------------- the fused loss
def _fused_case(dtype, seed=0):
    return make_batch(3, 5, 37, H=11, masked_rows=(1,), per_seq_adv=True, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_one_token_tile_vs_fp64_reference(dtype, agg):
    """Default CPU budget: the [15, 37] logits are one token tile, grad_W is written directly."""
    assert fl.tile_shape(15, 37, dtype.itemsize, torch.device("cpu"))[0] == 15
    check_case(_fused_case(dtype), dict(FULL, loss_agg=agg, temperature=0.7), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemm", ["fp32-output", "fallback"])
def test_several_token_tiles_vs_fp64_reference(dtype, gemm, monkeypatch, request):
    """2 rows per token tile (8 token tiles): grad_W summed over them in fp32 (for fp32 inputs in grad_W itself)."""
    calls = request.getfixturevalue("cpu_fp32_addmm") if gemm == "fp32-output" else None
    monkeypatch.setitem(tiles.TILE_BYTES, "cpu", 2 * 37 * dtype.itemsize)
    assert fl.tile_shape(15, 37, dtype.itemsize, torch.device("cpu")) == (2, 37)
    check_case(_fused_case(dtype), dict(FULL, loss_agg="token-mean"), dtype)
    if calls is not None and dtype != torch.float32:
        assert calls.count(0.0) == 1 and calls.count(1.0) == 7  # one addmm per token tile into the accumulator


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_several_vocab_tiles_vs_fp64_reference(dtype, monkeypatch, cpu_fp32_addmm):
    """A row wider than the budget: vocabulary tiles of 16 swept twice, grad_h through its fp32 [rows, H]
    accumulator and grad_W through the [V, H] one, both by the fp32-output GEMM."""
    monkeypatch.setitem(tiles.TILE_BYTES, "cpu", 2 * 16 * dtype.itemsize)  # < one row of 37
    monkeypatch.setitem(tiles.MAX_VOCAB_TILE, "cpu", 16)
    assert fl.tile_shape(15, 37, dtype.itemsize, torch.device("cpu")) == (2, 16)
    check_case(_fused_case(dtype), dict(FULL, loss_agg="token-mean"), dtype)
    assert cpu_fp32_addmm  # the accumulators went through it


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_accumulate_fp32_vs_fp64(dtype):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(300, 257, generator=g).to(dtype) for _ in range(4)]
    b = [torch.randn(257, 129, generator=g).to(dtype) for _ in range(4)]
    acc = torch.full((300, 129), float("nan"), device=dev)
    for i in range(4):
        tiles.accumulate_fp32(acc, a[i].to(dev), b[i].to(dev), first=i == 0, chunk=64)
    ref = sum(x.double() @ y.double() for x, y in zip(a, b))
    err = (acc.cpu().double() - ref).abs().max().item()
    bound = 1e-3 if tiles.fp32_addmm_supported(dev, dtype) else 4 * torch.finfo(dtype).eps * 64
    assert err < bound, f"{err} (fp32 addmm supported: {tiles.fp32_addmm_supported(dev, dtype)})"


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_tile", [None, 2])
def test_gpu_fused_bf16_vs_fp64_reference(rows_per_tile, monkeypatch):
    if rows_per_tile is not None:  # a budget of 2 rows: several token tiles whatever memory is free
        monkeypatch.setattr(tiles, "free_device_bytes", lambda device: 0)
        monkeypatch.setattr(tiles, "MIN_TILE_BYTES", 2 * 37 * 2)
    check_case(_fused_case(torch.bfloat16), dict(FULL, loss_agg="token-mean"), torch.bfloat16, device="cuda")
