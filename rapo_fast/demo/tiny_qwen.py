"""A real-model stand-in built offline: a tiny Qwen2-architecture causal LM and a byte-level BPE tokenizer.

What it is: `build_tiny_qwen(texts)` trains a byte-level BPE tokenizer on `texts` with the `tokenizers` library (no unk
token, as Qwen2.5's; ChatML chat template with a tool role, eos <|im_end|>, pad <|endoftext|>, no bos) and builds a
randomly initialised `Qwen2ForCausalLM` from a config; `warm_up` fits it briefly to chat-formatted solutions, so that
it makes tool calls. Used by tests/integrations and examples/trl/ when no pretrained weights are at hand.
What it is not: a model that solves anything, or a copy of Qwen's tokenizer (same kind, not the same merges).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CHATML_TEMPLATE", "build_tiny_qwen", "warm_up"]

# ChatML as Qwen2.5 writes it, reduced to what the tests need: system/user/assistant turns, tool output in a user turn.
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_tiny_qwen(texts: Sequence[str], *, vocab_size: int = 400, hidden: int = 64, layers: int = 2, seed: int = 0):
    """(model, tokenizer): a byte-level BPE of at most `vocab_size` tokens trained on `texts`, and a Qwen2ForCausalLM
    of `layers` layers of width `hidden` over its vocabulary (weights from `seed`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())  # no unk_token: every byte is in the alphabet, as in Qwen2.5's tokenizer
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(list(texts), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float(), tok


def warm_up(model: Any, tok: Any, texts: Sequence[str], *, steps: int = 40, batch_size: int = 8, lr: float = 3e-3):
    """A few AdamW steps of next-token loss on `texts` (cycled in order), padding excluded; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        chunk = [texts[(step * batch_size + i) % len(texts)] for i in range(batch_size)]
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())
