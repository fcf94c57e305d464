"""The `backend` argument of exact search ("auto" | "cpu" | "cuda" | "triton", rapo_fast/retrieval/backends.py): the
backends that run on CPU tensors ("auto", "cpu", and "triton" under TRITON_INTERPRET=1) return exactly the same
scores and payload ids, and the spec's; an explicit backend that cannot run raises ValueError naming `backend`, the
value and why; "auto" follows the dispatch table for CUDA tensors (and its override) and takes the C++ backend for CPU
tensors; the crossover table says it is predicted.

What this is not: the GPU comparison of "cuda" and "triton" (tests/retrieval/test_retrieval_triton.py, marked gpu).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.retrieval_cases import check_search

from rapo_fast import StepBuffer
from rapo_fast.retrieval import op
from rapo_fast.retrieval import triton_search as ts
from rapo_fast.retrieval.backends import BACKENDS, resolve_backend

pytest.importorskip("rapo_fast._C")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
CPU_BACKENDS = ["auto", "cpu"] + (["triton"] if INTERPRETED else [])
ROOT = Path(__file__).resolve().parents[2]


def _buffer(dtype, metric, C=300, D=24):
    # Small integers: every dot product, norm and difference is exact in fp32 whatever the summation order, so the
    # backends must agree bit for bit (ties included: many equal scores, each to the smaller slot). Triton (interpreted
    # tiles of 32 keys, 16 queries, 16 dims): 2 splits of 5 key tiles, a merge inside each split and across them, a
    # partial query tile (Q = 7) and a partial D tile.
    g = torch.Generator().manual_seed(7)
    buf = StepBuffer(C, D, dtype=dtype, metric=metric)
    keys = torch.randint(-3, 4, (C, D), generator=g).float()
    buf.add(keys, torch.arange(C) + 1000, torch.randint(0, 5, (C,), generator=g))
    q = torch.randint(-3, 4, (7, D), generator=g).float()
    return buf, q, torch.randint(-1, 5, (7,), generator=g)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_backends_agree_exactly(dtype, metric):
    buf, q, excl = _buffer(dtype, metric)
    results = {}
    for backend in CPU_BACKENDS:
        s, p = buf.search(q, 6, exclude_groups=excl, backend=backend)
        check_search(buf, q, 6, s, p, exclude=excl)
        results[backend] = (s, p)
    s0, p0 = results["auto"]
    for backend, (s, p) in results.items():
        assert torch.equal(s, s0) and torch.equal(p, p0), backend


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors run the Triton kernel only under TRITON_INTERPRET=1")
def test_explicit_triton_runs_the_triton_kernel_and_auto_does_not(monkeypatch):
    monkeypatch.setenv(ts.BACKEND_ENV, "triton")  # "auto" on CPU tensors still ignores it: the C++ backend, as before
    buf, q, _ = _buffer(torch.float16, "ip")
    with mock.patch("rapo_fast.retrieval.op.triton_search", wraps=ts.triton_search) as spy:
        buf.search(q, 3)
        assert spy.call_count == 0
        buf.search(q, 3, backend="triton")
        assert spy.call_count == 1
        buf.search(q, 3, backend="cpu")
        assert spy.call_count == 1


def test_cuda_is_refused_on_cpu_tensors():
    buf, q, _ = _buffer(torch.float32, "ip")
    with pytest.raises(ValueError, match=r"backend='cuda' cannot run: the CUDA backend needs cuda tensors.*cpu"):
        buf.search(q, 3, backend="cuda")
    with pytest.raises(ValueError, match=r"backend='cuda' cannot run"):  # the op called directly checks as well
        op.retrieval_search(
            buf.embeddings, buf._aux[: len(buf)], buf.group_ids, q, None, 3, 0, float("-inf"), None, "cuda"
        )
    empty = StepBuffer(4, 24, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"backend='cuda'"):  # refused before looking at the (empty) buffer
        empty.search(q, 3, backend="cuda")


def test_triton_is_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    buf, q, _ = _buffer(torch.float16, "cosine")
    with pytest.raises(
        ValueError, match=r"backend='triton' cannot run: (triton is not installed|.*TRITON_INTERPRET=1)"
    ):
        buf.search(q, 3, backend="triton")


def test_unknown_backend_is_refused():
    buf, q, _ = _buffer(torch.float32, "l2")
    for bad in ("gpu", "CPU", None, 1):
        with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'cpu', 'cuda', 'triton'\)"):
            buf.search(q, 3, backend=bad)
    assert BACKENDS == ("auto", "cpu", "cuda", "triton")


# (Q, C, D, dtype, k, metric) -> the dispatch table's choice for CUDA tensors (rapo_fast/retrieval/triton_search.py)
DISPATCH = [
    ((4096, 4_000_000, 768, torch.float16, 64, 0), "triton"),  # many queries, fp16: the table's row
    ((4096, 4_000_000, 768, torch.bfloat16, 64, 1), "triton"),
    ((1024, 1_000_000, 768, torch.bfloat16, 3, 1), "triton"),
    ((64, 4_000_000, 768, torch.float16, 64, 0), "cuda"),  # few queries
    ((4096, 1000, 768, torch.float16, 64, 0), "cuda"),  # small buffer
    ((1024, 1_000_000, 768, torch.float16, 64, 0), "triton"),  # stage 3's C=1M shape
    ((256, 170_000, 384, torch.float16, 3, 0), "cuda"),  # the paper's scale
    ((4096, 4_000_000, 768, torch.float16, 1024, 0), "cuda"),  # large k
    ((4096, 4_000_000, 768, torch.float32, 64, 0), "cuda"),  # fp32 keys
    ((4096, 4_000_000, 768, torch.float16, 64, 2), "cuda"),  # l2: centred fp32 keys
]


def test_auto_follows_the_dispatch_table_and_its_override(monkeypatch):
    """ "auto" on CUDA tensors: the table (RAPO_FAST_RETRIEVAL_BACKEND or `override` replaces it); on CPU tensors the
    C++ backend, always."""
    monkeypatch.delenv(ts.BACKEND_ENV, raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for shape, want in DISPATCH:
        assert ts.select_backend(*shape) == want, shape
        assert resolve_backend("auto", cuda, *shape) == ("triton" if want == "triton" else "extension")
        assert resolve_backend("auto", cpu, *shape) == "extension"
    few = DISPATCH[3][0]
    monkeypatch.setenv(ts.BACKEND_ENV, "triton")
    assert ts.select_backend(1, 10, 8, torch.float32, 1, 2) == "triton"
    assert resolve_backend("auto", cuda, *few) == "triton"
    assert ts.select_backend(*DISPATCH[0][0], override="cuda") == "cuda"
    monkeypatch.setenv(ts.BACKEND_ENV, "cuda")
    assert ts.select_backend(*DISPATCH[0][0]) == "cuda"
    monkeypatch.setenv(ts.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=ts.BACKEND_ENV):
        ts.select_backend(1, 10, 8, torch.float16, 1, 0)
    if not torch.cuda.is_available():
        from rapo_fast._ext import build_info

        if not build_info()["cuda"]:
            with pytest.raises(ValueError, match=r"backend='cuda' cannot run: rapo_fast._C was built without CUDA"):
                resolve_backend("cuda", cuda, *few)


def test_crossover_table_says_it_is_predicted():
    phrase = "PREDICTED, not measured: replaced by the GPU run's figures"
    assert ts.CROSSOVERS_STATUS == phrase
    assert phrase in (ROOT / "rapo_fast" / "retrieval" / "triton_search.py").read_text()
    assert phrase in " ".join((ROOT / "docs" / "retrieval.md").read_text().replace("**", "").split())
