"""ShardedStepBuffer over 2 gloo processes on the CPU: every rank's search equals the float64 brute force over the union
of the shards, with global slot ids rank * capacity + slot deciding ties; a bad argument on one rank, or a k or
min_score that differs between ranks, makes every rank raise the same error (no rank blocked in a collective, no gloo
abort), and the group stays usable after each (the bad arguments run one after another in one group).

Harness: the test process hosts the TCPStore on a port the OS picks (port 0, so no collision with another run), the
ranks are spawned processes joining it; every wait is bounded (the process group's timeout, and a deadline after which
the test kills its ranks), and a failing rank's traceback, or the signal that killed it, is in the assertion message.
Not here: single-process semantics (test_retrieval.py, test_retrieval_buffer.py). NCCL runs only on GPU machines.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rapo_fast.reference.retrieval import search_ref

WORLD, CAP, D, K = 2, 40, 12, 9
# Sized for a loaded 2-core machine: two spawned interpreters import torch and rapo_fast (tens of seconds there), then
# wait on each other. A collective that waits longer than PG_TIMEOUT fails in the rank instead of blocking it.
PG_TIMEOUT_S, DEADLINE_S = 120, 300


def _data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(WORLD, CAP, D, generator=g)
    x[1, :5] = x[0, :5]  # cross-shard duplicates: the tie must go to rank 0's (smaller global) slot
    groups = torch.randint(0, 3, (WORLD, CAP), generator=g)
    queries = [torch.randn(q, D, generator=g) for q in (5, 3)]  # a different Q per rank
    queries[0][:2] = x[0, :2]
    excl = [torch.randint(-1, 3, (q.shape[0],), generator=g) for q in queries]
    return x, groups, queries, excl


def _filled_buffer(rank: int):
    from rapo_fast import ShardedStepBuffer

    x, groups, _, _ = _data()
    buf = ShardedStepBuffer(CAP, D, dtype=torch.float32, metric="ip")
    gslots = buf.add(x[rank], torch.arange(CAP) + 1000 * rank, groups[rank])
    assert gslots.tolist() == list(range(rank * CAP, (rank + 1) * CAP))
    return buf


def _exact(rank: int) -> dict:
    _, _, queries, excl = _data()
    buf = _filled_buffer(rank)
    assert buf.global_len() == WORLD * CAP
    s, p = buf.search(queries[rank], K, exclude_groups=excl[rank])
    s2, p2 = buf.search(queries[rank], K, min_score=1.0)
    return {"s": s, "p": p, "s2": s2, "p2": p2}


def _errors(rank: int) -> dict:
    """Each bad argument in turn (rank-specific), its error recorded, then a valid search: every rank is still in step
    after each error."""
    _, _, queries, _ = _data()
    buf = _filled_buffer(rank)
    bad_exclude = torch.zeros(2 if rank == 1 else queries[rank].shape[0], dtype=torch.int64)  # wrong length on rank 1
    cases = {
        "bad_exclude_on_rank1": {"exclude_groups": bad_exclude},
        "bad_dim_on_rank1": {"queries": torch.randn(3, D + 1 if rank == 1 else D)},
        "k_differs": {"k": K + rank},
        "min_score_differs": {"min_score": 0.5 * rank},
    }
    out = {}
    for name, kw in cases.items():
        try:
            buf.search(**{"queries": queries[rank], "k": K, **kw})
            error = None
        except (ValueError, TypeError) as exc:
            error = (type(exc).__name__, str(exc))
        s, p = buf.search(queries[rank], K)
        out[name] = {"error": error, "s": s, "p": p}
    return out


def _scenario(rank: int) -> dict:
    """What one rank does: the exact searches, then the bad arguments, in one process group."""
    return {"exact": _exact(rank), "errors": _errors(rank)}


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: joins the test's store, runs the scenario, writes its result or its traceback."""
    # A rank killed by a signal (SIGABRT from a C++ std::terminate, SIGSEGV) leaves no Python traceback; faulthandler
    # writes every thread's Python stack to r{rank}.fault so the report says in which phase the rank died.
    fault = open(os.path.join(out_dir, f"r{rank}.fault"), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(file=fault, all_threads=True)
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", port, WORLD, is_master=False, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S)
        )
        result = _scenario(rank)
        dist.barrier()  # every rank has read all it was sent before any rank exits (an exit with unread data resets)
        torch.save(result, os.path.join(out_dir, f"r{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"r{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    # Ends without destroy_process_group or interpreter teardown. Rarely (twice in about 15 full runs, in different
    # scenarios), a rank died by SIGABRT ("terminate called without an active exception": a C++ std::thread left
    # joinable) after its peer had exited cleanly, so after every collective of the scenario had completed: in gloo's
    # shutdown or at process exit, torch's teardown, not the ShardedStepBuffer semantics this file tests. The result
    # is on disk; _exit skips that teardown.
    fault.flush()
    os._exit(0)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running at the deadline (killed)"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _run(tmp_path) -> list[dict]:
    """Spawns the WORLD ranks on `_scenario`; returns each rank's result, or fails with every rank's error."""
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, store.port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:  # only the ranks this test started
        if p.is_alive():
            p.kill()
            p.join(10)
    codes = [None if p.is_alive() or p.exitcode is None else p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        report = []
        for r, c in enumerate(codes):
            texts = [(tmp_path / f"r{r}.{ext}") for ext in ("err", "fault")]
            detail = "".join(t.read_text() for t in texts if t.exists())
            done = "result written" if (tmp_path / f"r{r}.pt").exists() else "no result written"
            report.append(f"--- rank {r}: {_exit_text(c)}, {done}\n{detail}")
        raise AssertionError("the ranks failed:\n" + "\n".join(report))
    return [torch.load(tmp_path / f"r{r}.pt") for r in range(WORLD)]


def _reference(rank: int, **kw):
    x, groups, queries, _ = _data()
    keys = x.reshape(WORLD * CAP, D)
    payload = torch.cat([torch.arange(CAP) + 1000 * r for r in range(WORLD)])
    ref_s, ref_i = search_ref(
        keys, queries[rank], K, "ip", groups.flatten(), kw.get("exclude_groups"), kw.get("min_score")
    )
    return ref_s, torch.where(ref_i >= 0, payload[ref_i.clamp_min(0)], torch.full_like(ref_i, -1))


def _assert_matches(s, p, rank: int, **kw) -> None:
    ref_s, want_p = _reference(rank, **kw)
    assert torch.equal(p, want_p), (rank, kw)
    torch.testing.assert_close(s.double(), ref_s, atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's results: the ranks run once for the module's tests."""
    return _run(tmp_path_factory.mktemp("ranks"))


def test_sharded_search_two_gloo_ranks(ranks):
    excl = _data()[3]
    for rank, got in enumerate(r["exact"] for r in ranks):
        _assert_matches(got["s"], got["p"], rank, exclude_groups=excl[rank])
        _assert_matches(got["s2"], got["p2"], rank, min_score=1.0)


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("bad_exclude_on_rank1", ("rank 1", "exclude_groups", "(3,)")),
        ("bad_dim_on_rank1", ("rank 1", "queries", f"[Q, {D}]")),
        ("k_differs", ("k: expected one value on every rank", f"[{K}, {K + 1}]")),
        ("min_score_differs", ("min_score: expected one value on every rank",)),
    ],
)
def test_bad_argument_on_one_rank_raises_the_same_error_on_every_rank(ranks, case, fragments):
    got = [r["errors"][case] for r in ranks]
    errs = [g["error"] for g in got]
    assert errs[0] is not None and errs[0][0] == "ValueError", errs
    assert all(e == errs[0] for e in errs), errs  # the same class and text on every rank
    for fragment in fragments:
        assert fragment in errs[0][1], errs[0]
    for rank, g in enumerate(got):  # and the group was still in step for the next search
        _assert_matches(g["s"], g["p"], rank)
