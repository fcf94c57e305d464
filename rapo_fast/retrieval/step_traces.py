"""StepTraces: the step-trace buffer of RAPO (history embedding -> the step taken next), built from JSONL trajectories.

What this is: the glue between an off-policy source and `rapo_fast.StepBuffer`. `StepTraces.from_jsonl` reads
trajectories (the JSONL record of docs/formats.md, read by rapo_fast.retrieval.jsonl), keeps the top K per query by
reward (K=5, as in the paper), splits them into steps, encodes each step's preceding history with any encoder
(rapo_fast.retrieval.encoders) as the key, and stores the step's tokens (wrapped in `<retrieve> ... </retrieve>`, the
segment a rollout inserts) as the payload; with a model and a `StepKVStore`, also each segment's K/V (computed at
positions 0..L-1) for splice mode. During training the policy's own successful steps can be added (`add_steps`),
under the prompt's group id so that a rollout can exclude its own group. What it is not: the nearest-neighbour search
(StepBuffer) or the splicing (rapo_fast.kv.splice); the retrieval contract is in docs/retrieval.md.

Group ids: on-policy steps carry the prompt's query id; off-policy steps carry OFFPOLICY_GROUP_BASE + query id, so
excluding a prompt's own group removes the policy's own earlier steps on that prompt but keeps the off-policy
agent's steps, which are what the paper retrieves.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

OFFPOLICY_GROUP_BASE = 1 << 40
RETRIEVE_OPEN, RETRIEVE_CLOSE = "<retrieve>", "</retrieve>"


def strip_retrieve_markers(text: str) -> str:
    """A history as the encoder sees it: retrieved steps count as steps, without their delimiters."""
    return " ".join(w for w in text.split() if w not in (RETRIEVE_OPEN, RETRIEVE_CLOSE))


def split_trajectory(record: dict) -> list[tuple[str, str]]:
    """(history, step) pairs of one trajectory record: history = prompt + the steps before, step = one
    (thought, tool call, observation) step. The final answer is not a step (it ends the trajectory)."""
    out, history = [], record["prompt"]
    for step in record["steps"]:
        out.append((history, step))
        history = history + " " + step
    return out


def top_k_by_reward(records: Sequence[dict], top_k: int) -> list[dict]:
    """Per query_id, the `top_k` records with the highest reward (ties: file order)."""
    by_q: dict[int, list[dict]] = {}
    for r in records:
        by_q.setdefault(int(r["query_id"]), []).append(r)
    out = []
    for q in sorted(by_q):
        out.extend(sorted(by_q[q], key=lambda r: -float(r["reward"]))[:top_k])
    return out


class StepTraces:
    """A StepBuffer of step keys plus the payload segments (token ids) and optional K/V they point to.

    Args: buffer (a rapo_fast.StepBuffer with dim == the encoder's output dim), encoder (texts -> [N, D] fp32),
    tokenizer (encode(text) -> ids), kv_store (optional rapo_fast.StepKVStore keyed by payload id), model (needed with
    kv_store to compute the K/V of new segments).
    """

    def __init__(self, buffer, encoder: Callable, tokenizer, *, kv_store=None, model: torch.nn.Module | None = None):
        self.buffer, self.encoder, self.tokenizer = buffer, encoder, tokenizer
        self.kv_store, self.model = kv_store, model
        self.payloads: list[list[int]] = []
        self.num_offpolicy = 0
        self.num_onpolicy = 0
        if kv_store is not None and model is None:
            raise ValueError("StepTraces: kv_store needs the model that computes the segments' K/V (model=None given)")

    @property
    def has_on_policy(self) -> bool:
        return self.num_onpolicy > 0

    def __len__(self) -> int:
        return len(self.payloads)

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        encoder: Callable,
        tokenizer=None,
        top_k: int = 5,
        *,
        capacity: int | None = None,
        metric: str = "cosine",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_store=None,
        model: torch.nn.Module | None = None,
        eviction: str = "fifo",
    ) -> StepTraces:
        """Read trajectories, keep the top `top_k` per query by reward, split into steps and fill a new StepBuffer.

        The buffer's capacity defaults to 4x the off-policy steps (room for on-policy steps added later).
        """
        from rapo_fast.retrieval.buffer import StepBuffer
        from rapo_fast.retrieval.jsonl import read_jsonl

        if tokenizer is None:
            raise ValueError("StepTraces.from_jsonl: tokenizer is required (the payloads are token ids)")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"StepTraces.from_jsonl: top_k must be a positive int, got {top_k!r}")
        kept = top_k_by_reward(read_jsonl(path), top_k)
        pairs = [(h, s, int(r["query_id"]), float(r["reward"])) for r in kept for h, s in split_trajectory(r)]
        dim = int(getattr(encoder, "dim", 0)) or int(encoder(["probe"]).shape[-1])
        cap = capacity if capacity is not None else max(64, 4 * len(pairs))
        buffer = StepBuffer(cap, dim, dtype=dtype, device=device, metric=metric, eviction=eviction)
        traces = cls(buffer, encoder, tokenizer, kv_store=kv_store, model=model)
        if pairs:
            traces._add(
                [h for h, *_ in pairs],
                [s for _, s, *_ in pairs],
                [OFFPOLICY_GROUP_BASE + q for *_, q, _ in pairs],
                [sc for *_, sc in pairs],
            )
            traces.num_offpolicy = len(pairs)
        return traces

    def _add(
        self, histories: Sequence[str], steps: Sequence[str], group_ids: Sequence[int], scores: Sequence[float]
    ) -> torch.Tensor:
        keys = self.encoder([strip_retrieve_markers(h) for h in histories]).float()
        start = len(self.payloads)
        segs = [self.tokenizer.encode(f"{RETRIEVE_OPEN} {strip_retrieve_markers(s)} {RETRIEVE_CLOSE}") for s in steps]
        self.payloads.extend(segs)
        pids = torch.arange(start, start + len(segs), dtype=torch.int64)
        dev = getattr(self.buffer, "device", "cpu")
        self.buffer.add(
            keys.to(dev),
            pids.to(dev),
            torch.tensor(list(group_ids), dtype=torch.int64, device=dev),
            torch.tensor(list(scores), dtype=torch.float32, device=dev),
        )
        if self.kv_store is not None:
            self._store_kv(pids.tolist(), segs)
        return pids

    def _store_kv(self, pids: list[int], segs: list[list[int]]) -> None:
        self.kv_store.add_from_model(self.model, pids, segs, batch_size=64, replace=True)

    def refresh_kv(self) -> None:
        """Recompute every payload's K/V with the current model (cached K/V go stale as the policy trains)."""
        if self.kv_store is not None and self.payloads:
            self._store_kv(list(range(len(self.payloads))), self.payloads)

    def add_steps(
        self,
        histories: Sequence[str],
        steps: Sequence[str],
        group_ids: Sequence[int],
        scores: Sequence[float] | None = None,
    ) -> torch.Tensor:
        """Add the policy's own steps (on-policy) under their prompts' group ids; returns their payload ids [M]."""
        if not (len(histories) == len(steps) == len(group_ids)):
            raise ValueError(
                f"add_steps: histories, steps and group_ids must have one entry per step, got lengths "
                f"{len(histories)}, {len(steps)}, {len(group_ids)}"
            )
        if not steps:
            return torch.zeros(0, dtype=torch.int64)
        pids = self._add(histories, steps, group_ids, [1.0] * len(steps) if scores is None else scores)
        self.num_onpolicy += len(steps)
        return pids

    def retrieve(
        self, histories: Sequence[str], exclude_groups: Sequence[int] | None = None, min_score: float | None = None
    ) -> tuple[list[list[int] | None], torch.Tensor, torch.Tensor]:
        """Top-1 step for each history: (segments, payload ids [Q] int64 with -1 = none, scores [Q] fp32).

        exclude_groups: one group id per history whose steps must not be returned (or None).
        """
        if not histories:
            return [], torch.zeros(0, dtype=torch.int64), torch.zeros(0)
        dev = getattr(self.buffer, "device", "cpu")
        q = self.encoder([strip_retrieve_markers(h) for h in histories]).float().to(dev)
        excl = None if exclude_groups is None else torch.tensor(list(exclude_groups), dtype=torch.int64, device=dev)
        scores, pids = self.buffer.search(q, 1, exclude_groups=excl, min_score=min_score)
        pids, scores = pids[:, 0].cpu(), scores[:, 0].float().cpu()
        segs = [self.payloads[p] if p >= 0 else None for p in pids.tolist()]
        return segs, pids, scores

    # -- persistence ------------------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Buffer (StepBuffer.save), payloads and counters (JSON), and the K/V store's contents when there is one (the
        cached K/V are those of the policy that computed them, which a resume must keep: see `load`). The encoder is
        not saved."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.buffer.save(d / "buffer")
        if self.kv_store is not None:
            torch.save(self.kv_store.state_dict(), d / "kv_store.pt.tmp")
            (d / "kv_store.pt.tmp").replace(d / "kv_store.pt")
        meta = {"payloads": self.payloads, "num_offpolicy": self.num_offpolicy, "num_onpolicy": self.num_onpolicy}
        tmp = d / "traces.json.tmp"
        tmp.write_text(json.dumps(meta))
        tmp.replace(d / "traces.json")

    @classmethod
    def load(cls, directory: str | Path, encoder: Callable, tokenizer, *, kv_store=None, model=None) -> StepTraces:
        """Inverse of save. With a kv_store, its saved contents are restored (so that a run resumed between K/V
        refreshes splices what the uninterrupted run would have); a save without them (or from an older version) has
        the payloads' K/V recomputed with `model`."""
        from rapo_fast.retrieval.buffer import StepBuffer

        d = Path(directory)
        meta = json.loads((d / "traces.json").read_text())
        traces = cls(StepBuffer.load(d / "buffer"), encoder, tokenizer, kv_store=kv_store, model=model)
        traces.payloads = [list(p) for p in meta["payloads"]]
        traces.num_offpolicy, traces.num_onpolicy = meta["num_offpolicy"], meta["num_onpolicy"]
        if kv_store is not None:
            if (d / "kv_store.pt").exists():
                kv_store.load_state_dict(torch.load(d / "kv_store.pt", weights_only=True))
            else:
                traces.refresh_kv()
        return traces
