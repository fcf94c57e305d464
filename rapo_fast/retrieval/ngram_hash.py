"""The hashed n-gram encoder's fast path: the crc32 of every n-gram of a word list, vectorised with numpy, equal bit for
bit to crc32 of the n-gram's text (rapo_fast.reference.encoders.hashed_ngram_ref is the spec), and the word window.

How: zlib's crc32 is affine in its running value, so crc32(" " + w, v) = crc32(" " + w, 0) ^ A_n(v), where A_n is a
linear map that depends only on n = len(" " + w) and is four 256-entry table lookups. Each distinct word is hashed once
in Python (cached); an n-gram's crc32 is then its (n-1)-gram's crc32 pushed through the next word's tables, in numpy.
What this is not: the encoder's public class (rapo_fast.retrieval.encoders.HashedNgramEncoder) or a tokenizer.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence

import numpy as np

_MAX_WORDS = 1 << 20  # distinct words cached per encoder before the cache starts again (bounds a long job's memory)


def window_words(text: str, head: int | None, tail: int | None) -> list[str]:
    """text.split(), or its first `head` and last `tail` words when it has more than head + tail (either None: every
    word). Reads only the words it keeps (str.split / rsplit with maxsplit), so a long history costs the window."""
    if head is None or tail is None:
        return text.split()
    first = text.split(maxsplit=head)  # head words, then the rest (leading whitespace stripped) when there is more
    if len(first) <= head:
        return first
    last = first[-1].rsplit(maxsplit=tail)  # the rest's last `tail` words, after what precedes them
    return first[:-1] + (last if len(last) <= tail else last[1:])


class _Words:
    """Per distinct word: crc32(word), crc32(" " + word) and which length table pushes a running crc32 through
    " " + word. Grown under a lock; readers take `self` once and read arrays that only ever grow."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.crc = np.zeros(1024, np.uint32)
        self.crc_sp = np.zeros(1024, np.uint32)
        self.table_of = np.zeros(1024, np.int64)
        self.lengths: dict[int, int] = {}
        self.tables = np.zeros((0, 4, 256), np.uint32)
        self.lock = threading.Lock()

    def lookup(self, words: list[str]) -> np.ndarray:
        get = self.ids.get
        ids = [get(w, -1) for w in words]
        if -1 in ids:
            with self.lock:
                ids = [i if i >= 0 else self._new(w) for i, w in zip(ids, words)]
        return np.fromiter(ids, dtype=np.int64, count=len(ids))

    def _new(self, w: str) -> int:
        i = self.ids.get(w)
        if i is not None:
            return i
        i = len(self.ids)
        if i == len(self.crc):  # new arrays hold the old rows before they replace them: readers never see a gap
            self.crc, self.crc_sp, self.table_of = (np.concatenate([a, np.zeros_like(a)]) for a in self._rows())
        b = w.encode()
        self.crc[i], self.crc_sp[i] = zlib.crc32(b), zlib.crc32(b" " + b)
        self.table_of[i] = self._table(len(b) + 1)
        self.ids[w] = i  # last: a reader that finds the id finds its row
        return i

    def _rows(self) -> tuple[np.ndarray, ...]:
        return self.crc, self.crc_sp, self.table_of

    def _table(self, n: int) -> int:
        """Index of A_n's tables: row k maps byte b to A_n(b << 8k) = crc32(n zero bytes, b << 8k) ^ crc32(..., 0)."""
        t = self.lengths.get(n)
        if t is None:
            z = bytes(n)
            c0 = zlib.crc32(z, 0)
            new = np.array([[zlib.crc32(z, b << (8 * k)) ^ c0 for b in range(256)] for k in range(4)], np.uint32)
            self.tables = np.concatenate([self.tables, new[None]])
            t = self.lengths[n] = len(self.lengths)
        return t


class NgramHasher:
    """crc32 of every n-gram of a word list, vectorised (the module docstring); thread-safe."""

    def __init__(self, ngrams: Sequence[int]):
        self.ngrams = tuple(sorted(set(ngrams)))
        self._words = _Words()

    def hashes(self, words: list[str]) -> np.ndarray:
        """uint32 crc32 of " ".join(words[j:j+n]).encode() for every n in ngrams and every j (any order)."""
        state = self._words
        if len(state.ids) > _MAX_WORDS:
            state = self._words = _Words()
        if not words:
            return np.zeros(0, np.uint32)
        ids = state.lookup(words)
        tables, table_of = state.tables, state.table_of[ids]
        crc_sp = state.crc_sp[ids]
        h = state.crc[ids]
        out = [h] if 1 in self.ngrams else []
        for k in range(1, self.ngrams[-1]):  # h: crc32 of the k-grams starting at 0..; push each through word j+k
            if k >= len(words):
                break
            v, t = h[: len(words) - k], table_of[k:]
            h = crc_sp[k:] ^ tables[t, 0, v & 255] ^ tables[t, 1, (v >> 8) & 255]
            h ^= tables[t, 2, (v >> 16) & 255] ^ tables[t, 3, v >> 24]
            if k + 1 in self.ngrams:
                out.append(h)
        return np.concatenate(out) if out else np.zeros(0, np.uint32)
