"""Save formats at rest, so that no data is lost or corrupted on a crash:
every file of every format is covered by a checksum (a flipped byte, a truncation or an extra byte anywhere gives the
format's own error), edited fields behind the checksums are refused by the schema checks, the parts of a StepTraces
or checkpoint save are cross-checked, a bad save leaves the loading object as it was, StepKVStore.load_state_dict
refuses every offset and length outside its pools, and saves into one directory from two threads do not mix.
Not here: kills during a save (test_fault_injection.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading

import pytest
import reliability_states as rs
import torch

from rapo_fast import StepBuffer
from rapo_fast._atomic import FormatError
from rapo_fast.kv.store import StepKVStore
from rapo_fast.retrieval.io import StepBufferFormatError
from rapo_fast.retrieval.step_traces import StepTraces, StepTracesFormatError


def _corruptions(data: bytes) -> dict[str, bytes]:
    flipped = bytearray(data)
    if flipped:
        flipped[len(flipped) // 2] ^= 0x01  # one bit
    return {"bit flip": bytes(flipped), "truncated": data[: len(data) // 2], "extra byte": data + b"\n"}


@pytest.mark.parametrize("kind", ["StepBuffer", "StepTraces+StepKVStore", "checkpoint"])
def test_every_file_is_covered_by_a_checksum(kind, tmp_path):
    """Each file of a save (nested ones too; LOCK holds nothing), corrupted three ways, gives the format's error."""
    case = rs.case(kind, tmp_path)
    d = tmp_path / "save"
    case.save(d)
    want = case.fp(case.load(d))
    files = [p for p in sorted(d.rglob("*")) if p.is_file() and p.name != "LOCK"]
    assert len(files) >= {"StepBuffer": 3, "StepTraces+StepKVStore": 7, "checkpoint": 11}[kind]
    for path in files:
        data = path.read_bytes()
        for how, bad in _corruptions(data).items():
            if bad == data:
                continue
            path.write_bytes(bad)
            with pytest.raises(case.error) as info:
                case.load(d)
            assert path.name in str(info.value) or "CURRENT" in str(info.value), (path, how, info.value)
        path.write_bytes(data)
        assert case.fp(case.load(d)) == want  # restored: loads again, exactly


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("metric", "ip", None),  # a valid value: only the checksum can tell
        ("eviction", "lowest_score", None),
        ("capacity", 65, None),
        ("head", 1.5, "'head': expected an int"),
        ("size", 50.7, "'size': expected an int"),
        ("next_seq", -100, "'next_seq': expected an int"),
        ("capacity", 2**31 - 1, None),  # consistent, and no allocation: load allocates what is stored
        ("capacity", 2**31, "'capacity': expected an int"),
        ("dtype", "float64", "'dtype': expected one of"),
        ("metric", True, "'metric': expected one of"),
    ],
)
def test_edited_buffer_meta_is_refused(tmp_path, field, value, message):
    """An edited meta.json does not load silently: the checksum in CURRENT refuses any edit; and an edit with
    the checksums recomputed (a writer's bug, not a crash) meets the schema check naming the field."""
    d = tmp_path / "b"
    rs.buffer_case().obj.save(d)
    snap = rs.live(d)
    manifest = json.loads((snap / "meta.json").read_text())
    manifest["meta"][field] = value
    (snap / "meta.json").write_text(json.dumps(manifest))
    with pytest.raises(StepBufferFormatError, match=r"meta.json: expected .*\(corrupt\)"):
        StepBuffer.load(d)
    rs.reseal(d)
    if message is None:  # consistent on its own: the checksum was the guard
        StepBuffer.load(d)
        return
    with pytest.raises(StepBufferFormatError, match=message):
        StepBuffer.load(d)


def test_current_not_utf8_and_truncated_traces_json(tmp_path):
    """A non-UTF-8 CURRENT and a truncated traces.json give the format's own error (not UnicodeDecodeError or a raw
    JSONDecodeError)."""
    buf = rs.buffer_case().obj
    buf.save(tmp_path / "b")
    (tmp_path / "b" / "CURRENT").write_bytes(b"\xff\xfe\x00snapshot")
    with pytest.raises(StepBufferFormatError, match=r"CURRENT: expected .*\(corrupt\)"):
        StepBuffer.load(tmp_path / "b")
    tr = rs.traces_case(with_kv=False)
    tr.save(tmp_path / "t")
    (traces_json,) = (tmp_path / "t").rglob("traces.json")
    traces_json.write_bytes(traces_json.read_bytes()[:-7])
    with pytest.raises(StepTracesFormatError, match="traces.json"):
        tr.load(tmp_path / "t")
    rs.reseal(tmp_path / "t")  # behind the checksum, the JSON parse gives the format's error too
    with pytest.raises(StepTracesFormatError, match=r"traces.json: expected .*\(corrupt\)"):
        tr.load(tmp_path / "t")


def test_step_traces_parts_are_cross_checked(tmp_path):
    """The buffer, the payload list and the K/V of different saves are not loaded together (the first retrieve would
    raise IndexError): parts of two saves, each checksum valid, are refused naming the field."""
    small, big = rs.traces_case(with_kv=True, n_old=4), rs.traces_case(with_kv=True, n_old=12)
    small.save(tmp_path / "s")
    big.save(tmp_path / "b")
    s, b = rs.live(tmp_path / "s"), rs.live(tmp_path / "b")
    shutil.rmtree(s / "buffer")
    shutil.copytree(b / "buffer", s / "buffer")  # the bigger save's buffer with the smaller one's payloads
    rs.reseal(tmp_path / "s")
    with pytest.raises(StepTracesFormatError, match="buffer_size"):
        small.load(tmp_path / "s")
    manifest = json.loads((s / "meta.json").read_text())
    manifest["meta"]["buffer_size"] = 12  # as if the manifest agreed: the payload ids are still out of range
    (s / "meta.json").write_text(json.dumps(manifest))
    rs.reseal(tmp_path / "s")
    with pytest.raises(StepTracesFormatError, match="payload ids must lie in"):
        small.load(tmp_path / "s")
    # K/V of other tokens than the payloads (a K/V store from another save)
    small.save(tmp_path / "k")
    k = rs.live(tmp_path / "k")
    state = torch.load(k / "kv_store.pt", weights_only=True)
    state["tokens"] = {pid: [t + 1 for t in ids] for pid, ids in state["tokens"].items()}
    torch.save(state, k / "kv_store.pt")
    rs.reseal(tmp_path / "k")
    store = small.obj.kv_store
    before = store.state_dict()
    with pytest.raises(StepTracesFormatError, match="other tokens"):
        StepTraces.load(tmp_path / "k", small.obj.encoder, small.obj.tokenizer, kv_store=store, model=small.obj.model)
    rs._hash_obj(h0 := hashlib.sha256(), before)
    rs._hash_obj(h1 := hashlib.sha256(), store.state_dict())
    assert h0.digest() == h1.digest()  # the store given to load is untouched


def test_bad_checkpoint_leaves_the_trainer_as_it_was(tmp_path):
    """A checkpoint whose buffer part is corrupt is refused before the model, optimiser or RNGs change."""
    case = rs.trainer_case(tmp_path)
    d = tmp_path / "ckpt"
    case.save(d)
    case.advance()
    probe = case.extra["probe"]
    before = rs.trainer_fp(probe)
    (tensors,) = d.rglob("tensors.safetensors")
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0x10
    tensors.write_bytes(bytes(data))
    with pytest.raises(case.error, match=r"tensors.safetensors: expected .*\(corrupt\)"):
        case.load(d)
    assert rs.trainer_fp(probe) == before


def test_old_layouts_are_refused_clearly(tmp_path):
    """A directory of the layout before versioned saves (no checksummed CURRENT) is not silently read."""
    (tmp_path / "ckpt").mkdir()
    torch.save({"format": "rapo_fast.train.trainer.checkpoint/1"}, tmp_path / "ckpt" / "trainer.pt")
    case = rs.trainer_case(tmp_path)
    with pytest.raises(case.error, match="got a folder without CURRENT"):
        case.load(tmp_path / "ckpt")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "CURRENT").write_text("snapshot-" + "a" * 32 + "\n")  # version 1: no checksum in CURRENT
    with pytest.raises(StepBufferFormatError, match=r"CURRENT: expected .*\(corrupt\)"):
        StepBuffer.load(tmp_path / "b")
    assert issubclass(case.error, FormatError) and issubclass(StepTracesFormatError, FormatError)


# how -> an edit of a StepKVStore state (s) whose payload 2 sits at (off, n)
EDITS = {
    "offset 10**6": lambda s, off, n: s["where"].__setitem__(2, (10**6, n)),
    "one bit flipped in an offset": lambda s, off, n: s["where"].__setitem__(2, (off ^ (1 << 12), n)),
    "length past the pool": lambda s, off, n: s["where"].__setitem__(2, (off, n + 100)),
    "negative offset": lambda s, off, n: s["where"].__setitem__(2, (-1, n)),
    "overlap": lambda s, off, n: s["where"].__setitem__(7, (off, 2)),
    "bool offset": lambda s, off, n: s["where"].__setitem__(2, (True, n)),
    "float length": lambda s, off, n: s["where"].__setitem__(2, (off, float(n))),
    "keys of another dtype": lambda s, off, n: s.__setitem__("keys", s["keys"].double()),
    "values of another shape": lambda s, off, n: s.__setitem__("values", s["values"][:, :-1]),
    "NaN in the keys": lambda s, off, n: s.__setitem__("keys", s["keys"].clone().fill_(float("nan"))),
    "tokens of another length": lambda s, off, n: s["tokens"].__setitem__(2, [2] * (n + 1)),
    "tokens of an unknown payload": lambda s, off, n: s["tokens"].__setitem__(99, [1]),
    "capacity below the used tokens": lambda s, off, n: s.__setitem__("capacity_tokens", 1),
    "capacity of 2**40 tokens": lambda s, off, n: s.__setitem__("capacity_tokens", 2**40),
    "missing field": lambda s, off, n: s.pop("where"),
    "where not a dict": lambda s, off, n: s.__setitem__("where", [(0, 3)]),
}


def _edit(state: dict, how: str) -> dict:
    s = {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()}
    EDITS[how](s, *s["where"][2])
    return s


@pytest.mark.parametrize("how", list(EDITS))
def test_kv_load_state_dict_refuses_bad_offsets_and_fields(how):
    """load_state_dict refuses offsets outside the pools (offset 10**6 would segfault in splice_kv): every bad
    state raises ValueError naming the field, and the store keeps its contents."""
    src, dst = rs.kv_store(), StepKVStore(2, 1, 4, dtype=torch.float32)
    dst.add([5], [torch.ones(2, 2, 1, 4)], [torch.ones(2, 2, 1, 4)], tokens=[[5, 5]])
    before = dst.state_dict()
    with pytest.raises(ValueError, match="StepKVStore.load_state_dict"):
        dst.load_state_dict(_edit(src.state_dict(), how))
    after = dst.state_dict()
    assert after["where"] == before["where"] and torch.equal(after["keys"], before["keys"])
    dst.load_state_dict(src.state_dict())  # the unedited state loads
    assert dst.payload_ids() == [1, 2, 7] and torch.equal(dst.get(2)[0], src.get(2)[0])


def test_saves_from_two_threads_do_not_mix(tmp_path):
    """LOCK serialises saves into one directory: after both, the live version is one of the two, complete, and
    nothing else is left."""
    a, b = rs.buffer_case(n_old=10).obj, rs.buffer_case(n_old=30).obj
    d = tmp_path / "b"
    errors = []

    def run(buf):
        try:
            for _ in range(10):
                buf.save(d)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(x,)) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert rs.buffer_fp(StepBuffer.load(d)) in {rs.buffer_fp(a), rs.buffer_fp(b)}
    assert {p.name for p in d.iterdir()} == {"CURRENT", "LOCK", rs.live(d).name}


def test_buffer_save_beside_an_add_captures_one_state(tmp_path, monkeypatch):
    """StepBuffer.save holds the buffer's read lock: an add from another thread during the save waits, and the
    snapshot is the state at the start of the save (before, the add overwrote the slots being written)."""
    import rapo_fast.retrieval.buffer as buffer_mod

    buf = rs.buffer_case(capacity=16, n_old=16).obj  # full: the next add overwrites saved slots
    want = rs.buffer_fp(buf)
    real, adder = buffer_mod.write_snapshot, []

    def write_while_adding(directory, tensors, meta):
        t = threading.Thread(
            target=lambda: buf.add(torch.ones(4, 8), torch.arange(4), torch.zeros(4, dtype=torch.int64))
        )
        t.start()
        t.join(0.3)
        adder.append(t)
        return real(directory, tensors, meta)

    monkeypatch.setattr(buffer_mod, "write_snapshot", write_while_adding)
    buf.save(tmp_path / "b")
    adder[0].join()
    assert rs.buffer_fp(StepBuffer.load(tmp_path / "b")) == want
    assert rs.buffer_fp(buf) != want  # the add did happen, after the save
