"""The Triton search path (rapo_fast/retrieval/triton_search.py, rapo_fast/kernels/retrieval/search.py) against the
float64 brute force, under TRITON_INTERPRET=1 on CPU tensors: exclusion groups and min_score leaving rows short (each
metric), k > C padding, ties to the smaller slot (duplicate keys, +0.0 / -0.0 scores), k up to 1024, Q=1 and odd Q, D
not a multiple of the tile, C=1 and an empty buffer; the merges inside a split (small tiles force them) and across
splits, and in chunks of rows as the GPU plan merges. Also: the GPU tiles and their override, the argument checks
(before any launch), and the kernel compiled to an sm_80 cubin without a GPU (sm_90a, with its register and spill
bounds: tests/test_sm90_compile.py). On a GPU, the Triton path against the CUDA backend.

Not here: every dtype and metric through StepBuffer.search(backend="triton"), bit for bit equal to the CPU backend,
the dispatch table and "auto" (test_retrieval_backends.py); the CUDA backend's own exactness (test_retrieval_gpu.py)
or the CPU backend's (test_retrieval.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from helpers.retrieval_cases import check_search

import rapo_fast.retrieval.triton_search as ts
from rapo_fast import StepBuffer
from rapo_fast.reference.retrieval import key_aux_ref, search_ref
from rapo_fast.retrieval.op import METRIC_CODES

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors run the Triton kernel only under TRITON_INTERPRET=1"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
METRICS = ["ip", "cosine", "l2"]


def _buffer(C, D, dtype, metric, groups=4, keys=None):
    buf = StepBuffer(max(C, 1), D, dtype=dtype, metric=metric)
    if C:
        emb = torch.randn(C, D) if keys is None else keys
        buf.add(emb, torch.arange(C) + 1000, torch.randint(0, groups, (C,)))
    return buf


def _search(buf, q, k, exclude=None, min_score=None, splits=None):
    """triton_search on the buffer's state, as StepBuffer hands it to a backend; returns (scores, slots)."""
    keys = buf.embeddings
    centre = keys.double().mean(0).float() if buf.metric == "l2" and len(buf) else None
    thr = float("-inf") if min_score is None else float(min_score)
    aux = key_aux_ref(keys, buf.metric)
    return ts.triton_search(
        keys, aux, buf.group_ids, q.to(buf.dtype), exclude, k, METRIC_CODES[buf.metric], thr, centre, splits=splits
    )


def _check(buf, q, k, exclude=None, min_score=None, splits=None):
    s, slots = _search(buf, q, k, exclude, min_score, splits)
    assert s.dtype == torch.float32 and slots.dtype == torch.int64
    payload = torch.where(slots >= 0, slots + 1000, -1)
    check_search(buf, q, k, s, payload, exclude, min_score, slots=slots)
    return s, slots


@needs_interpreter
@pytest.mark.parametrize(
    ("C", "D", "Q", "k", "splits"),
    [
        (1, 5, 1, 3, None),  # C = 1, k > C: padding with -inf / -1
        (70, 16, 3, 100, None),  # k > C over several tiles
        (257, 33, 17, 64, 3),  # odd everything, k = 64
        (600, 8, 2, 5, 1),  # one split: several merges inside it
        (1100, 8, 2, 1024, 2),  # k = 1024 (workspace rows of 2048)
    ],
)
def test_odd_shapes(C, D, Q, k, splits):
    buf = _buffer(C, D, torch.float16, "ip")
    _check(buf, torch.randn(Q, D), k, exclude=torch.randint(-1, 4, (Q,)), splits=splits)


@needs_interpreter
def test_merge_in_row_chunks_as_on_the_gpu(monkeypatch):
    # On a GPU a merge takes ROWS < BLOCK_Q rows at a time (workspace_layout); the interpreter's plan takes them all.
    # Chunks of 4 rows of the 16-row query tile, Q = 19: a partial chunk and a partial second query tile.
    real = ts.workspace_layout

    def chunked(k, block_q, block_c, on_gpu):
        kp, w, _ = real(k, block_q, block_c, on_gpu)
        return kp, w, 4

    monkeypatch.setattr(ts, "workspace_layout", chunked)
    assert ts.plan(19, 300, 64, True, torch.device("cpu"), splits=2).rows == 4
    buf = _buffer(300, 37, torch.float32, "ip")
    _check(buf, torch.randn(19, 37), 64, exclude=torch.randint(-1, 4, (19,)), splits=2)


@needs_interpreter
@pytest.mark.parametrize("metric", METRICS)
def test_min_score_and_exclusion_leave_rows_short(metric):
    # A high min_score and an excluded group leave fewer than k eligible keys in some rows: they are padded.
    buf = _buffer(150, 12, torch.bfloat16, metric, groups=2)
    q = torch.randn(6, 12)
    ref, _ = search_ref(buf.embeddings, q.bfloat16(), 150, metric)
    thr = float(ref[:, 20].median())
    s, slots = _check(buf, q, 32, exclude=torch.tensor([0, 1, -1, 0, 1, -1]), min_score=thr, splits=2)
    assert bool((slots == -1).any()), "the case meant to pad did not"
    assert bool((s[slots >= 0] >= thr).all())


@needs_interpreter
def test_ties_go_to_the_smaller_slot():
    # 8 distinct keys repeated 20 times (equal scores), plus zero keys: the slots must be exactly the reference's, whose
    # stable sort puts the smaller slot first among equal scores. Small integers make every dot product exact whatever
    # the summation order (the interpreter's numpy matmul rounds columns differently), so the ties are exact ties.
    base = torch.randint(-3, 4, (8, 24)).float()
    keys = torch.cat([base.repeat(20, 1), torch.zeros(10, 24)])[torch.randperm(170)]
    buf = _buffer(170, 24, torch.float16, "ip", keys=keys)
    q = torch.cat([torch.randint(-3, 4, (4, 24)).float(), torch.zeros(1, 24)])
    s, slots = _search(buf, q, 50, splits=3)
    ref_s, ref_i = search_ref(buf.embeddings, q.half(), 50, "ip")
    assert torch.equal(slots, ref_i)
    assert torch.equal(s.double(), ref_s)


@needs_interpreter
def test_empty_buffer_and_no_queries():
    keys = torch.zeros(0, 8, dtype=torch.float16)
    aux, grp = torch.zeros(0), torch.zeros(0, dtype=torch.int64)
    s, slots = ts.triton_search(keys, aux, grp, torch.randn(3, 8).half(), None, 4, 0, float("-inf"))
    assert torch.equal(slots, torch.full((3, 4), -1)) and bool((s == float("-inf")).all())
    buf = _buffer(10, 8, torch.float16, "ip")
    s, slots = _search(buf, torch.zeros(0, 8), 4)
    assert s.shape == (0, 4) and slots.shape == (0, 4)


def test_encode_decode_round_trip_keeps_order():
    # The launcher's decode is the inverse of the kernel's encode; both sentinels agree.
    from rapo_fast.kernels.retrieval import search as kernel

    assert ts.SENTINEL == kernel.SENTINEL.value
    scores = torch.tensor([3.5, -0.0, 0.0, -2.0, float("inf"), -3.4e38, 1e-40])
    slots = torch.tensor([7, 3, 2, 9, 0, 2**31 - 1, 5])
    bits = torch.where(scores == 0, torch.zeros_like(scores), scores).view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    keys = (ordered << 32) | (0x7FFFFFFF - slots)
    s, sl = ts.decode_keys(keys)
    assert torch.equal(sl, slots) and torch.equal(s, torch.where(scores == 0, 0.0, scores))
    order = torch.argsort(keys, descending=True)
    assert order.tolist() == [4, 0, 6, 2, 1, 3, 5]  # +0.0 (slot 2) before -0.0 (slot 3): equal scores, smaller slot
    assert bool((keys > ts.SENTINEL).all())


# ---- tiles ----------------------------------------------------------------------------------------------------------


def test_tiles_override_is_checked(monkeypatch):
    for bad in ("128,100,64,8,3", "128,16,64,8,3"):  # not a power of two; a key tile too narrow for two halves
        monkeypatch.setenv(ts.TILES_ENV, bad)
        with pytest.raises(ValueError, match=ts.TILES_ENV):
            ts.gpu_tiles(False, True)
    monkeypatch.setenv(ts.TILES_ENV, "128,64,64,8,4")
    assert ts.gpu_tiles(False, True) == ts.gpu_tiles(True, False) == (128, 64, 64, 8, 4)


def test_gpu_tiles_follow_dtype_and_alignment(monkeypatch):
    # tests/test_sm90_compile.py holds each of these to its register and spill bounds on sm_90a
    monkeypatch.delenv(ts.TILES_ENV, raising=False)
    assert ts.gpu_tiles(False, True) == (128, 128, 64, 8, 3)
    assert ts.gpu_tiles(False, False) == (128, 64, 16, 8, 3)
    assert ts.gpu_tiles(True, True) == ts.gpu_tiles(True, False) == (64, 64, 16, 8, 1)


# ---- argument checks -------------------------------------------------------------------------------------------------

_GOOD = dict(k=4, metric=0, min_score=float("-inf"), centre=None)


def _args(C=10, D=8, Q=3, dtype=torch.float16):
    return dict(
        keys=torch.randn(C, D).to(dtype),
        key_aux=torch.zeros(C),
        groups=torch.zeros(C, dtype=torch.int64),
        queries=torch.randn(Q, D).to(dtype),
        exclude=None,
    )


@pytest.mark.parametrize(
    ("change", "exc", "name"),
    [
        (dict(keys=torch.zeros(10, 8, dtype=torch.int32)), TypeError, "keys"),
        (dict(queries=torch.randn(3, 8)), TypeError, "queries"),
        (dict(queries=torch.randn(3, 9).half()), ValueError, "queries"),
        (dict(key_aux=torch.zeros(9)), ValueError, "key_aux"),
        (dict(key_aux=torch.zeros(10, dtype=torch.float64)), TypeError, "key_aux"),
        (dict(groups=torch.zeros(10, dtype=torch.int32)), TypeError, "groups"),
        (dict(exclude=torch.zeros(4, dtype=torch.int64)), ValueError, "exclude"),
        (dict(centre=torch.zeros(7)), ValueError, "centre"),
        (dict(k=0), ValueError, "k"),
        (dict(k=1025), ValueError, "k"),
        (dict(metric=3), ValueError, "metric"),
        (dict(min_score=float("nan")), ValueError, "min_score"),
        (dict(keys=torch.zeros(1, 8, dtype=torch.float16).expand(2**31, 8)), ValueError, "at most"),
    ],
)
def test_bad_input_raises_before_launch(change, exc, name):
    kwargs = {**_args(), **_GOOD, **change}
    with mock.patch("rapo_fast.kernels.retrieval.search.retrieval_topk_kernel") as kernel:
        with pytest.raises(exc, match=name):
            ts.triton_search(**kwargs)
    assert not kernel.mock_calls


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ts.triton_search(**_args(), **_GOOD)


# ---- the kernel compiles for the GPUs ------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rapo_fast.kernels.retrieval import search as K
from rapo_fast.retrieval.triton_search import gpu_tiles, workspace_layout

fn = K.retrieval_topk_kernel
names = list(fn.arg_names)
# (dtype, fp32 keys, metric, exclusion, k): the launcher's GPU tiles for aligned D (sm_90a: tests/test_sm90_compile.py)
for dt, fp32, metric, excl, k in [("*bf16", False, 0, True, 7), ("*fp32", True, 2, True, 1024)]:
    bq, bc, bd, warps, stages = gpu_tiles(fp32, aligned=True)
    kp, w, rows = workspace_layout(k, bq, bc, on_gpu=True)
    types = [dt, dt] + ["*fp32"] * 2 + ["*i64"] * 4 + ["*i32"] + ["i32"] * 6 + ["fp32"]
    consts = dict(K_TOP=k, KP=kp, W=w, METRIC=metric, HAS_EXCL=excl, FP32_KEYS=fp32, UPCAST_DOT=False,
                  BLOCK_Q=bq, BLOCK_C=bc, BLOCK_D=bd, ROWS=rows)
    sig = dict(zip(names, types + ["constexpr"] * len(consts)))
    # Pointers, strides and D divisible by 16, as the JIT specialises them for D = 768.
    attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(9)) + [11, 12, 13]}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": warps, "num_stages": stages})
print("compiled")
"""


def test_kernel_compiles_for_sm80(tmp_path):
    # The interpreter accepts code the GPU compiler rejects (non-constexpr globals, loop-carried types); compile the
    # real thing to cubin with Triton's bundled ptxas, in a fresh process without TRITON_INTERPRET.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


# ---- GPU: the Triton path against the CUDA backend ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.gpu_spread  # 27 cases, a Triton compile each (5-8 s): spread over the GPU call's processes
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("C", "D", "Q", "k"), [(5000, 384, 300, 64), (3001, 37, 33, 1024), (1, 16, 1, 3)])
def test_triton_matches_fp64_on_gpu(monkeypatch, dtype, metric, C, D, Q, k):
    monkeypatch.setenv(ts.BACKEND_ENV, "triton")
    buf = StepBuffer(C, D, dtype=dtype, metric=metric, device="cuda")
    buf.add(torch.randn(C, D, device="cuda"), torch.arange(C, device="cuda") + 1000, torch.randint(0, 4, (C,)).cuda())
    q = torch.randn(Q, D, device="cuda")
    excl = torch.randint(-1, 4, (Q,), device="cuda")
    with mock.patch("rapo_fast.retrieval.op.triton_search", wraps=ts.triton_search) as spy:
        s, p = buf.search(q, k, exclude_groups=excl)
    assert spy.call_count == 1
    check_search(buf, q, k, s, p, exclude=excl)
    monkeypatch.setenv(ts.BACKEND_ENV, "cuda")
    s2, p2 = buf.search(q, k, exclude_groups=excl)
    check_search(buf, q, k, s2, p2, exclude=excl)
