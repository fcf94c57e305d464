"""`rapo-fast verl-traces` (rapo_fast/integrations/verl/traces.py) turns verl's `trainer.rollout_data_dir` dumps into
the traces JSONL the step buffer is built from: a dump written exactly as verl 0.9.1 writes it (tests/helpers/
verl_dump.py, checked against verl's own writer in the verl stage) goes through the command line; the output passes
read_jsonl and builds a StepTraces whose retrieval returns the next step. Rows at or below the threshold, without a
tool step or repeated are dropped; retrieved segments are cut out; bad input names the file, line and field. Needs
neither verl nor ray. Not here: the buffer actor (tests/integrations/verl_plugin/test_verl_buffer_actor.py).
"""

from __future__ import annotations

import json

import pytest
from helpers.verl_dump import CALL, OBS, PROMPT, write_generations

from rapo_fast import cli
from rapo_fast.integrations.verl.traces import query_id_of, split_response, traces_from_rows
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import read_jsonl
from rapo_fast.retrieval.step_traces import StepTraces


class ByteTokenizer:
    """Token ids = UTF-8 bytes (StepTraces needs only encode)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8")


Q1, Q2 = "Who directed the film Inception?", "Which river flows through Paris?"
S1 = "I should look it up.\n" + CALL.format(q="Inception director") + OBS.format(doc="Doc 1: Inception is by Nolan.")
S2 = "Check his first name.\n" + CALL.format(q="Nolan first name") + OBS.format(doc="Doc 1: Christopher Nolan.")
ANSWER = "The director is Christopher Nolan. <answer>Christopher Nolan</answer>"
# two tool responses in one observation (parallel calls): one step
S3 = (
    "Search twice.\n"
    + CALL.format(q="Paris river")
    + "<tool_response>\nDoc 1: The Seine.\n</tool_response>\n"
    + OBS.format(doc="Doc 1: Paris lies on the Seine.")
)
RETRIEVED = "<retrieve> an earlier step of another rollout </retrieve> "


def _dump(tmp_path):
    d = tmp_path / "rollout_data"
    p1, p2 = PROMPT.format(q=Q1), PROMPT.format(q=Q2)
    rows_step1 = [
        (p1, S1 + S2 + ANSWER, 1.0),  # kept: two steps
        (p1, S1 + "<answer>Spielberg</answer>", 0.0),  # below the threshold
        (p2, "<answer>Seine</answer>", 1.0),  # no tool step
        (p2, S3 + RETRIEVED + "<answer>Seine</answer>", 1.0),  # kept, retrieved segment cut out
    ]
    rows_step2 = [
        (p1, S1 + S2 + ANSWER, 1.0),  # repeats step 1's record
        (p1, S1 + "<answer>Nolan</answer>", 0.5),  # at the threshold: dropped (score > threshold)
    ]
    for step, rows in ((1, rows_step1), (2, rows_step2)):
        write_generations(
            inputs=[r[0] for r in rows],
            outputs=[r[1] for r in rows],
            gts=[["x"]] * len(rows),
            scores=[r[2] for r in rows],
            reward_extra_infos_dict={"uid": [f"u{step}{i}_{i}_0" for i in range(len(rows))]},
            dump_path=str(d),
            global_steps=step,
        )
    return d


def test_split_response_at_tool_responses():
    assert split_response(S1 + S2 + ANSWER) == ([S1, S2], ANSWER)
    assert split_response(S3 + "<answer>Seine</answer>") == ([S3], "<answer>Seine</answer>")
    assert split_response("no tool call") == ([], "no tool call")
    assert S1.endswith("</tool_response>\nassistant\n")  # the role residue ends the step, as on-policy steps end


def test_cli_turns_a_verl_dump_into_traces_that_build_a_step_buffer(tmp_path, capsys):
    out = tmp_path / "traces.jsonl"
    assert cli.main(["verl-traces", "--dump", str(_dump(tmp_path)), "--out", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats == {"rows": 6, "kept": 2, "low_score": 2, "no_step": 1, "duplicate": 1, "steps": 3, "out": str(out)}
    recs = read_jsonl(out)
    p1, p2 = PROMPT.format(q=Q1), PROMPT.format(q=Q2)
    assert [(r["prompt"], r["steps"], r["answer"], r["reward"]) for r in recs] == [
        (p1, [S1, S2], ANSWER, 1.0),
        (p2, [S3], "<answer>Seine</answer>", 1.0),
    ]
    assert [r["query_id"] for r in recs] == [query_id_of(p1), query_id_of(p2)] and recs[0]["source"].endswith(":1")
    traces = StepTraces.from_jsonl(out, HashedNgramEncoder(), ByteTokenizer(), top_k=5)
    assert len(traces) == 3
    # the agent loop's query: the decoded prompt + response so far; the best key is the same history -> next step
    segs, pids, _ = traces.retrieve([p1 + S1])
    assert pids.tolist() != [-1] and S2.split()[0] in ByteTokenizer().decode(segs[0])
    assert "Check his first name." in ByteTokenizer().decode(segs[0])


def test_threshold_keys_and_query_ids_for_a_teachers_generations(tmp_path):
    rows = [
        ("a:1", {"id": 7, "prompt": "q", "response": S1 + ANSWER, "reward": 0.3}),
        ("a:2", {"id": 7, "prompt": "q", "response": S2 + ANSWER, "reward": 0.2}),
    ]
    recs, stats = traces_from_rows(
        rows, threshold=0.25, prompt_key="prompt", response_key="response", score_key="reward", query_id_key="id"
    )
    assert [(r["query_id"], r["steps"]) for r in recs] == [(7, [S1])] and stats["low_score"] == 1
    kept, _ = traces_from_rows([("a:1", {"input": "p", "output": RETRIEVED + S1, "score": 1})], keep_retrieved=True)
    assert kept[0]["steps"] == [RETRIEVED + S1]


@pytest.mark.parametrize(
    ("row", "kwargs", "match"),
    [
        ({"output": S1, "score": 1.0}, {}, "a:3: 'input': expected a str, got None"),
        ({"input": "p", "output": S1, "score": "high"}, {}, "a:3: 'score': expected a int or float, got 'high'"),
        ({"input": "p", "output": S1, "score": True}, {}, "'score': expected a int or float, got True"),
        ({"input": "p", "output": S1, "score": 1, "qid": -1}, {"query_id_key": "qid"}, "'qid': expected in \\[0, "),
        ({"input": "p", "output": S1, "score": 1}, {"threshold": float("nan")}, "threshold: expected a finite number"),
    ],
)
def test_bad_rows_name_the_line_and_field(row, kwargs, match):
    with pytest.raises(ValueError, match=match):
        traces_from_rows([("a:3", row)], **kwargs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--dump", "{missing}", "--out", "{out}"],
        ["--dump", "{bad}", "--out", "{out}"],
        ["--dump", "{bad}", "--out", "{out}", "--threshold", "nan"],
        ["--dump", "{bad}", "--out", "{out}", "--step-end", "("],
        ["--out", "{out}"],
    ],
)
def test_cli_refuses_bad_input_with_a_one_line_error(tmp_path, capsys, argv):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "p"}\n[1]\n')
    paths = {"missing": str(tmp_path / "nope"), "out": str(tmp_path / "o.jsonl"), "bad": str(bad)}
    with pytest.raises(SystemExit) as e:
        cli.main(["verl-traces", *[a.format(**paths) for a in argv]])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_nothing_kept_writes_an_empty_file_and_exits_1(tmp_path, capsys):
    d = tmp_path / "dump"
    write_generations(["p"], [S1 + ANSWER], [None], [0.0], {}, str(d), 3)
    assert cli.main(["verl-traces", "--dump", str(d), "--out", str(tmp_path / "t.jsonl")]) == 1
    assert "no trajectory kept" in capsys.readouterr().out and (tmp_path / "t.jsonl").read_text() == ""
