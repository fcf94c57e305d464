"""Splice mode of the rollout: put a retrieved step's cached K/V into the lockstep cache instead of re-prefilling it.

What this is: the bridge from rapo_fast.rollouts.engine.DecodeEngine to rapo_fast.kv.splice.splice_kv: a segment is
spliced at the current end of the cache, all but its last token, keys rotated to the row's own position; the caller
feeds the last token (</retrieve>) through the model so that the next logits attend to the spliced K/V.
What this is not: the splice op (rapo_fast.kv.splice.splice_kv) or the K/V store (rapo_fast.kv.store.StepKVStore);
the splice math is in docs/kv_splice.md.
"""

from __future__ import annotations

import torch

from rapo_fast.rollouts.batch import KIND_RET


def splice_segments(engine, rows, spliced: list[tuple[int, list[int], int]], traces) -> None:
    """spliced: (row index, segment token ids, payload id) per retrieval. Appends the segments' tokens to the rows
    (kind retrieved), splices tokens [0, L-1) and queues the last token for the next feed."""
    from rapo_fast.kv.splice import RopeSpec, splice_kv

    store = traces.kv_store
    if store is None:
        raise ValueError("rollout: traces: expected StepTraces(..., kv_store=...) with mode='splice', got no kv_store")
    rope = getattr(traces, "rope", None)
    if rope is None:
        rope = traces.rope = RopeSpec.from_model(engine.model)
    slot = engine.num_columns
    n_new = max(len(seg) - 1 for _, seg, _ in spliced)
    reqs, lengths, rope_pos = [], [], []
    valid = torch.zeros(engine.batch, n_new, dtype=torch.bool)
    for i, seg, pid in spliced:
        if int(pid) not in store:
            raise ValueError(f"rollout: traces: expected cached K/V of payload {pid} (splice mode), got none")
        n = len(seg) - 1
        reqs.append((int(pid), engine.physical(int(i)), slot))
        lengths.append(n)
        rope_pos.append(int(engine.pos[i]))
        valid[i, :n] = True
    if n_new > 0:
        splice_kv(engine.cache, store, reqs, rope, lengths=lengths, rope_positions=rope_pos)
        engine.extend_columns(valid, n_new)
    for i, seg, _ in spliced:
        r = rows[i]
        r.append(seg[:-1], KIND_RET)
        r.cols.extend(range(slot, slot + len(seg) - 1))
        # the closing token goes through the model: it attends to the spliced K/V and yields the next logits
        r.append(seg[-1:], KIND_RET)
        r.to_feed.append(seg[-1])
