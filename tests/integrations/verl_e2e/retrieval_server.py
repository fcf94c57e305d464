"""A Search-R1-style retrieval server on the loopback, for the e2e: what the recipe's `search` tool
(examples/verl/search_tool.py, http backend) calls in a real job, over a small synthetic corpus.

What it is: `RetrievalServer(docs)`, an HTTP server in a thread of the test process on 127.0.0.1 (a free port), that
answers POST /retrieve {"queries": [...], "topk": k, "return_scores": bool} with {"result": [[{"document": {"id",
"contents"}, "score"}, ...] per query]} (scores only with return_scores; the documents alone otherwise), the shape of
Search-R1's retrieval_server.py. The index is faiss-cpu's exact inner product over rapo_fast's hashed n-gram vectors
of the documents (cosine). It records every query it answered (`queries`).
What it is not: a dense retriever or a test module; not for anything but tests.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

DIM = 64


class RetrievalServer:
    """Start with `with RetrievalServer(docs) as server:`; `server.url` is the /retrieve endpoint."""

    def __init__(self, docs: list[str]):
        import faiss

        from rapo_fast.retrieval.encoders import HashedNgramEncoder

        self.docs, self.queries, self._lock = list(docs), [], threading.Lock()
        self._encode = HashedNgramEncoder(DIM)
        self.index = faiss.IndexFlatIP(DIM)
        self.index.add(np.ascontiguousarray(self._encode(self.docs).numpy()))
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/retrieve"
        self._thread = threading.Thread(target=self._http.serve_forever, name="retrieval-server", daemon=True)

    def search(self, queries: list[str], topk: int, return_scores: bool) -> list[list[dict]]:
        scores, ids = self.index.search(np.ascontiguousarray(self._encode(queries).numpy()), topk)
        out = []
        for row_s, row_i in zip(scores, ids):
            docs = [{"id": str(int(i)), "contents": self.docs[int(i)]} for i in row_i if i >= 0]
            out.append([{"document": d, "score": float(s)} for d, s in zip(docs, row_s)] if return_scores else docs)
        return out

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    queries, topk = [str(q) for q in body["queries"]], int(body.get("topk", 3))
                    result = server.search(queries, topk, bool(body.get("return_scores", False)))
                except (KeyError, TypeError, ValueError) as e:
                    self.send_error(400, f"expected {{'queries': [str], 'topk': int}}: {e}")
                    return
                with server._lock:
                    server.queries.extend(queries)
                data = json.dumps({"result": result}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet: the test's output is verl's
                pass

        return Handler

    def __enter__(self) -> RetrievalServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=10)
