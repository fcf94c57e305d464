"""The agent loop's running history as text, decoded a piece at a time: `HistoryText`.

What it is: the text of a token list that only grows (a trajectory's prompt, turns, tool responses, retrieved
segments), extended at each retrieval by decoding only the ids added since the last one, with a few ids of context:
decoding the whole history every time cost ~0.5 us a token (docs/verl.md, "The step buffer at scale"). Why the
context: a piece decoded alone can differ from its place in the whole (a SentencePiece token's leading space, half a
UTF-8 character in a byte-level token), so the new text is decode(context + new) less decode(context); when that is
not a clean extension, or the ids before the new ones changed, the whole list is decoded instead. Equal to
decode(all ids) on the tokenizers tested (tests/integrations/test_verl_history_text.py).
What it is not: the encoder (the client keys the text). Imports neither verl nor ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["HistoryText"]

CONTEXT_IDS = 8  # ids decoded again before the new ones: enough for a multi-byte character or a word's merge


class HistoryText:
    """`history(ids) -> str`: decode(ids), decoding only the ids added since the previous call (module docstring).
    `full_decodes` and `piece_decodes` count how each call was served."""

    def __init__(self, decode: Callable[[list[int]], str]):
        if not callable(decode):
            raise TypeError(f"HistoryText: decode: expected a callable ids -> str, got {type(decode).__name__}")
        self._decode = decode
        self.text = ""
        self._n = 0  # ids decoded into self.text
        self._last: list[int] = []  # the last CONTEXT_IDS of them (a change there means the list was not appended to)
        self.full_decodes = self.piece_decodes = 0

    def __call__(self, ids: Sequence[int]) -> str:
        n = self._n
        if n and len(ids) >= n and list(ids[max(0, n - CONTEXT_IDS) : n]) == self._last:
            if len(ids) == n:
                return self.text
            ctx = self._last
            before, after = self._decode(ctx), self._decode(ctx + list(ids[n:]))
            new = after[len(before) :]
            if after.startswith(before) and not before.endswith("\ufffd") and "\ufffd" not in new:
                self.piece_decodes += 1
                return self._keep(self.text + new, ids)
        self.full_decodes += 1
        return self._keep(self._decode(list(ids)), ids)

    def _keep(self, text: str, ids: Sequence[int]) -> str:
        self.text, self._n = text, len(ids)
        self._last = list(ids[max(0, len(ids) - CONTEXT_IDS) :])
        return text
