"""StepTraces: the step-trace buffer of RAPO (history embedding -> the step taken next), built from JSONL trajectories.

What this is: the glue between an off-policy source and `rapo_fast.StepBuffer`: `StepTraces.from_jsonl`, `add_steps`
for the policy's own successful steps, and `retrieve`. Group ids, pinned steps, eviction and memory bounds:
docs/retrieval.md section 6; the saved layout: docs/formats.md section 3.
What it is not: the nearest-neighbour search (StepBuffer) or the splicing (rapo_fast.kv.splice).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from rapo_fast import _checks as C
from rapo_fast._atomic import FormatError, VersionWriter, read_json_object, read_version
from rapo_fast._tokens import encode_plain

OFFPOLICY_GROUP_BASE = 1 << 40
RETRIEVE_OPEN, RETRIEVE_CLOSE = "<retrieve>", "</retrieve>"
TRACES_FORMAT, TRACES_VERSION = "rapo_fast.StepTraces", 3  # 1: no manifest; 2: all payloads ever added; 3: live ones
_PREFIX, _TRACES, _KV = "traces", "traces.json", "kv_store.pt"


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
    kv_store to compute the K/V of new segments), pin_offpolicy (keep the off-policy steps when on-policy steps fill
    the buffer: docs/retrieval.md section 6; applies to a buffer with `set_pinned`, i.e. a StepBuffer).
    """

    def __init__(
        self,
        buffer,
        encoder: Callable,
        tokenizer,
        *,
        kv_store=None,
        model: torch.nn.Module | None = None,
        pin_offpolicy: bool = True,
    ):
        self.buffer, self.encoder, self.tokenizer = buffer, encoder, tokenizer
        self.kv_store, self.model = kv_store, model
        # payload id -> segment of the steps the buffer holds; the next id is num_offpolicy + num_onpolicy
        self.payloads: dict[int, list[int]] = {}
        self.num_offpolicy = 0
        self.num_onpolicy = 0
        if kv_store is not None and model is None:
            raise ValueError("StepTraces: model: expected the model that computes kv_store's K/V, got None")
        self.pin_offpolicy = C.check_bool("StepTraces: pin_offpolicy", pin_offpolicy)
        enc_dim, buf_dim = getattr(encoder, "dim", None), getattr(buffer, "dim", None)
        if isinstance(enc_dim, int) and isinstance(buf_dim, int) and enc_dim != buf_dim:
            # caught here rather than at the first add or search, where the error names only `embeddings`
            raise ValueError(
                f"StepTraces: encoder: expected dim {buf_dim} (the buffer's, {type(buffer).__name__}.dim), got "
                f"{type(encoder).__name__}.dim={enc_dim}"
            )

    def pin_offpolicy_steps(self) -> None:
        """Pin the stored off-policy steps (payload ids below num_offpolicy) when pin_offpolicy and the buffer supports
        pins (`set_pinned`). from_jsonl and load call it; call it again after replacing `buffer` by a loaded copy."""
        if self.pin_offpolicy and self.num_offpolicy and hasattr(self.buffer, "set_pinned"):
            self.buffer.set_pinned(self.buffer.payload_ids < self.num_offpolicy)

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
        pin_offpolicy: bool = True,
    ) -> StepTraces:
        """Read trajectories, keep the top `top_k` per query by reward, split into steps and fill a new StepBuffer.

        The buffer's capacity defaults to 4x the off-policy steps (room for on-policy steps added later). The
        off-policy steps are pinned once stored (pin_offpolicy; docs/retrieval.md section 6), so the buffer holds what
        it held before pins existed until on-policy steps arrive.
        """
        from rapo_fast.retrieval.buffer import StepBuffer
        from rapo_fast.retrieval.jsonl import read_jsonl

        if tokenizer is None:
            raise ValueError("StepTraces.from_jsonl: tokenizer is required (the payloads are token ids)")
        C.check_int("StepTraces.from_jsonl: top_k", top_k, lo=1)
        kept = top_k_by_reward(read_jsonl(path), top_k)
        pairs = [(h, s, int(r["query_id"]), float(r["reward"])) for r in kept for h, s in split_trajectory(r)]
        dim = int(getattr(encoder, "dim", 0)) or int(encoder(["probe"]).shape[-1])
        cap = capacity if capacity is not None else max(64, 4 * len(pairs))
        buffer = StepBuffer(cap, dim, dtype=dtype, device=device, metric=metric, eviction=eviction)
        traces = cls(buffer, encoder, tokenizer, kv_store=kv_store, model=model, pin_offpolicy=pin_offpolicy)
        if pairs:
            traces._add(
                traces.encode([h for h, *_ in pairs]),
                [s for _, s, *_ in pairs],
                [OFFPOLICY_GROUP_BASE + q for *_, q, _ in pairs],
                [sc for *_, sc in pairs],
            )
            traces.num_offpolicy = len(pairs)
            traces.pin_offpolicy_steps()  # after the adds: their slots are those of an unpinned fill
        return traces

    def encode(self, histories: Sequence[str]) -> torch.Tensor:
        """The keys of `histories` (fp32 [N, D] on the CPU): the encoder's output for each history without its
        <retrieve> delimiters, checked ([N, D], finite). What `retrieve` and `add_steps` search and store; a caller
        that encodes elsewhere (a verl agent-loop worker) passes the result to `search` / `add_encoded`."""
        n = len(histories)
        if not n:  # no encoder call: an encoder need not take an empty list
            return torch.zeros(0, int(getattr(self.buffer, "dim", 0) or 0))
        keys = self.encoder([strip_retrieve_markers(h) for h in histories])
        if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[0] != n:
            got = tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
            raise ValueError(f"encode: expected a [{n}, D] tensor from the encoder for {n} histories, got {got}")
        keys = keys.detach().float().cpu()
        if not bool(torch.isfinite(keys).all()):
            raise ValueError("encode: expected finite keys from the encoder, got NaN/inf for some histories")
        return keys

    def check_keys(self, keys: torch.Tensor, n: int | None = None, name: str = "keys") -> torch.Tensor:
        """`keys` as fp32 [N, D] (D: the buffer's dim; N: n when given), finite; else TypeError/ValueError naming it."""
        if not isinstance(keys, torch.Tensor) or not keys.is_floating_point():
            raise TypeError(f"{name}: expected a float torch.Tensor [N, D], got {type(keys).__name__}")
        dim = getattr(self.buffer, "dim", None)  # a buffer-like object without one is trusted to check
        if keys.dim() != 2 or keys.shape[1] != (dim or keys.shape[1]) or (n is not None and keys.shape[0] != n):
            want = f"[{'N' if n is None else n}, {dim}]"
            raise ValueError(f"{name}: expected shape {want} (the buffer's dim), got {tuple(keys.shape)}")
        keys = keys.detach().float()
        C.check_finite(name, keys)
        return keys

    def _add(
        self, keys: torch.Tensor, steps: Sequence[str], group_ids: Sequence[int], scores: Sequence[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokenize and check everything, then store (payloads, K/V, buffer); returns (payload ids [M], the buffer's
        slots [M] on the CPU, -1 for a step it did not keep). keys: checked [M, D] (encode / check_keys). A refusal at
        any point leaves the object as it was: what is checked first is what `load` would refuse (non-finite keys, bad
        token ids), and a failure while storing undoes the payloads and K/V already written. Then the steps the buffer
        overwrote or dropped lose their segment and K/V."""
        n = len(steps)
        # no special tokens: a segment is spliced into the middle of a rollout (a BOS there would be a foreign token)
        segs = [
            encode_plain(self.tokenizer, f"{RETRIEVE_OPEN} {strip_retrieve_markers(s)} {RETRIEVE_CLOSE}") for s in steps
        ]
        for i, seg in enumerate(segs):  # what load accepts: a non-empty list of token ids >= 0
            if isinstance(seg, torch.Tensor):
                seg = seg.tolist()
            segs[i] = C.check_int_list(f"add_steps: the tokenizer's ids for steps[{i}]", seg, lo=0)
            if not segs[i]:
                raise ValueError(f"add_steps: the tokenizer returned no token ids for steps[{i}]")
        start = self.num_offpolicy + self.num_onpolicy
        pids = torch.arange(start, start + n, dtype=torch.int64)
        dev = getattr(self.buffer, "device", "cpu")
        before = self.buffer.payload_ids.clone()  # the ids at the slots this add may overwrite (one writer: stable)
        # Segments and K/V first, then the buffer (which locks itself): a retrieve running in another thread meanwhile
        # never gets a payload id whose segment or K/V is missing (docs/retrieval.md, "Thread safety": one writer,
        # many readers). The new payload ids are not in the buffer until its add succeeds, so undoing them is safe.
        self.payloads.update(zip(pids.tolist(), segs))
        try:
            if self.kv_store is not None:
                self._store_kv(pids.tolist(), segs)
            slots = self.buffer.add(
                keys.to(dev),
                pids.to(dev),
                torch.tensor(list(group_ids), dtype=torch.int64, device=dev),
                torch.tensor(list(scores), dtype=torch.float32, device=dev),
            )
        except BaseException:
            self._forget(pids.tolist())
            raise
        # forgotten once the buffer let them go: a search that found one before this add repeats itself (`search`)
        over = slots[(slots >= 0) & (slots < len(before))]
        self._forget(before[over.to(before.device)].tolist() + pids[slots.cpu() < 0].tolist())
        return pids, slots.cpu()

    def _forget(self, pids: list[int]) -> None:
        for p in pids:
            self.payloads.pop(p, None)
        if self.kv_store is not None:
            self.kv_store.evict(pids)

    def _store_kv(self, pids: list[int], segs: list[list[int]]) -> None:
        self.kv_store.add_from_model(self.model, pids, segs, batch_size=64, replace=True)

    def refresh_kv(self) -> None:
        """Recompute the live payloads' K/V with the current model (cached K/V go stale as the policy trains): work
        proportional to the steps the buffer holds, not to the steps ever added."""
        if self.kv_store is not None and self.payloads:
            self._store_kv(list(self.payloads), list(self.payloads.values()))

    def add_steps(
        self,
        histories: Sequence[str],
        steps: Sequence[str],
        group_ids: Sequence[int],
        scores: Sequence[float] | None = None,
        *,
        return_slots: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Add the policy's own steps (on-policy) under their prompts' group ids; returns their payload ids [M].

        histories, steps: str; group_ids: ints in [0, 2^63 - 1] (bool refused); scores: None (1.0 each) or finite
        numbers. All or nothing: every argument, the encoder's keys and the tokenizer's ids are checked before anything
        is stored, so a refused call (ValueError/TypeError naming the argument) leaves the object, and what it saves,
        as it was.

        Every step gets a payload id (and counts in num_onpolicy), but the buffer may not keep it: a full buffer whose
        every slot holds a pinned off-policy step drops new steps, lowest_score eviction drops a step scored below
        every evictable one, and a batch larger than the free room overwrites its own first steps (StepBuffer.add).
        return_slots=True returns (payload ids [M], slots [M] int64 on the CPU) instead, slot -1 for a step the
        buffer did not keep, so that a caller can count what was stored: `int((slots >= 0).sum())`."""
        histories = C.check_str_list("add_steps: histories", histories)
        C.check_str_list("add_steps: steps", steps)
        if len(histories) != len(steps):
            raise ValueError(f"add_steps: steps: expected one entry per history ({len(histories)}), got {len(steps)}")
        return self.add_encoded(self.encode(histories), steps, group_ids, scores, return_slots=return_slots)

    def add_encoded(
        self,
        keys: torch.Tensor,
        steps: Sequence[str],
        group_ids: Sequence[int],
        scores: Sequence[float] | None = None,
        *,
        return_slots: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """add_steps with the histories already encoded: keys [M, D] fp32 (`encode`'s output, made wherever the
        histories are). Same checks, result and all-or-nothing rule as add_steps."""
        C.check_bool("add_steps: return_slots", return_slots)
        C.check_str_list("add_steps: steps", steps)
        if isinstance(group_ids, torch.Tensor):
            group_ids = group_ids.tolist()
        if not isinstance(keys, torch.Tensor) or len(keys) != len(steps) or len(group_ids) != len(steps):
            got = len(keys) if isinstance(keys, torch.Tensor) else type(keys).__name__
            raise ValueError(
                f"add_steps: keys, steps and group_ids: expected one entry per step each, got lengths "
                f"{got}, {len(steps)}, {len(group_ids)}"
            )
        keys = self.check_keys(keys, len(steps), "add_steps: keys")
        groups = C.check_int_list("add_steps: group_ids", group_ids, lo=0)
        if scores is None:
            sc = [1.0] * len(steps)
        else:
            if isinstance(scores, torch.Tensor):
                scores = scores.tolist()
            if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence) or len(scores) != len(steps):
                raise ValueError(
                    f"add_steps: scores: expected None or a list of {len(steps)} numbers, got {C.brief(scores)}"
                )
            sc = [C.check_float(f"add_steps: scores[{i}]", x) for i, x in enumerate(scores)]
        if not steps:
            empty = torch.zeros(0, dtype=torch.int64)
            return (empty, empty.clone()) if return_slots else empty
        pids, slots = self._add(keys, list(steps), groups, sc)
        self.num_onpolicy += len(steps)
        return (pids, slots) if return_slots else pids

    def retrieve(
        self,
        histories: Sequence[str],
        exclude_groups: Sequence[int] | None = None,
        min_score: float | None = None,
        backend: str = "auto",
    ) -> tuple[list[list[int] | None], torch.Tensor, torch.Tensor]:
        """Top-1 step for each history: (segments, payload ids [Q] int64 with -1 = none, scores [Q] fp32).

        exclude_groups: one group id per history whose steps must not be returned (or None; ints in int64's range,
        negative: none excluded). backend: the search backend, as StepBuffer.search ("auto" | "cpu" | "cuda" |
        "triton"); under "auto" the buffer's search is called without it, as before, so any buffer-like object works.
        """
        C.check_str_list("retrieve: histories", histories)
        if exclude_groups is not None:  # int64's range (ValueError naming the entry), before any work is done
            if isinstance(exclude_groups, torch.Tensor):
                exclude_groups = exclude_groups.tolist()
            exclude_groups = C.check_int_list("exclude_groups", exclude_groups, len(histories))
        if not histories:
            return [], torch.zeros(0, dtype=torch.int64), torch.zeros(0)
        return self.search(self.encode(histories), exclude_groups, min_score, backend)

    def search(
        self,
        keys: torch.Tensor,
        exclude_groups: Sequence[int] | None = None,
        min_score: float | None = None,
        backend: str = "auto",
    ) -> tuple[list[list[int] | None], torch.Tensor, torch.Tensor]:
        """`retrieve` with the histories already encoded: keys [Q, D] fp32 (`encode`'s output)."""
        keys = self.check_keys(keys, name="search: keys")
        if exclude_groups is not None:  # int64's range (ValueError naming the entry), before any work is done
            if isinstance(exclude_groups, torch.Tensor):
                exclude_groups = exclude_groups.tolist()
            exclude_groups = C.check_int_list("exclude_groups", exclude_groups, len(keys))
        if not len(keys):
            return [], torch.zeros(0, dtype=torch.int64), torch.zeros(0)
        dev = getattr(self.buffer, "device", "cpu")
        q = keys.to(dev)
        excl = None if exclude_groups is None else torch.tensor(exclude_groups, dtype=torch.int64, device=dev)
        extra = {} if backend == "auto" else {"backend": backend}
        while True:  # again if an add in another thread evicted a step found, before its look-up (docs/retrieval.md)
            scores, pids = self.buffer.search(q, 1, exclude_groups=excl, min_score=min_score, **extra)
            pids, scores = pids[:, 0].cpu(), scores[:, 0].float().cpu()
            segs = [self.payloads.get(p) if p >= 0 else None for p in pids.tolist()]
            if all(seg is not None for seg, p in zip(segs, pids.tolist()) if p >= 0):
                return segs, pids, scores

    def save(self, directory: str | Path) -> None:
        """Save as one versioned unit (docs/formats.md section 3): the buffer (a nested StepBuffer snapshot), the
        live payloads and the counters (traces.json), and the K/V store's contents when there is one (kv_store.pt: the
        cached K/V are those of the policy that computed them, which a resume must keep: see `load`), all listed with
        their SHA-256 in one manifest that CURRENT switches to atomically. The encoder is not saved. Call it from the
        thread that adds steps (as the trainer does): a save beside a concurrent add_steps could capture its parts at
        two moments, which `load` would then refuse."""
        with VersionWriter(directory, _PREFIX, TRACES_FORMAT, TRACES_VERSION) as w:
            self.buffer.save(w.path / "buffer")
            w.add_nested("buffer")
            pids = sorted(self.payloads)
            meta = {
                "payload_ids": pids,
                "payloads": [self.payloads[p] for p in pids],
                "num_offpolicy": self.num_offpolicy,
                "num_onpolicy": self.num_onpolicy,
                "pin_offpolicy": self.pin_offpolicy,  # optional field: a save without it reads as True
            }
            w.write_bytes(_TRACES, json.dumps(meta, separators=(",", ":")).encode())
            if self.kv_store is not None:
                with w.open(_KV) as f:
                    torch.save(self.kv_store.state_dict(), f)
            w.commit({"num_payloads": len(self.payloads), "buffer_size": len(self.buffer)})

    @classmethod
    def load(
        cls,
        directory: str | Path,
        encoder: Callable,
        tokenizer,
        *,
        kv_store=None,
        model=None,
        pin_offpolicy: bool | None = None,
    ) -> StepTraces:
        """Inverse of save. With a kv_store, its saved contents are restored (so that a run resumed between K/V
        refreshes splices what the uninterrupted run would have); a save without them has the payloads' K/V
        recomputed with `model`. Every file is checked against the manifest's checksums, and the parts against each
        other (payload counts, the buffer's and the K/V store's payload ids, the K/V tokens) before anything is
        changed: a mismatch raises StepTracesFormatError naming the file and field, and leaves kv_store as it was.
        pin_offpolicy: None keeps the saved choice (True for a save that predates it); the off-policy steps are pinned
        again from their payload ids."""
        from rapo_fast.retrieval.buffer import StepBuffer
        from rapo_fast.retrieval.io import StepBufferFormatError

        with read_version(directory, _PREFIX, TRACES_FORMAT, TRACES_VERSION, StepTracesFormatError) as v:
            if not {_TRACES, "buffer/CURRENT"} <= set(v.files) <= {_TRACES, "buffer/CURRENT", _KV}:
                raise StepTracesFormatError(f"{v.path / 'meta.json'}: field 'files' lists {sorted(v.files)}")
            payloads, n_off, n_on, pin_saved = _read_traces_json(v.path / _TRACES)
            try:
                buffer = StepBuffer.load(v.path / "buffer")
            except StepBufferFormatError as exc:
                raise StepTracesFormatError(str(exc)) from exc
            kv_state = _read_kv(v.path / _KV) if kv_store is not None and _KV in v.files else None
        _cross_check(v, payloads, buffer, kv_state, kv_store)
        enc_dim = getattr(encoder, "dim", None)
        if isinstance(enc_dim, int) and enc_dim > 0 and enc_dim != buffer.dim:
            raise ValueError(f"StepTraces.load: the encoder's dim is {enc_dim}, the saved buffer's {buffer.dim}")
        pin = pin_saved if pin_offpolicy is None else pin_offpolicy
        traces = cls(buffer, encoder, tokenizer, kv_store=kv_store, model=model, pin_offpolicy=pin)
        traces.payloads, traces.num_offpolicy, traces.num_onpolicy = payloads, n_off, n_on
        traces.pin_offpolicy_steps()
        if kv_store is not None:
            if kv_state is not None:
                kv_store.load_state_dict(kv_state)
            else:
                traces.refresh_kv()
        return traces


class StepTracesFormatError(FormatError):
    """A saved StepTraces directory is missing, corrupt, inconsistent, or of an incompatible format version."""


def _read_traces_json(path: Path) -> tuple[dict[int, list[int]], int, int, bool]:
    meta = read_json_object(path, StepTracesFormatError)
    n_off = C.check_field(meta, "num_offpolicy", path, StepTracesFormatError, C.check_int, lo=0)
    n_on = C.check_field(meta, "num_onpolicy", path, StepTracesFormatError, C.check_int, lo=0)
    # absent from saves before the field: the default
    pin = C.check_field({"pin_offpolicy": True, **meta}, "pin_offpolicy", path, StepTracesFormatError, C.check_bool)
    payloads, pids = meta.get("payloads"), meta.get("payload_ids")
    if not isinstance(payloads, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
        for p in payloads
    ):
        raise StepTracesFormatError(f"{path}: field 'payloads' must be a list of non-empty lists of token ids >= 0")
    # ascending, below the count of steps ever added (so that no later add reuses one)
    ok = isinstance(pids, list) and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pids)
    if not (ok and len(pids) == len(payloads) and pids == sorted(set(pids)) and pids[-1:] < [n_off + n_on]):
        n = len(payloads)
        raise StepTracesFormatError(f"{path}: field 'payload_ids' must hold {n} ascending ids in [0, {n_off + n_on})")
    return dict(zip(pids, payloads)), n_off, n_on, pin


def _read_kv(path: Path) -> dict:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises pickle, zip and runtime errors alike
        raise StepTracesFormatError(f"{path} could not be read: {exc}") from exc


def _cross_check(v, payloads: dict[int, list[int]], buffer, kv_state: dict | None, kv_store) -> None:
    """The parts of one save must agree: counts in the manifest, the buffer's payload ids = the saved payloads' (the
    live ones: a save holds no other), K/V for exactly those with the payloads' tokens."""
    where = v.path / "meta.json"
    if C.check_field(v.meta, "num_payloads", where, StepTracesFormatError, C.check_int, lo=0) != len(payloads):
        raise StepTracesFormatError(
            f"{where}: field 'num_payloads' is {v.meta['num_payloads']}, traces.json holds {len(payloads)}"
        )
    if C.check_field(v.meta, "buffer_size", where, StepTracesFormatError, C.check_int, lo=0) != len(buffer):
        raise StepTracesFormatError(
            f"{where}: field 'buffer_size' is {v.meta['buffer_size']}, the buffer holds {len(buffer)}"
        )
    pids = buffer.payload_ids
    if sorted(pids.tolist()) != sorted(payloads):  # the saved payloads are exactly the buffer's, each once
        odd = sorted(set(pids.tolist()) ^ set(payloads))[:8]
        raise StepTracesFormatError(f"{v.path / 'buffer'}: payload ids must lie in traces.json's, each once: {odd}")
    if kv_state is None:
        return
    try:
        _, kv_where, kv_tokens = kv_store.check_state_dict(kv_state)
    except (ValueError, TypeError) as exc:
        raise StepTracesFormatError(f"{v.path / _KV}: {exc}") from exc
    missing = set(pids.tolist()) - set(kv_where)
    bad = [p for p in kv_where if p not in payloads or kv_tokens.get(p, payloads[p]) != payloads[p]]
    if missing or bad:
        raise StepTracesFormatError(
            f"{v.path / _KV}: field 'where' lacks payload ids {sorted(missing)[:8]} of the buffer, or holds ids "
            f"{sorted(bad)[:8]} with no payload or other tokens than traces.json"
        )
