"""The `search` tool of the recipe: verl loads it through `multi_turn.function_tool_path` (a verl `@function_tool`).

What it is: the knowledge-intensive setting of the RAPO paper (Search-R1 style): the agent calls `search(query)` and
gets the top passages from a retrieval server (e.g. Search-R1's e5 + Wikipedia server) at RAPO_SEARCH_URL, POST
{"queries": [query], "topk": k, "return_scores": true}. What it is not: rapo_fast's step retrieval (that is the
step buffer, examples/verl/build_step_buffer.sh), and not run in CI (no retrieval server there; tests only check that
verl can load it and build its schema).
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

from verl.tools.function_tool import function_tool

_URL = os.environ.get("RAPO_SEARCH_URL", "http://127.0.0.1:8000/retrieve")
_TOPK = int(os.environ.get("RAPO_SEARCH_TOPK", "3"))


def _post(query: str) -> str:
    body = json.dumps({"queries": [query], "topk": _TOPK, "return_scores": True}).encode()
    req = urllib.request.Request(_URL, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        result = json.loads(resp.read())["result"][0]
    passages = [(r.get("document", r).get("contents", "") if isinstance(r, dict) else str(r)) for r in result]
    return "\n".join(f"Doc {i + 1}: {p.strip()}" for i, p in enumerate(passages))


@function_tool
async def search(query: str) -> str:
    """Search the knowledge base and return the top passages.

    Args:
        query: What to look up, e.g. "director of the film Inception".
    """
    # the retrieval server is blocking HTTP: keep the agent loop's event loop free
    return await asyncio.to_thread(_post, query)
