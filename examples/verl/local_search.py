"""A small local retriever for the recipe's `search` tool: BM25 over a JSONL corpus, in plain Python, no network.

What it is: the `local` backend of examples/verl/search_tool.py (RAPO_SEARCH_BACKEND=local, corpus at
RAPO_SEARCH_CORPUS), so the recipe and its 1-GPU smoke run without a retrieval server. The corpus is one JSON object
per line with the passage under "contents" (Search-R1's wiki corpus format: '"Title"\\ntext'; "text" or "title" +
"text" are read too) and optionally "id". Search is Okapi BM25 (k1 = 1.2, b = 0.75) over lower-cased word tokens;
ties go to the earlier passage, so results are deterministic. It answers with the same "Doc i: ..." text as the HTTP
backend.
What it is not: the paper's dense retriever (e5 over Wikipedia; a BM25 ranking differs from it) nor a server: the whole
corpus is indexed in the memory of each process that loads the tool (fine for the smoke corpus or some 10^5
passages, not for the 21M-passage wiki dump: run Search-R1's server for that). Needs nothing beyond the standard
library, so it loads without verl (tests/integrations/test_verl_recipe_local.py).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (unicode letters and digits)."""
    return _WORD.findall(text.lower())


def _passage(rec: object, where: str) -> str:
    if not isinstance(rec, dict):
        raise ValueError(f"local search corpus: {where} must be a JSON object, got {type(rec).__name__}")
    if isinstance(rec.get("contents"), str):
        return rec["contents"]
    if isinstance(rec.get("text"), str):
        title = rec.get("title")
        return f'"{title}"\n{rec["text"]}' if isinstance(title, str) and title else rec["text"]
    raise ValueError(f"local search corpus: {where} needs a str 'contents' (or 'text'), got keys {sorted(rec)}")


class LocalSearch:
    """BM25 index over a list of passages. `search(query, topk)` -> [(passage index, score)], best first."""

    def __init__(self, passages: list[str], *, k1: float = 1.2, b: float = 0.75):
        if not isinstance(passages, list) or not all(isinstance(p, str) for p in passages):
            raise TypeError(f"LocalSearch: passages must be a list of str, got {type(passages).__name__}")
        if not passages:
            raise ValueError("LocalSearch: passages must not be empty, got 0 passages")
        if not (math.isfinite(k1) and k1 >= 0 and math.isfinite(b) and 0 <= b <= 1):
            raise ValueError(f"LocalSearch: expected k1 >= 0 and b in [0, 1], got k1={k1!r}, b={b!r}")
        self.passages = passages
        self.k1, self.b = float(k1), float(b)
        self._tf = [Counter(tokenize(p)) for p in passages]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = max(1e-9, sum(self._len) / len(self._len))
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(passages)
        # BM25's idf with the +1 inside the log (Lucene's): never negative, so a very common word cannot push down
        self._idf = {w: math.log(1.0 + (n - d + 0.5) / (d + 0.5)) for w, d in df.items()}
        self._postings: dict[str, list[int]] = {}
        for i, tf in enumerate(self._tf):
            for w in tf:
                self._postings.setdefault(w, []).append(i)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: float) -> LocalSearch:
        """Index a JSONL corpus (module docstring); ValueError naming the file and line on a bad line."""
        passages = []
        with Path(path).open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"local search corpus: {path}:{i} is not valid JSON ({e})") from None
                passages.append(_passage(rec, f"{path}:{i}"))
        return cls(passages, **kwargs)

    def search(self, query: str, topk: int = 3) -> list[tuple[int, float]]:
        """The `topk` passages with the highest BM25 score for `query` (only passages sharing a word with it)."""
        if not isinstance(query, str):
            raise TypeError(f"LocalSearch.search: query must be a str, got {type(query).__name__}")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"LocalSearch.search: topk must be a positive int, got {topk!r}")
        scores: dict[int, float] = {}
        for w, qf in Counter(tokenize(query)).items():
            idf = self._idf.get(w)
            if idf is None:
                continue
            for i in self._postings[w]:
                tf = self._tf[i][w]
                norm = tf + self.k1 * (1.0 - self.b + self.b * self._len[i] / self._avg)
                scores[i] = scores.get(i, 0.0) + qf * idf * tf * (self.k1 + 1.0) / norm
        return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:topk]

    def format(self, query: str, topk: int = 3) -> str:
        """The tool's answer: "Doc 1: ...\\nDoc 2: ..." (the HTTP backend's text), or a line saying nothing matched."""
        hits = self.search(query, topk)
        if not hits:
            return "No passage matched the query."
        return "\n".join(f"Doc {j + 1}: {self.passages[i].strip()}" for j, (i, _) in enumerate(hits))
