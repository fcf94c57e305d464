"""Every query layout handed to a search is accepted and searched exactly as its dense copy.

Expanded (stride-0) query views used to reach the extension and be refused as "a row stride is smaller than D", an
error naming no argument (rapo_fast/retrieval/op.py made a view contiguous only when its last stride was not 1). Now
`StepBuffer.search` and the registered op `rapo_fast::retrieval_search` copy any layout the backends cannot read and
give the same results as for `queries.contiguous()`; hypothesis draws the layouts (expanded rows, column slices,
transposes, overlapping as_strided views, padded rows). The extension itself, called directly with such a layout, now
names the argument (`queries` / `keys`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rapo_fast import _ext
from rapo_fast.retrieval.buffer import StepBuffer
from rapo_fast.retrieval.op import retrieval_search

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
def test_any_query_layout_searches_as_its_dense_copy(buffers, kind, q, metric, k, seed, exclude):
    torch.manual_seed(seed)
    base = torch.randn(8, D)
    queries = _layout(base, kind, q)
    excl = (torch.arange(q) % 5).expand(q) if exclude else None
    buf = buffers[metric]
    got = buf.search(queries, k, exclude_groups=excl)
    want = buf.search(queries.contiguous(), k, exclude_groups=None if excl is None else excl.contiguous())
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_expanded_queries_of_one_row(buffers):
    torch.manual_seed(0)
    one = torch.randn(1, D)
    view = one.expand(4, D)
    assert view.stride() == (0, 1)
    scores, pids = buffers["ip"].search(view, 3)
    want_s, want_p = buffers["ip"].search(one.repeat(4, 1), 3)
    assert torch.equal(pids, want_p) and torch.equal(scores, want_s)
    # the op itself, called directly with an expanded view (and an expanded exclude)
    buf = buffers["ip"]
    n = len(buf)
    s2, slots = retrieval_search(
        buf._keys[:n], buf._aux[:n], buf._group[:n], view, torch.tensor([1]).expand(4), 3, 0, float("-inf")
    )
    assert torch.equal(s2, want_s)


@pytest.mark.skipif(not _ext.has_extension(), reason="rapo_fast._C not built")
def test_extension_names_the_argument_with_overlapping_rows():
    """Called directly (below the Python op), the extension names which tensor has overlapping rows."""
    C = _ext.extension()
    torch.manual_seed(0)
    keys, queries = torch.randn(5, D), torch.randn(1, D).expand(3, D)
    aux, groups = torch.zeros(5), torch.zeros(5, dtype=torch.int64)
    scores, slots = torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int64)

    def search(keys, queries):
        tensors = dict(keys=keys, key_aux=aux, groups=groups, queries=queries, out_scores=scores, out_slots=slots)
        args = {name: _ext.dlpack(t) for name, t in tensors.items()}
        scalars = dict(k=2, metric=0, min_score=float("-inf"), num_threads=1, isa=-1)
        C.retrieval_search_cpu(**args, exclude=None, centre=None, **scalars)

    with pytest.raises(ValueError, match="queries"):
        search(keys, queries)
    with pytest.raises(ValueError, match="keys"):
        search(torch.randn(1, D).expand(5, D), queries.contiguous())
