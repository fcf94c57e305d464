"""Formats and configs whose errors name the file, the line and the field.

Trajectory JSONL (rapo_fast/retrieval/jsonl.py, read by StepTraces.from_jsonl): a line that is an array, a string, a
number or null, non-string steps, `query_id: true` / `reward: true`, a query id past what the buffer's int64 group ids
hold (2^70, -1), a NaN/inf reward, a lone surrogate, invalid UTF-8: each raises ValueError naming the file and line,
from `read_jsonl` and from `StepTraces.from_jsonl` alike (hypothesis draws bad lines among good ones). A malformed YAML
or JSON TrainerConfig file (rapo_fast/train/config.py) raises ValueError naming the file, not yaml.YAMLError.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapo_fast.demo.tiny_policy import WordTokenizer
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import QUERY_ID_MAX, read_jsonl
from rapo_fast.retrieval.step_traces import OFFPOLICY_GROUP_BASE, StepTraces
from rapo_fast.train.config import TrainerConfig

GOOD = {"query_id": 1, "prompt": "w1 w2", "steps": ["w3 w4", "w5"], "answer": "w6", "reward": 1.0}


def _rec(**kw) -> str:
    return json.dumps({**GOOD, **kw})


BAD_LINES = {
    "array": "[1, 2, 3]",
    "string": '"a trajectory"',
    "null": "null",
    "number": "7",
    "steps_int": _rec(steps=["w1", 3]),
    "steps_null": _rec(steps=[None]),
    "steps_str": _rec(steps="w1 w2"),
    "query_id_bool": _rec(query_id=True),
    "reward_bool": _rec(reward=True),
    "query_id_2_70": _rec(query_id=2**70),
    "query_id_past_group": _rec(query_id=QUERY_ID_MAX + 1),
    "query_id_negative": _rec(query_id=-1),
    "query_id_float": _rec(query_id=1.0),
    "reward_nan": _rec(reward=float("nan")),  # json.dumps writes the NaN literal that json.loads accepts
    "reward_inf": _rec(reward=float("inf")),
    "reward_str": _rec(reward="1.0"),
    "prompt_surrogate": _rec(prompt="w1 \ud800"),  # written as the escape "\ud800"
    "step_surrogate": _rec(steps=["w1", "\udfff w2"]),
    "answer_surrogate": _rec(answer="\ud83d"),
    "not_json": '{"query_id": 1,',
    "prompt_missing": json.dumps({k: v for k, v in GOOD.items() if k != "prompt"}),
    "invalid_utf8": b'{"query_id": 1, "prompt": "\xff"}',
}


def _write(tmp_path, lines: list[str | bytes], name: str = "t.jsonl"):
    p = tmp_path / name
    p.write_bytes(b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines))
    return p


def _names_file_and_line(exc: BaseException, path, line: int) -> bool:
    return re.search(re.escape(f"{path}:{line}") + r"\b", str(exc)) is not None


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_each_bad_line_names_file_and_line(tmp_path, kind):
    p = _write(tmp_path, [_rec(), "", _rec(query_id=2), BAD_LINES[kind], _rec()])
    with pytest.raises(ValueError) as ei:
        read_jsonl(p)
    assert _names_file_and_line(ei.value, p, 4), str(ei.value)
    with pytest.raises(ValueError) as ei:
        StepTraces.from_jsonl(p, HashedNgramEncoder(16), WordTokenizer([f"w{i}" for i in range(8)]))
    assert _names_file_and_line(ei.value, p, 4), str(ei.value)


def test_largest_query_id_fits_the_offpolicy_group(tmp_path):
    assert QUERY_ID_MAX + OFFPOLICY_GROUP_BASE == 2**63 - 1
    p = _write(tmp_path, [_rec(query_id=QUERY_ID_MAX), _rec(query_id=0, reward=0)])
    traces = StepTraces.from_jsonl(p, HashedNgramEncoder(16), WordTokenizer([f"w{i}" for i in range(8)]))
    assert int(traces.buffer.group_ids.max()) == 2**63 - 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_good=st.integers(0, 4),
    bad=st.sampled_from(sorted(BAD_LINES)),
    extra=st.dictionaries(st.sampled_from(["query_id", "reward", "prompt"]), st.one_of(st.booleans(), st.none())),
)
def test_bad_line_among_good_ones(tmp_path_factory, n_good, bad, extra):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("h")
    lines = [_rec(query_id=i) for i in range(n_good)] + [BAD_LINES[bad] if not extra else _rec(**extra)]
    p = _write(d, lines)
    with pytest.raises(ValueError) as ei:
        read_jsonl(p)
    assert _names_file_and_line(ei.value, p, n_good + 1), str(ei.value)


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".yaml", "group_size: [1, 2\n"),  # unclosed flow sequence
        (".yaml", "a: b: c\n"),
        (".yml", "\tgroup_size: 4\n"),  # a tab where YAML wants spaces
        (".yaml", "- 1\n- 2\n"),  # valid YAML, not a mapping
        (".json", '{"group_size": 4,'),
        (".json", '{"group_size": 0}'),  # parses; an invalid value
    ],
)
def test_malformed_config_names_the_file(tmp_path, suffix, text):
    p = tmp_path / f"cfg{suffix}"
    p.write_text(text)
    with pytest.raises((ValueError, TypeError)) as ei:
        TrainerConfig.load(p)
    assert str(ei.value).startswith(f"{p}: "), str(ei.value)
    import yaml

    assert not isinstance(ei.value, yaml.YAMLError)


def test_malformed_yaml_text_is_value_error():
    with pytest.raises(ValueError, match="malformed YAML"):
        TrainerConfig.from_yaml("group_size: [1, 2\n")
