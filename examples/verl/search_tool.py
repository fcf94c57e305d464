"""The `search` tool of the recipe: verl loads it through `multi_turn.function_tool_path` (a verl `@function_tool`).

What it is: the knowledge-intensive setting of the RAPO paper (Search-R1 style): the agent calls `search(query)` and
gets the top RAPO_SEARCH_TOPK (default 3) passages from one of two backends, picked by RAPO_SEARCH_BACKEND:
- `http` (default): a retrieval server (e.g. Search-R1's e5 + Wikipedia server) at RAPO_SEARCH_URL, POST
  {"queries": [query], "topk": k, "return_scores": true};
- `local`: BM25 over the JSONL corpus at RAPO_SEARCH_CORPUS (examples/verl/local_search.py), in the process, no
  network: the 1-GPU smoke's default, and a way to run the recipe without a server.
What it is not: rapo_fast's step retrieval (that is the step buffer, examples/verl/build_step_buffer.sh). Tested: the
http backend inside verl's main_ppo against a loopback retrieval server (tests/integrations/verl_e2e), the local
backend through this module (tests/integrations/verl_plugin/test_verl_recipe.py) and without verl
(tests/integrations/test_verl_recipe_local.py).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import urllib.request
from pathlib import Path

from verl.tools.function_tool import function_tool

_BACKENDS = ("http", "local")


def _backend() -> str:
    backend = os.environ.get("RAPO_SEARCH_BACKEND", "http")
    if backend not in _BACKENDS:
        raise ValueError(f"search tool: RAPO_SEARCH_BACKEND must be one of {_BACKENDS}, got {backend!r}")
    return backend


def _topk() -> int:
    return int(os.environ.get("RAPO_SEARCH_TOPK", "3"))


def _post(query: str) -> str:
    url = os.environ.get("RAPO_SEARCH_URL", "http://127.0.0.1:8000/retrieve")
    body = json.dumps({"queries": [query], "topk": _topk(), "return_scores": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        result = json.loads(resp.read())["result"][0]
    passages = [(r.get("document", r).get("contents", "") if isinstance(r, dict) else str(r)) for r in result]
    return "\n".join(f"Doc {i + 1}: {p.strip()}" for i, p in enumerate(passages))


@functools.lru_cache(maxsize=4)
def _local_index(corpus: str):
    # verl loads this file by path (not as a package), so the sibling module is loaded by path too; the index is
    # built once per process and corpus (each agent-loop worker holds its own copy)
    path = Path(__file__).with_name("local_search.py")
    spec = importlib.util.spec_from_file_location("rapo_recipe_local_search", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LocalSearch.from_jsonl(corpus)


def _local(query: str) -> str:
    corpus = os.environ.get("RAPO_SEARCH_CORPUS")
    if not corpus:
        raise ValueError("search tool: RAPO_SEARCH_BACKEND=local needs RAPO_SEARCH_CORPUS (a JSONL corpus), got none")
    return _local_index(corpus).format(query, _topk())


@function_tool
async def search(query: str) -> str:
    """Search the knowledge base and return the top passages.

    Args:
        query: What to look up, e.g. "director of the film Inception".
    """
    # both backends block (HTTP, or a BM25 scan): keep the agent loop's event loop free
    return await asyncio.to_thread(_local if _backend() == "local" else _post, query)
