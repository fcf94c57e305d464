"""Every load raises its format's own error for any malformed input, never another exception (RecursionError,
ENAMETOOLONG, UnicodeEncodeError, ...): versioned directories (StepBuffer.load, StepTraces.load, load_checkpoint)
raise their FormatError subclass, TrainerConfig's loaders ValueError or TypeError, read_jsonl ValueError.

Properties (hypothesis): random bytes and random JSON structures as a manifest (its checksum in CURRENT made valid so
that the schema checks are reached), random file names in a valid manifest, random bytes and nested structures into
TrainerConfig.from_yaml / from_json / load / from_dict and read_jsonl. Directed cases: names of 300 bytes, with a NUL
or a lone surrogate; JSON and YAML nested 100,000 deep in a manifest, a traces.json, a checkpoint's config.json and a
config file. Not here: inputs that cost more than their size (test_input_costs.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import reliability_states as rs
from helpers.strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from rapo_fast import StepBuffer
from rapo_fast.retrieval.io import StepBufferFormatError
from rapo_fast.retrieval.jsonl import read_jsonl
from rapo_fast.retrieval.step_traces import StepTracesFormatError
from rapo_fast.train.config import TrainerConfig

DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_YAML = "seed: " + "[" * 100_000 + "]" * 100_000 + "\n"
NAMES = ["a" * 300, "x\x00y", "\ud800", "d/" * 40 + "f", "../meta.json", "a//b", ".", "é", " "]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("snap") / "b"
    rs.buffer_case(n_old=5).obj.save(d)
    return d


def _plant(template: Path, dest: Path, manifest: bytes) -> Path:
    """A copy of `template` whose live manifest is `manifest`, named with its SHA-256 in CURRENT (as a writer would)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(template, dest)
    live = rs.live(dest)
    (live / "meta.json").write_bytes(manifest)
    (dest / "CURRENT").write_text(f"{live.name} {hashlib.sha256(manifest).hexdigest()}\n")
    return dest


def _manifest(template: Path) -> dict:
    return json.loads((rs.live(template) / "meta.json").read_text())


@fuzz_settings(30)
@given(data=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_manifest_gives_the_format_error(snapshot, tmp_path_factory, data):
    d = _plant(snapshot, tmp_path_factory.getbasetemp() / "fuzz_manifest", data)
    with pytest.raises(StepBufferFormatError):
        StepBuffer.load(d)


@fuzz_settings(30)
@given(names=st.lists(st.text(max_size=400) | st.sampled_from(NAMES), min_size=1, max_size=3))
def test_any_file_name_in_a_manifest_gives_the_format_error(snapshot, tmp_path_factory, names):
    m = _manifest(snapshot)
    m["files"].update({n: {"sha256": "0" * 64, "size": 1} for n in names})
    d = _plant(snapshot, tmp_path_factory.getbasetemp() / "fuzz_names", json.dumps(m).encode())
    with pytest.raises(StepBufferFormatError):
        StepBuffer.load(d)


@pytest.mark.parametrize("name", NAMES)
def test_hostile_names_in_a_manifest(snapshot, tmp_path, name):
    """A 300-byte name raised ENAMETOOLONG from Path.is_file; a NUL ValueError; a lone surrogate UnicodeEncodeError."""
    m = _manifest(snapshot)
    m["files"][name] = {"sha256": "0" * 64, "size": 1}
    with pytest.raises(StepBufferFormatError, match="field 'files': expected"):
        StepBuffer.load(_plant(snapshot, tmp_path / "d", json.dumps(m).encode()))
    with pytest.raises(StepBufferFormatError):  # the directory given to load: the same error, not an OSError
        StepBuffer.load(tmp_path / name)


def test_deep_nesting_gives_the_format_error(snapshot, tmp_path):
    with pytest.raises(StepBufferFormatError, match="nested too deeply"):
        StepBuffer.load(_plant(snapshot, tmp_path / "m", DEEP_JSON.encode()))
    tr = rs.traces_case(with_kv=False)
    tr.save(tmp_path / "t")
    (traces_json,) = rs.live(tmp_path / "t").glob("traces.json")
    traces_json.write_text(DEEP_JSON)
    rs.reseal(tmp_path / "t")
    with pytest.raises(StepTracesFormatError, match="nested too deeply"):
        tr.load(tmp_path / "t")
    for suffix, text in ((".json", DEEP_JSON), (".yaml", DEEP_YAML), (".yml", DEEP_JSON)):
        path = tmp_path / f"cfg{suffix}"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{path.name}: .*nested too deeply"):
            TrainerConfig.load(path)


def test_deep_nesting_in_a_checkpoint_config(work):
    case = rs.trainer_case(work)
    d = work / "ckpt"
    case.save(d)
    (rs.live(d) / "config.json").write_text(DEEP_JSON)
    rs.reseal(d)
    with pytest.raises(case.error, match="config.json: .*nested too deeply"):
        case.load(d)


@fuzz_settings(40)
@given(text=st.text(max_size=300))
def test_config_text_gives_value_or_type_errors(text):
    for parse in (TrainerConfig.from_yaml, TrainerConfig.from_json):
        try:
            parse(text)
        except (ValueError, TypeError):
            pass


@fuzz_settings(30)
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".yaml", ".json"]))
def test_config_file_bytes_give_value_or_type_errors(tmp_path_factory, data, suffix):
    path = tmp_path_factory.getbasetemp() / f"fuzz{suffix}"
    path.write_bytes(data)
    try:
        TrainerConfig.load(path)
    except (ValueError, TypeError) as exc:
        assert str(exc).startswith(str(path))


config_keys = st.sampled_from(["seed", "rollout", "loss", "optim", "rollout.hybrid", "group_size", "eps_high", "lr"])


@fuzz_settings(40)
@given(d=st.dictionaries(config_keys | st.text(max_size=8), json_values, max_size=4))
def test_config_mappings_give_value_or_type_errors(d):
    try:
        TrainerConfig.from_dict(d)
    except (ValueError, TypeError):
        pass


@fuzz_settings(30)
@given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_jsonl_bytes_give_value_errors(tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "fuzz.jsonl"
    path.write_bytes(data)
    try:
        read_jsonl(path)
    except ValueError as exc:
        assert "fuzz.jsonl" in str(exc)
