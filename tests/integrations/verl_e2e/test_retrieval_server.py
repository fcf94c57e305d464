"""The e2e's loopback retrieval server (retrieval_server.py) answers in Search-R1's shape, and the recipe's `search`
tool (examples/verl/search_tool.py, http backend: what the e2e's main_ppo run calls) reads its answer. Seconds; the
tool part skips without verl, the whole file without faiss.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("faiss")

from retrieval_server import RetrievalServer  # noqa: E402

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "verl"
DOCS = ["fact one x", "fact two y", "fact one z", "the capital of w"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_answers_in_search_r1_shape():
    with RetrievalServer(DOCS) as server:
        out = _post(server.url, {"queries": ["capital w", "fact two"], "topk": 2, "return_scores": True})
        plain = _post(server.url, {"queries": ["fact two"], "topk": 1})
        assert server.queries == ["capital w", "fact two", "fact two"]
    first, second = out["result"]
    assert first[0]["document"] == {"id": "3", "contents": "the capital of w"}
    assert second[0]["document"]["contents"] == "fact two y" and len(second) == 2
    assert first[0]["score"] >= first[1]["score"] and 0 < first[0]["score"] <= 1 + 1e-6
    assert plain["result"] == [[{"id": "1", "contents": "fact two y"}]]  # no scores asked: the documents alone


def test_the_recipe_search_tool_reads_it(monkeypatch):
    # loaded and called as verl's agent loop does: verl's loader runs a file once per process (by path), so this holds
    # whichever test loaded it first; a second exec of the file would register a second `search` and be refused
    import asyncio

    function_tool = pytest.importorskip("verl.tools.function_tool")
    (tool,) = function_tool.load_function_tools_from_path(str(RECIPE / "search_tool.py"))
    with RetrievalServer(DOCS) as server:
        monkeypatch.setenv("RAPO_SEARCH_BACKEND", "http")
        monkeypatch.setenv("RAPO_SEARCH_URL", server.url)
        monkeypatch.setenv("RAPO_SEARCH_TOPK", "1")
        response, _, _ = function_tool.normalize_function_tool_return(asyncio.run(tool.call({"query": "fact two"})))
        assert response.text == "Doc 1: fact two y"
        assert server.queries == ["fact two"]
