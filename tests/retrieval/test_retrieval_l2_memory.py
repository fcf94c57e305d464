"""The chunked l2 search of StepBuffer on CUDA (rapo_fast/retrieval/l2_chunks.py), run on the CPU
with the CPU backend: its result equals one unchunked search exactly (ties, padding, exclusion and min_score
included), and it never holds more than about one chunk of centred keys, where the old search made full fp32 and
fp64 copies of every stored key.

Not here: the CUDA backend itself (test_retrieval_gpu.py) or l2's accuracy far from the origin (test_retrieval_l2.py).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers.retrieval_cases import cpu_isas, force_isa

from rapo_fast.reference.retrieval import search_ref
from rapo_fast.retrieval.l2_chunks import chunked_l2_search, l2_chunk_rows, sq_norms
from rapo_fast.retrieval.op import METRIC_CODES, retrieval_search

L2 = METRIC_CODES["l2"]
NEG_INF = float("-inf")


def _bench_common():
    """bench/_common.py, for its peak_memory_mb (loaded from its file: bench/ is not a package on sys.path). Its own
    imports of bench/ modules (_quiet) need bench/ on sys.path: alone, this test is the first to put it there."""
    path = Path(__file__).resolve().parents[2] / "bench" / "_common.py"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("_rapo_bench_common", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(params=cpu_isas())
def isa(request, monkeypatch):
    return force_isa(monkeypatch, request.param)


def _case(seed: int, C: int, D: int, Q: int, integer: bool):
    """Centred-ish fp32 keys with duplicated rows (exact ties, some across chunk boundaries), groups, queries and an
    exclusion per query (some -1: nothing excluded). integer: small integer values, so every score is exact in fp32
    and ties are plentiful."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        keys = torch.randint(-2, 3, (C, D), generator=g).float()
        q = torch.randint(-2, 3, (Q, D), generator=g).float()
    else:
        keys = torch.randn(C, D, generator=g)
        q = torch.randn(Q, D, generator=g)
    dup = torch.randint(0, C, (C // 4,), generator=g)
    keys[torch.randint(0, C, (C // 4,), generator=g)] = keys[dup].clone()
    groups = torch.randint(0, 4, (C,), generator=g)
    exclude = torch.randint(-1, 4, (Q,), generator=g)
    return keys, groups, q, exclude


def _unchunked(keys, groups, q, exclude, k, thr):
    return retrieval_search(keys, sq_norms(keys), groups, q, exclude, k, L2, thr, None)


def _assert_same(got, want):
    assert torch.equal(got[1], want[1]), "slots differ"
    assert torch.equal(got[0], want[0]), "scores differ"


@pytest.mark.parametrize("Q", [3, 60])  # the few-query dot mode and the packed tiles
@pytest.mark.parametrize("integer", [False, True])
def test_chunked_equals_unchunked(isa, Q, integer):
    """centre=None on already-centred fp32 keys, odd C, every chunk size from 1 row to more than C, k below and above
    the chunk size and above C (padding), without filters, with exclusion, with exclusion and min_score."""
    C, D = 101, 24
    keys, groups, q, exclude = _case(C + Q + int(integer), C, D, Q, integer)
    full = _unchunked(keys, groups, q, None, 5, NEG_INF)
    thr = float(full[0][:, -1].median())  # some rows keep fewer than 5 eligible entries
    for k in (5, 16, 150):
        for ex, t in ((None, NEG_INF), (exclude, NEG_INF), (exclude, thr)):
            want = _unchunked(keys, groups, q, ex, k, t)
            if k == 150:
                assert bool((want[1][:, C:] == -1).all()) and bool((want[0][:, C:] == NEG_INF).all())
            for rows in (1, 3, 7, 50, 100, 1000):
                got = chunked_l2_search(keys, groups, q, ex, k, t, None, rows, retrieval_search)
                _assert_same(got, want)


def test_integer_keys_match_the_spec():
    """Every score exact in fp32 (small integers): the chunked search equals the float64 spec outright, so its merge
    keeps the spec's tie order (equal scores to the smaller slot) across chunk boundaries."""
    C, D, Q = 77, 8, 9
    keys, groups, q, exclude = _case(7, C, D, Q, integer=True)
    for rows in (1, 4, 13, 77):
        for k in (1, 6, 90):
            s, i = chunked_l2_search(keys, groups, q, exclude, k, -20.0, None, rows, retrieval_search)
            ref_s, ref_i = search_ref(keys, q, k, "l2", groups, exclude, -20.0)
            assert torch.equal(i, ref_i)
            assert torch.equal(s.double(), ref_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_centre_path_equals_the_old_full_copy(dtype):
    """With a centre (StepBuffer's CUDA branch): stored keys of each dtype, centred chunk by chunk, give exactly what
    the old code's full centred copies gave: keys.float() - c, aux from float64, queries q.float() - c."""
    C, D, Q = 203, 40, 5
    g = torch.Generator().manual_seed(3)
    keys = (100.0 + torch.randn(C, D, generator=g)).to(dtype)
    keys[100:110] = keys[0:10]
    groups = torch.randint(0, 3, (C,), generator=g)
    q = (100.0 + torch.randn(Q, D, generator=g)).to(dtype)
    exclude = torch.randint(-1, 3, (Q,), generator=g)
    c = keys.double().mean(0).float()
    kc = keys.float() - c
    old_aux = kc.double().square().sum(1).float()
    assert torch.equal(sq_norms(kc, 7), old_aux)
    for k in (4, 300):
        want = retrieval_search(kc, old_aux, groups, q.float() - c, exclude, k, L2, NEG_INF, None)
        for rows in (1, 9, 64, 203, 5000):
            got = chunked_l2_search(keys, groups, q, exclude, k, NEG_INF, c, rows, retrieval_search)
            _assert_same(got, want)


def test_empty_keys_are_padding():
    keys, groups = torch.empty(0, 8), torch.empty(0, dtype=torch.int64)
    s, i = chunked_l2_search(keys, groups, torch.randn(3, 8), None, 4, NEG_INF, torch.zeros(8), 16, retrieval_search)
    assert bool((s == NEG_INF).all()) and bool((i == -1).all()) and s.shape == (3, 4)


def test_chunk_rows_bound():
    assert l2_chunk_rows(768) * 768 * 4 <= 256 << 20 < (l2_chunk_rows(768) + 1) * 768 * 4
    assert l2_chunk_rows(10**9) == 1


def test_peak_memory_is_one_chunk():
    """C = 200k, D = 64 fp16 keys: the old full copies (fp32 centred keys 51 MB, their fp64 copy and its square 102 MB
    each) peak near 250 MB and the measurement sees them; the chunked search (4 MiB chunks) stays near 2 chunks."""
    peak_memory_mb = _bench_common().peak_memory_mb
    cpu = torch.device("cpu")
    C, D, Q, k = 200_000, 64, 4, 8
    g = torch.Generator().manual_seed(0)
    keys = (5.0 + torch.randn(C, D, generator=g)).half()
    groups = torch.zeros(C, dtype=torch.int64)
    q = keys[:Q].clone()
    c = keys.double().mean(0).float()
    chunk_mib = 4
    rows = l2_chunk_rows(D, chunk_mib << 20)
    out = {}

    def old():
        kc = keys.float() - c
        aux = kc.double().square().sum(1).float()
        out["old"] = retrieval_search(kc, aux, groups, q.float() - c, None, k, L2, NEG_INF, None)

    def new():
        out["new"] = chunked_l2_search(keys, groups, q, None, k, NEG_INF, c, rows, retrieval_search)

    old_mb, new_mb = peak_memory_mb(old, cpu), peak_memory_mb(new, cpu)
    print(f"peak extra memory: full copies {old_mb:.1f} MiB, chunked ({chunk_mib} MiB chunks) {new_mb:.1f} MiB")
    _assert_same(out["new"], out["old"])
    full_copy_mb = C * D * (4 + 8) / 2**20  # one fp32 and one fp64 copy of the keys
    assert old_mb >= full_copy_mb, f"the measurement missed the full copies: {old_mb:.1f} MiB"
    assert new_mb <= 2 * chunk_mib + 1, f"chunked search peaked at {new_mb:.1f} MiB"
    assert math.isfinite(new_mb) and new_mb > 0
