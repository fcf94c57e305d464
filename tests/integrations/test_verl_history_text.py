"""The agent loop's running history text (rapo_fast/integrations/verl/history_text.py): decoded a piece at a time, it
equals the tokenizer's decode of the whole list at every retrieval, for a byte-level BPE with ChatML (Qwen2.5's kind,
multi-byte characters cut between tokens), a SentencePiece-style Metaspace BPE (leading spaces) and a WordPiece (BERT,
the clean-up of spaces), with and without special tokens; each call decodes only the new ids and a few before them;
a list that was not appended to is decoded whole. No verl needed.
"""

from __future__ import annotations

import random

import pytest

from rapo_fast.integrations.verl.history_text import CONTEXT_IDS, HistoryText

TEXTS = [
    "Who directed the film? Let me search. 東京 is the capital, 😀 naïve café — ok.",
    "<tool_call> search director of the film Inception </tool_call> don't we're it's 3.5, (a) [b] {c}",
    "The answer: Christopher Nolan. Über straße ß ü ö 漢字 ..., well!? e.g. x-y_z 12,345",
] * 4


def _byte_level():
    """A byte-level BPE with ChatML's special tokens, as rapo_fast.demo.tiny_qwen builds it (no model here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TEXTS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def _metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _wordpiece(tmp_path):
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    wp = BertWordPieceTokenizer(lowercase=False)
    wp.train_from_iterator(TEXTS, vocab_size=200)
    wp.save_model(str(tmp_path))
    return BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"), do_lower_case=False)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "wordpiece"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_piecewise_text_equals_the_whole_decode(kind, skip_special, tmp_path):
    tok = {"byte_level": _byte_level, "metaspace": _metaspace}.get(kind, lambda: _wordpiece(tmp_path))()
    rng = random.Random(hash((kind, skip_special)) & 0xFFFF)
    specials = tok.all_special_ids
    pieces = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    calls: list[int] = []

    def decode(ids):
        calls.append(len(ids))
        return tok.decode(ids, skip_special_tokens=skip_special)

    pieces_served = 0
    for _ in range(8):  # trajectories
        hist, ids = HistoryText(decode), []
        for _ in range(12):  # retrievals: a random number of ids added between two, cut anywhere
            p = rng.choice(pieces)
            a = rng.randrange(len(p))
            added = p[a : a + rng.randint(0, 9)] + rng.sample(specials, 1) * rng.randint(0, 1)
            ids = ids + added
            calls.clear()
            before = hist.piece_decodes
            assert hist(ids) == tok.decode(ids, skip_special_tokens=skip_special), (kind, ids)
            if hist.piece_decodes > before:  # served by a piece: the context and the new ids, never the whole list
                assert max(calls) <= CONTEXT_IDS + len(added)
        pieces_served += hist.piece_decodes
    assert pieces_served > 8 * 12 // 3  # most calls (a cut character or merge falls back to the whole list)


def test_decodes_only_the_new_ids():
    words = [f"w{i}" for i in range(100)]
    seen: list[list[int]] = []

    def decode(ids):
        seen.append(list(ids))
        return " ".join(words[i] for i in ids)

    hist = HistoryText(decode)
    ids = list(range(50))
    assert hist(ids) == decode(ids) and hist.full_decodes == 1
    seen.clear()
    ids = ids + [60, 61, 62]
    assert hist(ids) == " ".join(words[i] for i in ids)
    assert seen == [list(range(42, 50)), list(range(42, 50)) + [60, 61, 62]]  # 8 ids of context, then the new ones
    assert hist(ids) == hist.text and hist.piece_decodes == 1  # nothing new: nothing decoded
    assert len(seen) == 2


def test_a_list_not_appended_to_is_decoded_whole():
    words = [f"w{i}" for i in range(100)]
    hist = HistoryText(lambda ids: " ".join(words[i] for i in ids))
    hist(list(range(20)))
    for ids in ([1, 2, 3], list(range(19)) + [99, 5, 6], list(range(20, 40))):  # shorter, changed, replaced
        full = hist.full_decodes
        assert hist(ids) == " ".join(words[i] for i in ids)
        assert hist.full_decodes == full + 1
    with pytest.raises(TypeError, match="HistoryText: decode: expected a callable"):
        HistoryText("decode")
