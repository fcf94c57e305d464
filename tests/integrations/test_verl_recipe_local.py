"""The parts of the verl recipe (examples/verl/) that run without verl: the search tool's local BM25 backend
(local_search.py) ranks as BM25 does, deterministically, and refuses bad input naming the argument; the 1-GPU smoke's
data (examples/verl/smoke/) is valid: its questions go through prepare_data's rows, its traces through read_jsonl
into a StepTraces, and its corpus answers every smoke question with the passage holding the answer. Not here: the
recipe's config through verl's config code and the tool loaded as verl loads it
(tests/integrations/verl_plugin/test_verl_recipe.py, skipped without verl).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.jsonl import read_jsonl
from rapo_fast.retrieval.step_traces import StepTraces

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "verl"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"rapo_recipe_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ls():
    return _load("local_search")


def test_bm25_scores_match_the_formula(ls):
    docs = ["the cat sat", "the dog sat on the mat", "a cat and a cat", "nothing here"]
    index = ls.LocalSearch(docs)
    n, avg = 4, (3 + 6 + 5 + 2) / 4

    def bm25(query, i):
        words = ls.tokenize(docs[i])
        total = 0.0
        for w in set(ls.tokenize(query)):
            df = sum(w in ls.tokenize(d) for d in docs)
            tf = words.count(w)
            if df and tf:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                total += idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * len(words) / avg))
        return total

    hits = index.search("cat sat", topk=4)
    assert [i for i, _ in hits] == [0, 2, 1]  # doc 3 shares no word: not returned
    for i, score in hits:
        assert score == pytest.approx(bm25("cat sat", i), rel=1e-12)
    assert index.search("CAT, sat!", topk=4) == hits  # case and punctuation do not matter
    assert index.search("zebra") == [] and index.format("zebra") == "No passage matched the query."


def test_ties_go_to_the_earlier_passage_and_results_are_deterministic(ls):
    index = ls.LocalSearch(["same words here", "other", "same words here"])
    assert [i for i, _ in index.search("same words", topk=3)] == [0, 2]
    assert ls.LocalSearch(["same words here", "other", "same words here"]).search("same words") == index.search(
        "same words"
    )


def test_the_smoke_corpus_answers_every_smoke_question(ls):
    index = ls.LocalSearch.from_jsonl(RECIPE / "smoke" / "corpus.jsonl")
    for line in (RECIPE / "smoke" / "questions.jsonl").read_text().splitlines():
        rec = json.loads(line)
        answers = rec["answer"] if isinstance(rec["answer"], list) else [rec["answer"]]
        text = index.format(rec["question"], topk=3)
        assert text.startswith("Doc 1: ") and any(a.lower() in text.lower() for a in answers), rec


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda ls: ls.LocalSearch([]), ValueError, "passages must not be empty"),
        (lambda ls: ls.LocalSearch("text"), TypeError, "passages must be a list of str, got str"),
        (lambda ls: ls.LocalSearch(["a"], b=2.0), ValueError, "b in \\[0, 1\\]"),
        (lambda ls: ls.LocalSearch(["a"]).search(3), TypeError, "query must be a str, got int"),
        (lambda ls: ls.LocalSearch(["a"]).search("a", topk=0), ValueError, "topk must be a positive int, got 0"),
    ],
)
def test_bad_input_names_the_argument(ls, call, exc, match):
    with pytest.raises(exc, match=match):
        call(ls)


def test_bad_corpus_lines_name_the_file_and_line(ls, tmp_path):
    bad = (('{"id": 1}', "needs a str 'contents'"), ("not json", "is not valid JSON"), ("[1]", "must be a JSON object"))
    for body, what in bad:
        path = tmp_path / "c.jsonl"
        path.write_text('{"contents": "ok"}\n\n' + body + "\n")
        with pytest.raises(ValueError, match=f"{path}:3.*{what}"):
            ls.LocalSearch.from_jsonl(path)
    (tmp_path / "t.jsonl").write_text('{"title": "T", "text": "body words"}\n')
    assert ls.LocalSearch.from_jsonl(tmp_path / "t.jsonl").passages == ['"T"\nbody words']


def test_the_smoke_data_is_valid_for_prepare_data_and_the_step_buffer():
    rows = _load("prepare_data").rows(RECIPE / "smoke" / "questions.jsonl", "train")
    assert len(rows) == 8 and len({r["extra_info"]["index"] for r in rows}) == 8  # unique query ids
    recs = read_jsonl(RECIPE / "smoke" / "traces.jsonl")
    assert recs and all(r["reward"] > 0.5 and r["steps"] for r in recs)

    class ByteTokenizer:
        def encode(self, text: str) -> list[int]:
            return list(text.encode("utf-8"))

    traces = StepTraces.from_jsonl(RECIPE / "smoke" / "traces.jsonl", HashedNgramEncoder(), ByteTokenizer())
    assert len(traces) == sum(len(r["steps"]) for r in recs)
