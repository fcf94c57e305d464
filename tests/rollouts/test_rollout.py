"""Tests of rapo_fast.rollouts.loop: token kinds, step 0 never retrieves, group exclusion, behaviour log-probs equal to
a full-attention re-score (exact mode), splice == exact at position 0 under greedy decoding, ARPO branching, bad
arguments (a cfg that is no RolloutConfig, a settings keyword), the row states. Not here: the ARPO rules
(test_arpo_rules.py), off-policy trajectories (test_offpolicy_traj.py), the config's fields (tests/train/)."""

import pytest
import torch

from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
from rapo_fast.demo.tiny_policy import build_tiny_policy, final_hidden
from rapo_fast.retrieval.encoders import HashedNgramEncoder
from rapo_fast.retrieval.step_traces import StepTraces
from rapo_fast.rollouts.batch import KIND_GEN, KIND_PROMPT, KIND_RET, KIND_TOOL
from rapo_fast.rollouts.config import RolloutConfig
from rapo_fast.rollouts.engine import DecodeEngine, sample
from rapo_fast.rollouts.loop import rollout
from rapo_fast.rollouts.rows import Row, RowState
from rapo_fast.train.sft import sft_warmup


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A policy warmed up just enough to emit tool calls, a solver-seeded buffer, and training problems."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread avoids oversubscription on shared CI cores
    torch.manual_seed(0)
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    model = build_tiny_policy(tok.vocab_size, hidden_size=64, seed=0)
    sft_warmup(model, tok, task, task.make_problems(500, seed=5, start_qid=5000), steps=60, batch_size=16, seed=0)
    problems = task.make_problems(6, seed=0)
    path = write_jsonl(solver_trajectories(task, problems, 8, 0.2, seed=0), tmp_path_factory.mktemp("traj") / "t.jsonl")
    yield task, tok, model, problems, path
    torch.set_num_threads(threads)


def _traces(tok, path, model=None, kv=False):
    from rapo_fast.kv.splice import StepKVStore

    store = StepKVStore.for_model(model) if kv else None
    return StepTraces.from_jsonl(path, HashedNgramEncoder(), tok, top_k=5, kv_store=store, model=model if kv else None)


def _runs(kinds_row, kind):
    """[start, end) runs of `kind` in a kinds row."""
    out, start = [], None
    for t, k in enumerate(kinds_row + [-1]):
        if k == kind and start is None:
            start = t
        elif k != kind and start is not None:
            out.append((start, t))
            start = None
    return out


def test_token_kinds_and_f_ret(setup):
    task, tok, model, problems, path = setup
    traces = _traces(tok, path)
    g = torch.Generator().manual_seed(1)
    b = rollout(
        model,
        tok,
        task,
        problems,
        RolloutConfig(group_size=4, max_step_tokens=16, hybrid={"n_hybrid": 2, "retrieve_prob": 1.0}),
        traces=traces,
        generator=g,
    )
    assert b.batch_size == 24
    assert int((b.kinds == KIND_RET).sum()) > 0 and int((b.kinds == KIND_TOOL).sum()) > 0  # not vacuous
    open_r, close_r = tok.convert_tokens_to_ids("<retrieve>"), tok.convert_tokens_to_ids("</retrieve>")
    payloads = {tuple(p) for p in traces.payloads.values()}
    for i in range(b.batch_size):
        ids, kinds = b.input_ids[i].tolist(), b.kinds[i].tolist()
        assert kinds[: b.prompt_len[i]] == [KIND_PROMPT] * int(b.prompt_len[i])
        for s, e in _runs(kinds, KIND_TOOL):  # tool output is exactly the tool's answer to the call before it
            step_start = max(j for j in range(s) if kinds[j] != KIND_GEN) + 1
            opens = [j for j in range(step_start, s) if ids[j] == tok.convert_tokens_to_ids("<tool>")]
            call = tok.decode(ids[opens[-1] + 1 : s - 1]) if opens else ""
            assert tok.decode(ids[s:e]) == task.execute(call)
            assert ids[s - 1] == tok.convert_tokens_to_ids("</tool>") and kinds[s - 1] == KIND_GEN
        for s, e in _runs(kinds, KIND_RET):  # retrieved spans are whole buffer payloads
            assert ids[s] == open_r and ids[e - 1] == close_r and tuple(ids[s:e]) in payloads
        if not b.hybrid[i]:
            assert KIND_RET not in kinds
    # the loss sees generated tokens only; F_ret from the token ids independently of the kinds tensor
    assert torch.equal(b.loss_mask, b.kinds == KIND_GEN)
    assert not (b.loss_mask & ((b.kinds == KIND_RET) | (b.kinds == KIND_TOOL))).any()
    for i in range(b.batch_size):
        ids = b.input_ids[i, b.prompt_len[i] :][b.attention_mask[i, b.prompt_len[i] :] == 1].tolist()
        inside, n_ret = False, 0
        for t in ids:
            inside = inside or t == open_r
            n_ret += inside
            inside = inside and t != close_r
        assert b.retrieved_fraction()[i].item() == pytest.approx(n_ret / len(ids))


def test_step0_never_retrieves(setup):
    task, tok, model, problems, path = setup
    traces = _traces(tok, path)
    for seed in range(3):
        b = rollout(
            model,
            tok,
            task,
            problems,
            RolloutConfig(group_size=4, max_step_tokens=16, hybrid={"n_hybrid": 4, "retrieve_prob": 1.0}),
            traces=traces,
            generator=torch.Generator().manual_seed(seed),
        )
        tool_end = tok.convert_tokens_to_ids("</tool>")
        for i in range(b.batch_size):
            kinds, ids = b.kinds[i].tolist(), b.input_ids[i].tolist()
            if KIND_RET in kinds:
                first_ret = kinds.index(KIND_RET)
                # a retrieval comes only after a completed tool step (step 0 is on-policy)
                assert tool_end in ids[b.prompt_len[i] : first_ret]
        if b.retrievals.numel():
            assert (b.retrievals[:, 1] >= 0).all()
            spans = b.step_spans
            first_step_of_row = {int(r): j for j, r in reversed(list(enumerate(spans[:, 0].tolist())))}
            for row, before, *_ in b.retrievals.tolist():
                assert before >= first_step_of_row[row]  # the step before a retrieval exists in the same row


def test_at_prompt_retrieves_before_step0(setup):
    """With at_prompt, a hybrid row may retrieve right after its prompt: the retrieved block opens the completion, the
    retrieval's row in `retrievals` has no step before it (-1) and the step after it is the row's first span; the
    on-policy rows of the same rollout never retrieve."""
    task, tok, model, problems, path = setup
    traces = _traces(tok, path)
    hybrid = {"n_hybrid": 2, "retrieve_prob": 1.0, "at_prompt": True}
    b = rollout(
        model,
        tok,
        task,
        problems,
        RolloutConfig(group_size=4, max_step_tokens=16, hybrid=hybrid),
        generator=torch.Generator().manual_seed(0),
        traces=traces,
    )
    first_span = {int(r): j for j, r in reversed(list(enumerate(b.step_spans[:, 0].tolist())))}
    at_prompt = [r for r in b.retrievals.tolist() if r[1] == -1]
    assert at_prompt, "no retrieval right after the prompt"
    assert (b.retrievals[:, 1] >= -1).all()
    for row, _, after, *_ in at_prompt:
        assert b.kinds[row, int(b.prompt_len[row])].item() == KIND_RET  # the completion opens with the block
        assert after in (-1, first_span.get(row, -1))
    for i in range(b.batch_size):
        assert b.hybrid[i] or KIND_RET not in b.kinds[i].tolist()
    with pytest.raises(TypeError, match="at_prompt"):
        RolloutConfig(hybrid={"at_prompt": "yes"})


def test_excludes_own_group_when_buffer_has_onpolicy_steps(setup):
    task, tok, model, problems, path = setup
    traces = _traces(tok, path)
    # on-policy steps whose keys are the exact histories this rollout will query, under each prompt's own group
    onp = []
    for p in problems:
        steps = task.solution(p)[:-1]
        hist = p.prompt
        for s in steps:
            onp.append((hist, s, p.qid))
            hist = hist + " " + s
    pids = traces.add_steps([h for h, _, _ in onp], [s for _, s, _ in onp], [q for *_, q in onp])
    group_of = {int(pid): q for pid, (_, _, q) in zip(pids, onp)}
    assert traces.has_on_policy
    b = rollout(
        model,
        tok,
        task,
        problems,
        RolloutConfig(group_size=4, max_step_tokens=16, hybrid={"n_hybrid": 4, "retrieve_prob": 1.0}),
        traces=traces,
        generator=torch.Generator().manual_seed(0),
    )
    assert b.retrievals.numel()
    for row, _, _, pid, _ in b.retrievals.tolist():
        assert group_of.get(pid) != int(b.group_ids[row])
    # the search itself: the same history stored under two groups; excluding one returns the other's step
    empty = path.parent / "empty.jsonl"
    empty.write_text("")
    only = StepTraces.from_jsonl(empty, HashedNgramEncoder(), tok)
    hist = problems[0].prompt
    a, c = task.solution(problems[0])[0], task.solution(problems[1])[0]
    pa, pc = only.add_steps([hist, hist], [a, c], [7, 8]).tolist()
    assert int(only.retrieve([hist], None)[1][0]) == pa
    assert int(only.retrieve([hist], [7])[1][0]) == pc
    assert int(only.retrieve([hist], [8])[1][0]) == pa


def test_behaviour_logp_matches_full_attention_in_exact_mode(setup):
    task, tok, model, problems, path = setup
    traces = _traces(tok, path)
    b = rollout(
        model,
        tok,
        task,
        problems[:3],
        RolloutConfig(group_size=4, max_step_tokens=16, hybrid={"n_hybrid": 2, "retrieve_prob": 0.7}),
        traces=traces,
        generator=torch.Generator().manual_seed(2),
    )
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
    full = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    m = b.loss_mask[:, 1:]
    assert (full[m] - b.behav_logp[:, 1:][m]).abs().max() < 1e-4


def test_splice_equals_exact_at_position_zero_greedy(setup):
    from rapo_fast.kv.splice import RopeSpec, StepKVStore, splice_kv

    _, tok, model, _, _ = setup
    model.eval()
    seg = tok.encode("<retrieve> <think> add 5 <tool> 7 + 5 </tool> <obs> 12 </obs> </retrieve>")
    B, L = 3, len(seg)

    def greedy(engine, n=10):
        out = []
        for _ in range(n):
            t, _, _ = sample(engine.last_logits, 0.0, None)
            out.append(t.tolist())
            engine.feed(t[:, None], torch.ones(B, 1, dtype=torch.bool))
        return out

    exact = DecodeEngine(model, B, torch.device("cpu"))
    exact.feed(torch.tensor([seg] * B), torch.ones(B, L, dtype=torch.bool))
    first_exact = exact.last_logits.clone()
    store = StepKVStore.for_model(model)
    store.add_from_model(model, [3], [seg])
    spliced = DecodeEngine(model, B, torch.device("cpu"))
    splice_kv(
        spliced.cache,
        store,
        [(3, r, 0) for r in range(B)],
        RopeSpec.from_model(model),
        lengths=[L - 1] * B,
        rope_positions=[0] * B,
    )
    spliced.extend_columns(torch.ones(B, L - 1, dtype=torch.bool), L - 1)
    spliced.feed(torch.tensor([[seg[-1]]] * B), torch.ones(B, 1, dtype=torch.bool))
    assert (first_exact - spliced.last_logits).abs().max() < 1e-4
    assert greedy(exact) == greedy(spliced)


def test_splice_mode_rollout_runs_and_records_mismatch(setup):
    task, tok, model, problems, path = setup
    traces = _traces(tok, path, model=model, kv=True)
    b = rollout(
        model,
        tok,
        task,
        problems[:3],
        RolloutConfig(group_size=4, mode="splice", max_step_tokens=16, hybrid={"n_hybrid": 4, "retrieve_prob": 1.0}),
        traces=traces,
        generator=torch.Generator().manual_seed(3),
    )
    assert b.mode == "splice" and b.retrievals.numel() > 0
    payloads = {tuple(p) for p in traces.payloads.values()}
    for i in range(b.batch_size):
        for s, e in _runs(b.kinds[i].tolist(), KIND_RET):
            assert tuple(b.input_ids[i, s:e].tolist()) in payloads
    with torch.no_grad():
        h = final_hidden(model, b.input_ids, b.attention_mask)
        logits = model.lm_head(h).float()
    full = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    m = b.loss_mask[:, 1:]
    rows_without = (b.num_retrievals() == 0)[:, None].expand_as(m) & m
    # rows that never spliced are exact; rows that did sample from a (slightly) different behaviour policy
    assert (full[rows_without] - b.behav_logp[:, 1:][rows_without]).abs().max() < 1e-4
    assert torch.isfinite(b.behav_logp).all()


def test_arpo_branching_within_budget(setup):
    task, tok, model, problems, _ = setup
    G = 6
    b = rollout(
        model,
        tok,
        task,
        problems[:4],
        RolloutConfig(
            group_size=G,
            strategy="arpo",
            max_step_tokens=16,
            hybrid={"n_hybrid": 0},
            arpo={"initial": 2, "beam": 2, "k": 4, "alpha": 1.0, "beta": 0.0},
        ),
        generator=torch.Generator().manual_seed(0),
    )
    counts = torch.bincount(b.prompt_index, minlength=4)
    assert (counts <= G).all() and (counts >= 2).all()
    branched = torch.nonzero(b.parent >= 0).squeeze(1).tolist()
    assert branched, "alpha=1 branches at every checked step"
    for i in branched:
        p, at = int(b.parent[i]), int(b.branch_at[i])
        assert int(b.prompt_index[p]) == int(b.prompt_index[i])
        assert torch.equal(b.input_ids[i, :at], b.input_ids[p, :at])  # the shared prefix up to the branch point
        assert torch.equal(b.origin[i, :at], b.origin[p, :at])
        assert b.kinds[i, at - 1] == KIND_TOOL  # branches restart right after a tool result
    assert not (b.kinds == KIND_RET).any()


def test_bad_arguments(setup):
    task, tok, model, problems, _ = setup
    with pytest.raises(ValueError, match="strategy"):
        rollout(model, tok, task, problems, RolloutConfig(strategy="beam"))
    with pytest.raises(ValueError, match="n_hybrid"):
        rollout(model, tok, task, problems, RolloutConfig(group_size=4, hybrid={"n_hybrid": 5}), traces=object())
    with pytest.raises(ValueError, match="traces"):
        rollout(model, tok, task, problems, RolloutConfig(group_size=4, hybrid={"n_hybrid": 2}))
    with pytest.raises(ValueError, match="mode"):
        rollout(model, tok, task, problems, RolloutConfig(strategy="on_policy", mode="fast", hybrid={"n_hybrid": 0}))
    with pytest.raises(ValueError, match="retrieve_prob"):
        rollout(
            model,
            tok,
            task,
            problems,
            RolloutConfig(group_size=2, hybrid={"n_hybrid": 1, "retrieve_prob": 1.5}),
            traces=object(),
        )
    with pytest.raises(ValueError, match="problems"):
        rollout(model, tok, task, [], RolloutConfig(strategy="on_policy", hybrid={"n_hybrid": 0}))
    with pytest.raises(TypeError, match="unexpected keyword"):
        rollout(model, tok, task, problems, RolloutConfig(), group_size=4)
    with pytest.raises(TypeError, match="RolloutConfig"):
        rollout(model, tok, task, problems, {"group_size": 4})


def test_row_states():
    r = Row([1, 2], group=0, pidx=0, hybrid=False, state=RowState.IDLE)
    assert not r.active and not r.live and not r.done
    r.start()
    assert r.active and r.live and r.state is RowState.RUNNING
    r.state = RowState.BOUNDARY
    assert r.live and not r.done
    r.state = RowState.DONE
    assert r.done and r.active and not r.live


@pytest.mark.parametrize("mode", ["exact", "splice", "arpo"])
def test_rollout_uses_the_cache_api_without_deprecation_warnings(setup, mode):
    """The decode engine and the splice hand transformers a DynamicCache (the Cache API of
    transformers 5.x), never a legacy tuple cache, so a rollout raises no DeprecationWarning / FutureWarning and logs
    no transformers warning. The filters are scoped to the rollout call; transformers' warning_once memo is cleared
    first so that a warning already given earlier in the process would be given again here."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    task, tok, model, problems, path = setup
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    hf_logging.warning_once.cache_clear()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            if mode == "arpo":
                cfg = dict(strategy="arpo", hybrid=dict(n_hybrid=0), arpo=dict(initial=2, beam=2, k=4, alpha=1.0))
                kw = {}
            else:  # splice: the StepKVStore's K/V are computed here too (kv/store.py builds a DynamicCache)
                traces = _traces(tok, path, model, kv=mode == "splice")
                cfg = dict(hybrid=dict(n_hybrid=2, retrieve_prob=1.0), mode=mode)
                kw = dict(traces=traces)
            b = rollout(
                model,
                tok,
                task,
                problems[:2],
                RolloutConfig(group_size=4, max_step_tokens=8, **cfg),
                generator=torch.Generator().manual_seed(0),
                **kw,
            )
    finally:
        logger.removeHandler(handler)
    assert b.batch_size == 8
    assert not records, [r.getMessage()[:200] for r in records]
