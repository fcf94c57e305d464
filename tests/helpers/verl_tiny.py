"""The tiny chat tokenizer of the verl plugin's tests: a word-level `tokenizers` vocabulary wrapped as a Hugging Face
fast tokenizer with a ChatML-like template (what verl's agent loops need to build prompts), no download.
Not a test module; imported by tests/integrations/verl_plugin/test_verl_agent_loop.py and test_verl_buffer_growth.py.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def chat_word_tokenizer(vocab: dict[str, int]):
    """A PreTrainedTokenizerFast over the whitespace-split words of `vocab` (which must hold <pad>, <unk> and
    <|im_end|>, the eos), with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>")
    out.chat_template = CHAT_TEMPLATE
    return out
