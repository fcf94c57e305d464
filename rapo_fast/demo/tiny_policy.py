"""A tiny Hugging Face causal LM built from a config, and the word-level tokenizer it speaks.

What this is: the policy of the demo and the tests (a LlamaForCausalLM of ~0.1-1M parameters, no hub download) and a
whitespace tokenizer over a fixed vocabulary: special tokens (<pad>, <bos>, <eos>, <think>, <tool>, </tool>, <obs>,
</obs>, <retrieve>, </retrieve>, <answer>, <unk>) plus the task's words. What it is not: a general tokenizer (no
subwords, unknown words map to <unk>) or a pretrained model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from rapo_fast._checks import check_int

# The HF model helpers live in the library (rapo_fast.train.hf_model); re-exported here for the demo's callers.
from rapo_fast.train.hf_model import final_hidden, lm_head_weight  # noqa: F401

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<unk>",
    "<think>",
    "<tool>",
    "</tool>",
    "<obs>",
    "</obs>",
    "<retrieve>",
    "</retrieve>",
    "<answer>",
)


class WordTokenizer:
    """Whitespace tokenizer over a fixed vocabulary (special tokens first, then `words` in order).

    The attribute names follow Hugging Face tokenizers (`pad_token_id`, `eos_token_id`, `bos_token_id`,
    `vocab_size`, `convert_tokens_to_ids`) so code written for either works with both.
    """

    def __init__(self, words: Iterable[str]):
        vocab = list(SPECIAL_TOKENS)
        for w in words:
            if not isinstance(w, str) or not w or any(c.isspace() for c in w):
                raise ValueError(f"WordTokenizer: words: expected non-empty strings without whitespace, got {w!r}")
            if w not in vocab:
                vocab.append(w)
        self.vocab: list[str] = vocab
        self.token_to_id: dict[str, int] = {t: i for i, t in enumerate(vocab)}
        self.pad_token_id = self.token_to_id["<pad>"]
        self.bos_token_id = self.token_to_id["<bos>"]
        self.eos_token_id = self.token_to_id["<eos>"]
        self.unk_token_id = self.token_to_id["<unk>"]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self.token_to_id.get(tokens, self.unk_token_id)
        return [self.token_to_id.get(t, self.unk_token_id) for t in tokens]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text (tokens separated by whitespace) -> token ids; unknown words become <unk>."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text: expected a str, got {type(text).__name__}")
        ids = [self.token_to_id.get(t, self.unk_token_id) for t in text.split()]
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special: Sequence[str] = ("<pad>",)) -> str:
        """Token ids -> text; the tokens named in `skip_special` are dropped (padding by default)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        skip = set(skip_special)
        return " ".join(self.vocab[i] for i in ids if self.vocab[i] not in skip)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": "rapo_fast.WordTokenizer/1", "vocab": self.vocab}))

    @classmethod
    def load(cls, path: str | Path) -> WordTokenizer:
        data = json.loads(Path(path).read_text())
        vocab = data.get("vocab")
        if data.get("format") != "rapo_fast.WordTokenizer/1" or list(vocab[: len(SPECIAL_TOKENS)]) != list(
            SPECIAL_TOKENS
        ):
            raise ValueError(f"WordTokenizer.load: path: expected a saved WordTokenizer, got {path}")
        return cls(vocab[len(SPECIAL_TOKENS) :])


def build_tiny_policy(
    vocab_size: int,
    *,
    hidden_size: int = 96,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    tie_embeddings: bool = True,
    seed: int | None = None,
) -> torch.nn.Module:
    """A LlamaForCausalLM built from a config (random init, fp32, sdpa attention); ~215k parameters by default.

    Args: vocab_size from the tokenizer; hidden_size divisible by num_heads, num_heads by num_kv_heads.
    Returns the model in train mode on the CPU.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, v in (
        ("vocab_size", vocab_size),
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("max_positions", max_positions),
    ):
        check_int(f"build_tiny_policy: {name}", v, lo=1)
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"build_tiny_policy: hidden_size/num_heads/num_kv_heads: expected each divisible by the next, got "
            f"{hidden_size}/{num_heads}/{num_kv_heads}"
        )
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 8 * hidden_size // 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        rope_theta=10000.0,
        attn_implementation="sdpa",
    )
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg)
    return model
