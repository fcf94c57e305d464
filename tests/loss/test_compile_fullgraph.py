"""The public ops compile whole: `torch.compile(fullgraph=True, dynamic=True)` over rapo_loss (logits padded and flat,
hidden; the Triton path and the torch path), policy_loss_from_logp and StepBuffer's l2 search traces without a graph
break and gives the eager values and gradients, with a bounded number of compiles over batch shapes (one per layout,
not one per shape).

What makes it hold (docs/loss.md section 6, "Under torch.compile"): LossOptions reads its dataclass fields once at
import (Dynamo cannot trace dataclasses.fields); validation that reads tensor values on the host is skipped while
tracing; no Python loop runs over a batch dimension (the chunked reference runs in one piece while tracing, the l2
re-scoring loops over the k candidates, not the queries). Backend "aot_eager": the graphs and their backward are
traced as inductor would get them, without compiling C++ on the CPU. Not here: token_logprobs alone
(test_logprobs_ops.py), the eager numerics (test_loss.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import inputs_for, make_batch
from torch._dynamo.testing import CompileCounterWithBackend

import rapo_fast
from rapo_fast import StepBuffer
from rapo_fast.loss.policy_loss import policy_loss_from_logp

OPTS = dict(shaping_m=0.05, loss_agg="seq-mean-token-mean", entropy_coef=0.01, beta=0.04, return_metrics=True)
# two batch shapes per layout: padded logits, flat logits (+ cu_seqlens), hidden states (the Triton path only: the
# torch path's hidden states are the same reference, and each layout costs a trace of ~20 s on a loaded CPU)
LAYOUTS = {
    "padded": [dict(B=2, T=5), dict(B=3, T=7)],
    "flat": [dict(seg_lens=[4, 2, 6]), dict(seg_lens=[3, 5])],
    "hidden": [dict(B=2, T=5, H=8), dict(B=3, T=4, H=8)],
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(loss, x, leaves):
    return torch.autograd.grad(loss, [x[k] for k in leaves])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_rapo_loss_compiles_whole_over_batch_shapes(backend):
    counter = CompileCounterWithBackend("aot_eager")

    def loss_fn(**kw):
        return rapo_fast.rapo_loss(**kw, **OPTS, backend=backend)

    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=True, backend=counter)
    cases = [(layout, i, c) for layout, cs in LAYOUTS.items() for i, c in enumerate(cs)]
    for layout, i, case in cases:
        if backend == "torch" and layout == "hidden":
            continue
        before = counter.frame_count
        d = make_batch(V=11, seed=i, **case)
        x, leaves = inputs_for(d, torch.float32)
        # eager first: the first eager call fills rapo_fast's lazy caches (_dispatch's Triton probe), which a trace
        # would otherwise guard on as they were before the call (one extra compile, once per process)
        (want, want_m), (loss, metrics) = loss_fn(**x), compiled(**x)
        assert_close_verbose(loss, want, atol=1e-6, name=f"loss {case}")
        for k, v in want_m.scalars().items():
            assert_close_verbose(getattr(metrics, k), v, atol=1e-6, name=f"metric {k} {case}")
        for g, gw in zip(_grads(loss, x, leaves), _grads(want, x, leaves)):
            assert_close_verbose(g, gw, atol=1e-6, name=f"grad {case}")
        if i > 0:  # another batch shape of a layout already compiled: no recompile
            assert counter.frame_count == before, f"{layout} {case}: recompiled for a new batch shape"


def test_policy_loss_from_logp_compiles_whole():
    counter = CompileCounterWithBackend("aot_eager")

    def loss_fn(**kw):
        return policy_loss_from_logp(**kw, loss_agg="seq-mean-token-sum-norm")

    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=True, backend=counter)
    for i, lens in enumerate([[4, 2, 6], [3, 5], [2, 2, 2, 1]]):  # S >= 2: a size-1 dim is specialised
        d = make_batch(V=11, seed=i, seg_lens=lens)
        logp = torch.log_softmax(d["logits"], -1).gather(-1, d["targets"][:, None])[:, 0].requires_grad_(True)
        kw = {k: d[k] for k in ("old_logp", "advantages", "loss_mask", "retrieved_mask", "cu_seqlens")}
        want, got = loss_fn(logp=logp, **kw), compiled(logp=logp, **kw)
        assert_close_verbose(got, want, atol=1e-6, name=f"loss {lens}")
        assert_close_verbose(*(torch.autograd.grad(v, [logp])[0] for v in (got, want)), atol=1e-6)
        if i == 0:
            first = counter.frame_count
    assert counter.frame_count == first, "recompiled for a new batch shape"


def test_l2_search_compiles_once_over_query_counts():
    buf = StepBuffer(300, 24, dtype=torch.float16, metric="l2")
    buf.add(torch.randn(300, 24), torch.arange(300), torch.randint(0, 4, (300,)))

    def fn(queries, exclude):
        return buf.search(queries, 5, exclude_groups=exclude, min_score=-100.0)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    for q in (11, 4, 7):
        queries, exclude = torch.randn(q, 24), torch.randint(-1, 4, (q,))
        want, got = fn(queries, exclude), compiled(queries, exclude)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counter.frame_count == 1, f"{counter.frame_count} compiles over 3 query counts"
