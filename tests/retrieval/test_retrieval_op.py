"""The registered search op `rapo_fast::retrieval_search` below StepBuffer.search: opcheck and torch.compile; the first
search of a process does not import torch._dynamo (the first call of a torch.library custom op does, 1.5-3 s on a
CPU); called directly, it refuses every extent that would read out of bounds; every query layout (expanded rows,
column slices, transposes, overlapping as_strided views, padded rows) is searched exactly as its dense copy, by
StepBuffer.search and by the op; a CUDA tensor without a CUDA build says how to rebuild.

Not here: the search's results (test_retrieval.py), the extension's own tensor checks (test_retrieval_ext_args.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rapo_fast import StepBuffer
from rapo_fast._ext import extension, require_backend
from rapo_fast.retrieval.op import retrieval_search


def test_opcheck_and_compile():
    buf = StepBuffer(300, 24, dtype=torch.float16, metric="l2")
    buf.add(torch.randn(300, 24), torch.arange(300), torch.randint(0, 4, (300,)))
    q = torch.randn(11, 24)
    ex = torch.randint(-1, 4, (11,))
    args = (buf._keys, buf._aux, buf._group, q.half(), ex, 5, 2, -100.0)
    torch.library.opcheck(retrieval_search.op, args)  # the registered op (eager calls skip the dispatcher)

    def fn(queries, exclude):
        s, p = buf.search(queries * 1.0, 5, exclude_groups=exclude, min_score=-100.0)
        return s + 0.0, p

    eager = fn(q, ex)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, ex)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


_FIRST_SEARCH = textwrap.dedent(
    """
    import sys, time
    import torch, rapo_fast
    buf = rapo_fast.StepBuffer(capacity=256, dim=16)
    buf.add(torch.randn(100, 16))
    t0 = time.perf_counter()
    scores, ids = buf.search(torch.randn(3, 16), k=4)
    print(f"first search {time.perf_counter() - t0:.3f} s")
    assert ids.shape == (3, 4)
    assert "torch._dynamo" not in sys.modules, "the first search imported torch._dynamo"
    """
)


def test_first_search_does_not_import_dynamo():
    out = subprocess.run([sys.executable, "-c", _FIRST_SEARCH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    print(out.stdout.strip())


def test_cuda_tensor_without_cuda_build_says_how_to_rebuild(monkeypatch):
    info = dict(extension().BUILD_INFO, cuda=False)
    monkeypatch.setattr(extension(), "BUILD_INFO", info)
    with pytest.raises(RuntimeError, match="pip install -e"):
        require_backend(torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"queries": torch.randn(50, 4096)}, ValueError, "keys have D = 16, queries D = 4096"),  # read past every key
        ({"keys": torch.randn(100, 4)}, ValueError, "keys have D = 4, queries D = 16"),
        ({"exclude": torch.zeros(1, dtype=torch.int64)}, IndexError, "exclude has 1 entries for 50 queries"),
        ({"key_aux": torch.ones(1), "metric": 1}, IndexError, "key_aux has 1 entries for 100 keys"),
        (
            {"groups": torch.zeros(3, dtype=torch.int64), "exclude": torch.zeros(50, dtype=torch.int64)},
            IndexError,
            "groups",
        ),
        ({"queries": torch.randn(50, 16).half()}, TypeError, r"queries: expected dtype in \{float32\}, got float16"),
        (
            {"groups": torch.zeros(100, dtype=torch.int32), "exclude": torch.zeros(50, dtype=torch.int64)},
            TypeError,
            "groups",
        ),
        ({"k": 5000}, ValueError, "k: expected an int in"),
        ({"metric": 7}, ValueError, "unknown metric"),
    ],
)
def test_op_called_directly_checks_every_extent(change, exc, match):
    """The registered op bypasses StepBuffer's validation: the extension itself refuses what would read out of bounds
    (a mismatched D or a short exclude list would read past the buffers)."""
    args = {"keys": torch.randn(100, 16), "key_aux": torch.ones(100), "groups": torch.zeros(100, dtype=torch.int64)}
    args |= {"queries": torch.randn(50, 16), "exclude": None, "k": 5, "metric": 0, **change}
    with pytest.raises(exc, match=match):
        retrieval_search(*args.values(), 0.0)


# ---- query layouts ---------------------------------------------------------------------------------------------------

D = 12


def _layout(base: torch.Tensor, kind: str, q: int) -> torch.Tensor:
    """A [q, D] view of `kind` over fresh storage."""
    if kind == "expand":  # one history searched q times: stride 0 along Q
        return base[:1].expand(q, D)
    if kind == "expand_cols":  # every column the same value: stride 0 along D
        return base[:q, :1].expand(q, D)
    if kind == "transpose":
        return base[:q].t().contiguous().t()
    if kind == "columns":  # every other column of a wider tensor: inner stride 2
        wide = torch.repeat_interleave(base[:q], 2, dim=1)
        return wide[:, ::2]
    if kind == "overlap":  # rows that overlap in memory
        return base.flatten().as_strided((q, D), (1, 1))
    if kind == "padded":  # row stride > D
        return torch.cat([base[:q], base[:q]], dim=1)[:, :D]
    return base[:q]


KINDS = ["expand", "expand_cols", "transpose", "columns", "overlap", "padded", "dense"]


@pytest.fixture(scope="module")
def buffers():
    torch.manual_seed(0)
    out = {}
    for metric in ("ip", "cosine", "l2"):
        buf = StepBuffer(64, D, dtype=torch.float32, metric=metric)
        buf.add(torch.randn(40, D), torch.arange(40), torch.arange(40) % 5)
        out[metric] = buf
    return out


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    q=st.integers(1, 6),
    metric=st.sampled_from(["ip", "cosine", "l2"]),
    k=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    exclude=st.booleans(),
)
@example(kind="expand", q=4, metric="ip", k=3, seed=0, exclude=False)  # one history searched 4 times
def test_any_query_layout_searches_as_its_dense_copy(buffers, kind, q, metric, k, seed, exclude):
    torch.manual_seed(seed)
    base = torch.randn(8, D)
    queries = _layout(base, kind, q)
    excl = (torch.arange(q) % 5).expand(q) if exclude else None
    buf = buffers[metric]
    got = buf.search(queries, k, exclude_groups=excl)
    want = buf.search(queries.contiguous(), k, exclude_groups=None if excl is None else excl.contiguous())
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_op_called_directly_with_expanded_queries_and_exclude(buffers):
    one = torch.randn(1, D)
    buf = buffers["ip"]
    want_s, _ = buf.search(one.repeat(4, 1), 3, exclude_groups=torch.ones(4, dtype=torch.int64))
    n = len(buf)
    s, _ = retrieval_search(
        buf._keys[:n], buf._aux[:n], buf._group[:n], one.expand(4, D), torch.tensor([1]).expand(4), 3, 0, float("-inf")
    )
    assert torch.equal(s, want_s)
