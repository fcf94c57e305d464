"""Small states of every save format, for tests/reliability: each `Case` holds an object in an old state, can move it
to a new state (`advance`), save and load it, and fingerprint a loaded object (equal fingerprints = equal states,
bit for bit). Also `reseal`, which rewrites a saved unit's checksums after a test edited a file on purpose (to reach
the schema checks behind them). Not a test module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rapo_fast import StepBuffer
from rapo_fast.retrieval.io import StepBufferFormatError
from rapo_fast.retrieval.step_traces import StepTraces, StepTracesFormatError

STEPS = [f"<think> add {i} <tool> {i} + {i} </tool> <obs> {2 * i} </obs>" for i in range(10)]


@dataclass
class Case:
    """One save format with an object in it: save(dir) / load(dir) -> object / fp(object) -> bytes / advance()."""

    name: str
    obj: Any
    save: Callable[[Path], None]
    load: Callable[[Path], Any]
    fp: Callable[[Any], bytes]
    advance: Callable[[], None]
    error: type[Exception]
    extra: dict = field(default_factory=dict)


def _h(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _hash_obj(h, x: Any) -> None:
    """Tensors by bytes, containers recursively, the rest by repr (enough for state dicts and RNG states)."""
    if isinstance(x, torch.Tensor):
        _h(h, x)
    elif isinstance(x, dict):
        for k in sorted(x, key=repr):
            h.update(repr(k).encode())
            _hash_obj(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__}{len(x)}".encode())
        for v in x:
            _hash_obj(h, v)
    else:
        h.update(repr(x).encode())


def buffer_fp(buf: StepBuffer) -> bytes:
    h = hashlib.sha256()
    h.update(repr((buf.capacity, buf.dim, buf.dtype, buf.metric, buf.eviction, len(buf))).encode())
    h.update(repr((buf._head, buf._next_seq)).encode())
    for t in (buf.embeddings, buf.payload_ids, buf.group_ids, buf.scores, buf._seq[: len(buf)]):
        _h(h, t)
    return h.digest()


def traces_fp(tr: StepTraces) -> bytes:
    h = hashlib.sha256(buffer_fp(tr.buffer))
    _hash_obj(h, (tr.payloads, tr.num_offpolicy, tr.num_onpolicy))
    if tr.kv_store is not None:
        _hash_obj(h, tr.kv_store.state_dict())
    return h.digest()


def _add(buf: StepBuffer, m: int, start: int, g: torch.Generator) -> None:
    keys = torch.randn(m, buf.dim, generator=g)
    buf.add(keys, torch.arange(start, start + m), torch.randint(0, 5, (m,), generator=g), torch.randn(m, generator=g))


def buffer_case(capacity: int = 64, dim: int = 8, n_old: int = 40, n_new: int = 50) -> Case:
    """A StepBuffer (fp16, cosine, fifo): old = n_old steps, new = n_new more (past the ring's wrap)."""
    g = torch.Generator().manual_seed(0)
    buf = StepBuffer(capacity, dim, dtype=torch.float16, metric="cosine")
    _add(buf, n_old, 0, g)
    return Case(
        "StepBuffer",
        buf,
        save=buf.save,
        load=StepBuffer.load,
        fp=buffer_fp,
        advance=lambda: _add(buf, n_new, n_old, g),
        error=StepBufferFormatError,
    )


def _tiny_world():
    from rapo_fast.demo.tasks import ChainArithmeticTask
    from rapo_fast.retrieval.encoders import HashedNgramEncoder

    return ChainArithmeticTask().tokenizer(), HashedNgramEncoder(dim=16)


def traces_case(with_kv: bool, capacity: int = 16, n_old: int = 6, n_new: int = 14) -> Case:
    """StepTraces (with a StepKVStore when with_kv): old = n_old on-policy steps, new = n_new more (wrapping)."""
    tok, enc = _tiny_world()
    kw = {}
    if with_kv:
        from rapo_fast.demo.tiny_policy import build_tiny_policy
        from rapo_fast.kv.store import StepKVStore

        model = build_tiny_policy(tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, seed=0).eval()
        kw = {"kv_store": StepKVStore.for_model(model, capacity_tokens=8), "model": model}
    tr = StepTraces(StepBuffer(capacity, enc.dim, dtype=torch.float32, metric="cosine"), enc, tok, **kw)

    def add(start: int, n: int) -> None:
        idx = [(start + i) % len(STEPS) for i in range(n)]
        tr.add_steps([f"calc {i} add {i}" for i in idx], [STEPS[i] for i in idx], [i % 3 for i in idx])

    add(0, n_old)

    def load(d: Path) -> StepTraces:
        store = None
        if with_kv:  # a fresh store each time: load must fill it with the saved K/V exactly
            store = type(tr.kv_store).for_model(kw["model"], capacity_tokens=4)
        return StepTraces.load(d, enc, tok, kv_store=store, model=kw.get("model"))

    name = "StepTraces+StepKVStore" if with_kv else "StepTraces"
    return Case(name, tr, tr.save, load, traces_fp, lambda: add(n_old, n_new), StepTracesFormatError)


def trainer_fp(t) -> bytes:
    h = hashlib.sha256()
    _hash_obj(h, t.model.state_dict())
    _hash_obj(h, t.optimizer.state_dict())
    _hash_obj(h, (t.step_count, t.py_rng.getstate(), t.gen.get_state(), torch.get_rng_state(), t.logger.state()))
    h.update(traces_fp(t.buffer))
    return h.digest()


def trainer_case(tmp_path: Path, with_kv: bool = False) -> Case:
    """A RAPOTrainer on the demo task (tiny policy, on-policy steps added to its StepTraces): old = after one step,
    new = after two. `load` restores into a second trainer built alike (`extra['probe']`)."""
    from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.kv.store import StepKVStore
    from rapo_fast.retrieval.encoders import HashedNgramEncoder
    from rapo_fast.train.io import CheckpointFormatError, load_checkpoint, save_checkpoint
    from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig

    task = ChainArithmeticTask()
    tok, problems = task.tokenizer(), task.make_problems(4, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 2, 0.2, seed=0), tmp_path / "t.jsonl")
    cfg = TrainerConfig.RAPO(
        {
            "rollout.group_size": 2,
            "rollout.hybrid.n_hybrid": 1,
            "prompts_per_step": 1,
            "rollout.max_step_tokens": 4,
            "rollout.max_steps": 2,
            "optim.lr": 5e-3,
            "buffer.add_onpolicy_steps": True,
        }
    )
    if with_kv:
        cfg = cfg.replace({"rollout.mode": "splice", "buffer.refresh_kv_every": 3, "loss.tis_cap": 2.0})

    def make(seed: int):
        model = build_tiny_policy(tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, seed=seed)
        kv = {"kv_store": StepKVStore.for_model(model), "model": model} if with_kv else {}
        traces = StepTraces.from_jsonl(path, HashedNgramEncoder(dim=16), tok, top_k=2, **kv)
        reward = lambda env, probs, batch: ((batch.input_ids * batch.loss_mask).sum(1) % 2).float()  # noqa: E731
        return RAPOTrainer(model, tok, task, traces, cfg, problems, reward_fn=reward)

    a, probe = make(0), make(1)
    a.step()
    rng = {"state": torch.get_rng_state()}

    def save(d: Path) -> None:
        torch.set_rng_state(rng["state"])  # the global RNG is part of the state (loads in this process move it)
        save_checkpoint(a, d)

    def load(d: Path):
        load_checkpoint(probe, d)
        return probe

    def advance() -> None:
        torch.set_rng_state(rng["state"])
        a.step()
        rng["state"] = torch.get_rng_state()

    def fp(t) -> bytes:
        return trainer_fp(t) if t is probe else _with_rng(trainer_fp, t, rng["state"])

    return Case("checkpoint", a, save, load, fp, advance, CheckpointFormatError, {"probe": probe})


def _with_rng(f, t, state):
    keep = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return f(t)
    finally:
        torch.set_rng_state(keep)


def reseal(root: Path) -> None:
    """Recompute the manifest entries of the live version of the versioned directory `root` and CURRENT's checksum,
    as a writer would have written them: so that a test's edit reaches the checks behind the checksums."""
    name = (root / "CURRENT").read_text().split()[0]
    vdir = root / name
    manifest = json.loads((vdir / "meta.json").read_text())
    for rel in manifest["files"]:
        data = (vdir / rel).read_bytes()
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (vdir / "meta.json").write_bytes(raw)
    (root / "CURRENT").write_text(f"{name} {hashlib.sha256(raw).hexdigest()}\n")


def live(root: Path) -> Path:
    """The live version directory of the versioned directory `root`."""
    return root / (root / "CURRENT").read_text().split()[0]


def config_case() -> Case:
    """A TrainerConfig saved as YAML (the file `config.yaml` of the directory given): old = seed 1, new = seed 2."""
    from rapo_fast.train.config import TrainerConfig

    box = {"cfg": TrainerConfig.RAPO({"seed": 1})}

    def advance() -> None:
        box["cfg"] = box["cfg"].replace(seed=2)

    def save(d: Path) -> None:
        Path(d).mkdir(exist_ok=True)
        box["cfg"].save(Path(d) / "config.yaml")

    return Case(
        "TrainerConfig",
        box,
        save=save,
        load=lambda d: TrainerConfig.load(Path(d) / "config.yaml"),
        fp=lambda c: (c["cfg"] if isinstance(c, dict) else c).to_json().encode(),
        advance=advance,
        error=(ValueError, FileNotFoundError),  # type: ignore[arg-type]  (no file yet: a first save was stopped)
    )


def jsonl_case() -> Case:
    """Trajectories written with write_jsonl (`t.jsonl` of the directory given): old = 3 records, new = 5."""
    from rapo_fast.retrieval.jsonl import read_jsonl, write_jsonl

    recs = [{"query_id": i, "prompt": f"p{i}", "steps": STEPS[:2], "answer": "a", "reward": 1.0} for i in range(5)]
    box = {"n": 3}

    def advance() -> None:
        box["n"] = 5

    return Case(
        "trajectory JSONL",
        box,
        save=lambda d: write_jsonl(recs[: box["n"]], Path(d) / "t.jsonl"),
        load=lambda d: read_jsonl(Path(d) / "t.jsonl"),
        fp=lambda x: json.dumps(recs[: x["n"]] if isinstance(x, dict) else x).encode(),
        advance=advance,
        error=(ValueError, FileNotFoundError),  # type: ignore[arg-type]
    )


def case(kind: str, work: Path) -> Case:
    """The Case of a save format by name (`work`: where a trainer checkpoint's run keeps its files)."""
    return {
        "StepBuffer": buffer_case,
        "StepTraces": lambda: traces_case(with_kv=False),
        "StepTraces+StepKVStore": lambda: traces_case(with_kv=True),
        "checkpoint": lambda: trainer_case(work),
        "TrainerConfig": config_case,
        "trajectory JSONL": jsonl_case,
    }[kind]()


def loaded_fp(case: Case, d: Path) -> bytes | None:
    """Fingerprint of what `load` gives, or None when it raised the format's own error (any other error fails)."""
    try:
        obj = case.load(d)
    except case.error:
        return None
    return case.fp(obj)


def kv_store():
    """A StepKVStore (2 layers, 1 head, dim 4, 16 tokens) holding payloads 1, 2, 7 of 3, 5, 2 tokens."""
    from rapo_fast.kv.store import StepKVStore

    store = StepKVStore(2, 1, 4, dtype=torch.float32, capacity_tokens=16)
    g = torch.Generator().manual_seed(0)
    segs = [torch.randn(2, n, 1, 4, generator=g) for n in (3, 5, 2)]
    store.add([1, 2, 7], segs, [-s for s in segs], tokens=[[1] * 3, [2] * 5, [7] * 2])
    return store
