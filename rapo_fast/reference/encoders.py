"""Reference (spec) of the hashed n-gram history encoder: the plain per-n-gram loop that rapo_fast.retrieval.encoders.
HashedNgramEncoder must reproduce bit for bit (it computes the same crc32 hashes vectorised, tests/retrieval/
test_encoder_keys.py compares them).

What this is not: a fast path (~20 us a word on one core: it is what the step-buffer benchmark's "old" design runs), nor
the retrieval window (the encoder applies it to the text first; a window's key is this function of the window's text).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

__all__ = ["hashed_ngram_ref"]


def hashed_ngram_ref(texts: Sequence[str], dim: int = 256, ngrams: Sequence[int] = (1, 2, 3)) -> torch.Tensor:
    """fp32 [N, dim]: per text, every n-gram (n in `ngrams`) of its whitespace-separated words (str.split()) adds +1 at
    crc32(utf-8 of the words joined by one space) % dim when bit 20 of that crc32 is set, else -1; rows L2-normalised
    (torch.nn.functional.normalize: an empty text gives a zero row)."""
    out = torch.zeros(len(texts), dim, dtype=torch.float32)
    for i, text in enumerate(texts):
        words = text.split()
        for n in ngrams:
            for j in range(len(words) - n + 1):
                h = zlib.crc32(" ".join(words[j : j + n]).encode())
                out[i, h % dim] += 1.0 if (h >> 20) & 1 else -1.0
    return torch.nn.functional.normalize(out, dim=-1)
