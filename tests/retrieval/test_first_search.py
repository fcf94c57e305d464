"""The first search of a process is as fast as later ones: it does not import torch._dynamo (the first call of a
torch.library custom op does, 1.5-3 s on a CPU), while the op stays registered for torch.compile and opcheck.

Not here: search results (tests/retrieval/test_retrieval.py) or the traced path (the compile tests there).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from rapo_fast.retrieval.op import METRIC_CODES, retrieval_search

_SCRIPT = textwrap.dedent(
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
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    print(out.stdout.strip())


def test_the_op_stays_registered_and_agrees_with_the_eager_call():
    assert hasattr(torch.ops.rapo_fast, "retrieval_search")
    keys = torch.randn(50, 8)
    aux = torch.zeros(50)
    groups = torch.arange(50, dtype=torch.int64)
    q = torch.randn(2, 8)
    args = (keys, aux, groups, q, None, 3, METRIC_CODES["ip"], float("-inf"), None)
    eager = retrieval_search(*args)
    via_op = retrieval_search.op(*args)
    for a, b in zip(eager, via_op):
        assert torch.equal(a, b)
