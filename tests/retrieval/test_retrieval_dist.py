"""ShardedStepBuffer over 2 gloo processes on the CPU: every rank's search equals the float64 brute force over the union
of the shards, with global slot ids rank * capacity + slot deciding ties; a bad argument on one rank, or a k that
differs between ranks, makes every rank raise the same error (no rank blocked in a collective, no gloo abort), and the
group stays usable afterwards.

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


def _scenario_exact(rank: int) -> dict:
    _, _, queries, excl = _data()
    buf = _filled_buffer(rank)
    assert buf.global_len() == WORLD * CAP
    s, p = buf.search(queries[rank], K, exclude_groups=excl[rank])
    s2, p2 = buf.search(queries[rank], K, min_score=1.0)
    return {"s": s, "p": p, "s2": s2, "p2": p2}


def _expect_error(buf, rank: int, **kw) -> dict:
    """Calls search with kw (rank-specific bad arguments), records the error, then checks the group still works."""
    _, _, queries, _ = _data()
    args = {"queries": queries[rank], "k": K, **kw}
    try:
        buf.search(**args)
        error = None
    except (ValueError, TypeError) as exc:
        error = (type(exc).__name__, str(exc))
    s, p = buf.search(queries[rank], K)  # every rank is still in step: a valid search after the error
    return {"error": error, "s": s, "p": p}


def _scenario_bad_exclude_on_rank1(rank: int) -> dict:
    buf = _filled_buffer(rank)
    excl = torch.zeros(2 if rank == 1 else _data()[2][rank].shape[0], dtype=torch.int64)  # wrong length on rank 1
    return _expect_error(buf, rank, exclude_groups=excl)


def _scenario_bad_dim_on_rank1(rank: int) -> dict:
    buf = _filled_buffer(rank)
    q = torch.randn(3, D + 1 if rank == 1 else D)
    return _expect_error(buf, rank, queries=q)


def _scenario_k_differs(rank: int) -> dict:
    buf = _filled_buffer(rank)
    return _expect_error(buf, rank, k=K + rank)


def _scenario_min_score_differs(rank: int) -> dict:
    buf = _filled_buffer(rank)
    return _expect_error(buf, rank, min_score=0.5 * rank)


_SCENARIOS = {
    f.__name__.removeprefix("_scenario_"): f
    for f in (
        _scenario_exact,
        _scenario_bad_exclude_on_rank1,
        _scenario_bad_dim_on_rank1,
        _scenario_k_differs,
        _scenario_min_score_differs,
    )
}


def _worker(rank: int, port: int, out_dir: str, scenario: str) -> None:
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
        result = _SCENARIOS[scenario](rank)
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


def _run(scenario: str, tmp_path) -> list[dict]:
    """Spawns the WORLD ranks on `scenario`; returns each rank's result, or fails with every rank's error."""
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, store.port, str(tmp_path), scenario)) for r in range(WORLD)]
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
        raise AssertionError(f"scenario {scenario!r} failed:\n" + "\n".join(report))
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


def test_sharded_search_two_gloo_ranks(tmp_path):
    got = _run("exact", tmp_path)
    excl = _data()[3]
    for rank in range(WORLD):
        _assert_matches(got[rank]["s"], got[rank]["p"], rank, exclude_groups=excl[rank])
        _assert_matches(got[rank]["s2"], got[rank]["p2"], rank, min_score=1.0)


def _assert_same_error(got: list[dict], cls: str, *fragments: str) -> None:
    errors = [g["error"] for g in got]
    assert errors[0] is not None and errors[0][0] == cls, errors
    assert all(e == errors[0] for e in errors), errors  # the same class and text on every rank
    for fragment in fragments:
        assert fragment in errors[0][1], errors[0]
    for rank, g in enumerate(got):  # and the group was still in step for the next search
        _assert_matches(g["s"], g["p"], rank)


def test_bad_exclude_on_one_rank_raises_on_every_rank(tmp_path):
    _assert_same_error(_run("bad_exclude_on_rank1", tmp_path), "ValueError", "rank 1", "exclude_groups", "(3,)")


def test_bad_query_dim_on_one_rank_raises_on_every_rank(tmp_path):
    _assert_same_error(_run("bad_dim_on_rank1", tmp_path), "ValueError", "rank 1", "queries", f"[Q, {D}]")


def test_k_differing_between_ranks_raises_on_every_rank(tmp_path):
    _assert_same_error(_run("k_differs", tmp_path), "ValueError", "k must be the same on every rank", f"[{K}, {K + 1}]")


def test_min_score_differing_between_ranks_raises_on_every_rank(tmp_path):
    _assert_same_error(_run("min_score_differs", tmp_path), "ValueError", "min_score must be the same on every rank")
