"""Encoding a piece of text that goes in the middle of a sequence (a retrieved step, a tool output, a step of an
off-policy trajectory): without the tokenizer's special tokens.

Why: a Llama-style tokenizer's `encode(text)` starts every piece with `<s>`, which would then sit in the middle of a
rollout. `encode_plain` passes `add_special_tokens=False` where `encode` takes it, and calls a plain `encode(text)`
otherwise (the library's tokenizer protocol).
What this is not: prompt encoding (a prompt keeps its BOS) nor a tokenizer.
"""

from __future__ import annotations

import inspect
from typing import Any


def _takes_special_tokens_flag(encode: Any) -> bool:
    try:
        params = inspect.signature(encode).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it plainly
        return False
    return "add_special_tokens" in params


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (no BOS/EOS added)."""
    if _takes_special_tokens_flag(tokenizer.encode):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))
