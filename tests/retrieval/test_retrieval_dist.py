"""ShardedStepBuffer over 2 gloo processes on the CPU (torch.multiprocessing spawn): every rank's search equals the
float64 brute force over the union of the shards, with global slot ids rank * capacity + slot deciding ties.

Not here: single-process semantics (test_retrieval.py, test_retrieval_buffer.py). NCCL runs only on GPU machines.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rapo_fast.reference.retrieval import search_ref

WORLD, CAP, D, K = 2, 40, 12, 9


def _data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(WORLD, CAP, D, generator=g)
    x[1, :5] = x[0, :5]  # cross-shard duplicates: the tie must go to rank 0's (smaller global) slot
    groups = torch.randint(0, 3, (WORLD, CAP), generator=g)
    queries = [torch.randn(q, D, generator=g) for q in (5, 3)]  # a different Q per rank
    queries[0][:2] = x[0, :2]
    excl = [torch.randint(-1, 3, (q.shape[0],), generator=g) for q in queries]
    return x, groups, queries, excl


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from rapo_fast import ShardedStepBuffer

        x, groups, queries, excl = _data()
        buf = ShardedStepBuffer(CAP, D, dtype=torch.float32, metric="ip")
        gslots = buf.add(x[rank], torch.arange(CAP) + 1000 * rank, groups[rank])
        assert gslots.tolist() == list(range(rank * CAP, (rank + 1) * CAP))
        assert buf.global_len() == WORLD * CAP
        s, p = buf.search(queries[rank], K, exclude_groups=excl[rank])
        s2, p2 = buf.search(queries[rank], K, min_score=1.0)
        torch.save({"s": s, "p": p, "s2": s2, "p2": p2}, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sharded_search_two_gloo_ranks(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    x, groups, queries, excl = _data()
    keys = x.reshape(WORLD * CAP, D)
    payload = torch.cat([torch.arange(CAP) + 1000 * r for r in range(WORLD)])
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"r{rank}.pt")
        for (s, p), kw in (((got["s"], got["p"]), {"exclude_groups": excl[rank]}), ((got["s2"], got["p2"]), {})):
            min_score = None if kw else 1.0
            ref_s, ref_i = search_ref(
                keys, queries[rank], K, "ip", groups.flatten(), kw.get("exclude_groups"), min_score
            )
            want_p = torch.where(ref_i >= 0, payload[ref_i.clamp_min(0)], torch.full_like(ref_i, -1))
            assert torch.equal(p, want_p), (rank, kw)
            torch.testing.assert_close(s.double(), ref_s, atol=1e-4, rtol=1e-5)
