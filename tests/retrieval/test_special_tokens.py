"""Pieces that go in the middle of a sequence are encoded without special tokens: with a
Llama-style Hugging Face tokenizer, whose `encode(text)` starts every piece with `<s>`, a retrieved step, an
off-policy step and a tool output must not carry a BOS. The tokenizer is a real transformers class
(PreTrainedTokenizerFast over a WordLevel model with a BOS template), built offline here.

What this is not: a tokenizer test (transformers' own) nor a test of the prompt's encoding (a prompt keeps its BOS).
"""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rapo_fast._tokens import encode_plain
from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.offpolicy import split_step

BOS = 1


@pytest.fixture
def hf_tok():
    words = "<retrieve> </retrieve> <tool> </tool> calc add sub mul answer the is 0 1 2 3 4 5 6 7 8 9".split()
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert tok.encode("calc 1 add 2")[0] == BOS  # the trap: a plain encode adds <s>
    return tok


def test_encode_plain_drops_bos_for_hf_and_keeps_plain_tokenizers(hf_tok):
    assert encode_plain(hf_tok, "calc 1 add 2") == hf_tok.encode("calc 1 add 2")[1:]
    demo_tok = ChainArithmeticTask().tokenizer()  # the library's protocol: encode(text) with no such flag
    assert encode_plain(demo_tok, "calc 1 add 2") == demo_tok.encode("calc 1 add 2")


def test_retrieved_and_offpolicy_steps_carry_no_bos(hf_tok, tmp_path):
    task = ChainArithmeticTask()
    recs = solver_trajectories(task, task.make_problems(3, seed=2), n_per_query=4, error_rate=0.3, seed=1)
    traces = StepTraces.from_jsonl(write_jsonl(recs, tmp_path / "t.jsonl"), HashedNgramEncoder(), hf_tok, top_k=2)
    traces.add_steps(["calc 1 add 2"], ["<tool> calc 1 add 2 </tool> 3"], [5])
    assert traces.payloads and all(seg and BOS not in seg for seg in traces.payloads.values()), traces.payloads
    segs, pids, _ = traces.retrieve([recs[0]["prompt"]])
    assert pids[0] >= 0 and segs[0][0] != BOS
    for rec in recs[:4]:
        for step in rec["steps"]:
            gen, obs = split_step(step, hf_tok)
            assert BOS not in gen and BOS not in obs, (step, gen, obs)
