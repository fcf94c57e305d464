"""ARPO's two branching rules (rapo_fast/rollouts/arpo.py) against hand-walked examples: the paper rule's bounded
relative rise, the released rule's top-k entropy over the first k tokens / log|V|, its absolute rise, its decision at
the tool result on the segment that ended in the call, its coin per copy and its one-at-a-time fresh rollouts; then
both rules inside a real rollout (budget, shared prefixes, restarts right after a tool result).
Not here: the rollout loop itself (test_rollout.py) or advantage attribution (tests/train)."""

from __future__ import annotations

import math

import pytest
import torch

from rapo_fast.rollouts.arpo import (
    ArpoBrancher,
    paper_branch_prob,
    released_copies,
    released_segment_entropy,
    topk_entropy,
)


class _Coin:
    """random.Random stand-in that returns the given draws in order."""

    def __init__(self, draws):
        self.draws = list(draws)

    def random(self):
        return self.draws.pop(0)


def test_paper_rule_by_hand():
    assert paper_branch_prob(0.2, 0.2, 0.5, 0.2) == pytest.approx(0.5)  # no rise
    assert paper_branch_prob(0.3, 0.2, 0.5, 0.2) == pytest.approx(0.5 + 0.2 * 0.5)  # rise (0.3-0.2)/0.2 = 0.5
    assert paper_branch_prob(2.74, 0.2, 0.5, 0.2) == pytest.approx(0.7)  # rise 12.7, bounded to 1
    assert paper_branch_prob(0.0, 0.2, 0.5, 0.2) == pytest.approx(0.3)  # rise -1
    assert paper_branch_prob(5.0, 0.0, 0.5, 0.2) == pytest.approx(0.5)  # H_init 0: no rise
    assert paper_branch_prob(5.0, None, 0.5, 0.2) == pytest.approx(0.5)
    assert paper_branch_prob(5.0, 1.0, 0.9, 0.5) == 1.0  # clamped to [0, 1]


def test_released_entropy_by_hand():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log() + 3.0  # any shift: softmax gives p back
    # top-2 of one position: -(0.5 ln 0.5 + 0.3 ln 0.3), not renormalised
    want = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3))
    assert topk_entropy(logits, 1.0, 2) == pytest.approx(want, rel=1e-6)
    assert topk_entropy(logits, 1.0, 10) == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6)  # k >= V: all
    q = torch.softmax(logits / 2.0, -1)  # temperature 2
    assert topk_entropy(logits, 2.0, 4) == pytest.approx(-(q * q.log()).sum().item(), rel=1e-6)
    # segment: the sum over positions, over log |V|
    assert released_segment_entropy(2 * want, 4) == pytest.approx(2 * want / math.log(4))


def test_released_coin_per_copy_by_hand():
    # alpha 0.5, beta 0.5, rise 0.4: copy j when clamp(u_j - 0.2, 0, 1) <= 0.5, i.e. u_j <= 0.7
    assert released_copies(_Coin([0.1, 0.75, 0.69, 0.95]), 4, 0.4, 0.5, 0.5) == 2
    assert released_copies(_Coin([0.0, 0.3]), 2, -2.0, 0.5, 0.5) == 0  # u + 1 -> 1 > 0.5: never
    assert released_copies(_Coin([0.99, 0.99]), 2, 3.0, 0.0, 0.5) == 2  # u - 1.5 -> 0 <= 0: always
    assert released_copies(_Coin([]), 0, 1.0, 0.5, 0.5) == 0


class _Row:
    def __init__(self, pidx, active):
        self.pidx, self.active, self.done = pidx, active, False
        self.cur_start, self.steps, self.tokens, self.ent = None, [], [], []
        self.hybrid, self.to_feed, self.at_boundary, self.parent, self.branch_at = False, [], False, -1, -1

    def start(self):  # as rapo_fast.rollouts.rows.Row.start: live again
        self.active, self.done, self.at_boundary = True, False, False

    def snapshot(self):
        return {
            "tokens": list(self.tokens),
            "steps": [list(s) for s in self.steps],
            "cols": list(range(len(self.tokens))),
        }

    def restore(self, snap):
        self.tokens, self.steps, self.cur_start = list(snap["tokens"]), [list(s) for s in snap["steps"]], None


class _Engine:
    def __init__(self, n, v):
        self.last_logits = torch.zeros(n, v)
        self.copies = []

    def copy_row(self, src, dst, cols, length, logits):
        self.copies.append((src, dst, length))


def _segment(br, eng, row, i, logits_rows, ends_in_tool=True):
    """Row i generates one segment: one token per logits row (before_sample / after_sample around each, as the
    rollout does), the segment ending in a tool call (step closed, tool output appended) or at <eos>."""
    for j, z in enumerate(logits_rows):
        br.before_sample([i])
        eng.last_logits[i] = z
        if row.cur_start is None:
            row.cur_start = len(row.tokens)
        row.tokens.append(7)
        row.ent.append(0.0)
        if j == len(logits_rows) - 1:
            start = row.cur_start
            if ends_in_tool:
                row.tokens += [1, 1]  # the tool's output
                row.steps.append([start, len(row.tokens) - 2, len(row.tokens)])
            else:
                row.steps.append([start, len(row.tokens), len(row.tokens)])
                row.done = True
            row.cur_start = None
        br.after_sample([i])


def test_released_rule_walk_through_one_group():
    """One prompt, G = 3 slots, 1 started row, beam 3, k = 2 first tokens, top-2 entropy, alpha 0.5, beta 1."""
    V = 4
    rows = [_Row(0, True), _Row(0, False), _Row(0, False)]
    eng = _Engine(3, V)
    coin = _Coin([0.6, 0.9, 0.4])
    br = ArpoBrancher(rows, eng, 3, 1, beam=3, k=2, alpha=0.5, beta=1.0, coin=coin, rule="released", topk=2)
    flat, peaked = torch.zeros(V), torch.tensor([4.0, 0.0, 0.0, 0.0])
    e_flat, e_peak = topk_entropy(flat, 1.0, 2), topk_entropy(peaked, 1.0, 2)
    # segment 0: 3 tokens, only the first k = 2 count: H_init = (e_flat + e_peak) / ln 4
    _segment(br, eng, rows[0], 0, [flat, peaked, flat])
    h_init = (e_flat + e_peak) / math.log(V)
    assert rows[0].arpo["h_init"] == pytest.approx(h_init) and rows[0].arpo["seg_h"] == pytest.approx(h_init)
    assert eng.copies == []  # nothing decided until the next segment's first token
    # segment 1: its first token is the decision point (rise 0: u - 0 <= 0.5? draws 0.6 -> no, 0.9 -> no)
    _segment(br, eng, rows[0], 0, [peaked, peaked])
    assert eng.copies == [] and coin.draws == [0.4]
    h1 = 2 * e_peak / math.log(V)
    assert rows[0].arpo["seg_h"] == pytest.approx(h1) and rows[0].arpo["h_init"] == pytest.approx(h_init)
    # segment 2: decided on segment 1 (one step behind): rise = h1 - h_init < 0, one coin per free slot
    rise = h1 - h_init
    assert rise < 0
    coin.draws = [0.05, 0.2]  # copy j when clamp(u_j - rise, 0, 1) <= 0.5
    assert (0.05 - rise <= 0.5) and not (0.2 - rise <= 0.5)
    _segment(br, eng, rows[0], 0, [flat], ends_in_tool=False)
    assert eng.copies == [(0, 1, len(rows[0].snapshot()["tokens"]) - 1)]  # restarts from right after the tool output
    assert rows[1].active and rows[1].parent == 0 and rows[1].arpo["h_init"] is None  # its own first segment sets it
    assert not rows[2].active
    # the copy does not branch again at the point it was created at
    br.before_sample([1])
    assert len(eng.copies) == 1
    # one fresh rollout at a time once every started row has ended
    rows[1].done = True
    assert br.refresh() and rows[2].active


def test_paper_rule_walk_through_one_group():
    """The paper rule on the same group: full-vocabulary mean entropies of the first k tokens of the step after the
    tool result, one coin for all copies, H_init inherited, `initial` fresh rollouts when all ended."""
    rows = [_Row(0, True), _Row(0, False), _Row(0, False)]
    eng = _Engine(3, 4)
    coin = _Coin([0.55])
    br = ArpoBrancher(rows, eng, 3, 1, beam=3, k=2, alpha=0.5, beta=0.2, coin=coin, rule="paper")

    def seg(ents, tool=True):
        for j, e in enumerate(ents):
            br.before_sample([0])
            r = rows[0]
            if r.cur_start is None:
                r.cur_start = len(r.tokens)
            r.tokens.append(7)
            r.ent.append(e)
            if j == len(ents) - 1:
                r.tokens += [1] if tool else []
                r.steps.append([r.cur_start, len(r.tokens) - (1 if tool else 0), len(r.tokens)])
                r.cur_start, r.done = None, not tool
            br.after_sample([0])

    seg([1.0, 1.0, 1.0])  # step 0: H_init = mean of its first k = 2 entropies
    assert rows[0].arpo["h_init"] == pytest.approx(1.0)
    # step 1: mean of its first 2 = 1.5: rise 0.5, p = 0.5 + 0.2 * 0.5 = 0.6 > u = 0.55 -> both free slots copied
    seg([1.0, 2.0, 9.0], tool=False)
    assert [c[:2] for c in eng.copies] == [(0, 1), (0, 2)]
    assert rows[1].arpo["h_init"] == pytest.approx(1.0)  # inherited


@pytest.mark.parametrize("rule", ["paper", "released"])
def test_rules_inside_a_rollout(rule):
    """Both rules in a real rollout of a warmed-up tiny policy: the budget holds, branches share their parent's prefix
    and restart right after a tool result; with branching off (alpha 0, beta 0) the released rule fills the slots
    with fresh rollouts, one at a time."""
    from rapo_fast.demo.tasks import ChainArithmeticTask
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.rollouts.batch import KIND_TOOL
    from rapo_fast.rollouts.config import RolloutConfig
    from rapo_fast.rollouts.loop import rollout
    from rapo_fast.train.sft import sft_warmup

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = ChainArithmeticTask()
        tok = task.tokenizer()
        model = build_tiny_policy(tok.vocab_size, hidden_size=64, seed=0)
        sft_warmup(model, tok, task, task.make_problems(200, seed=5, start_qid=5000), steps=40, batch_size=16, seed=0)
        problems = task.make_problems(3, seed=0)
        G = 5
        cfg = RolloutConfig(
            group_size=G,
            strategy="arpo",
            hybrid={"n_hybrid": 0},
            max_step_tokens=16,
            arpo={"initial": 2, "beam": 2, "k": 4, "rule": rule, "alpha": 1.0, "beta": 0.0},
        )
        b = rollout(model, tok, task, problems, cfg, generator=torch.Generator().manual_seed(0), seed=0)
        counts = torch.bincount(b.prompt_index, minlength=3)
        assert (counts <= G).all() and (counts >= 2).all()
        branched = torch.nonzero(b.parent >= 0).squeeze(1).tolist()
        assert branched
        for i in branched:
            p, at = int(b.parent[i]), int(b.branch_at[i])
            assert torch.equal(b.input_ids[i, :at], b.input_ids[p, :at])
            assert b.kinds[i, at - 1] == KIND_TOOL
        if rule == "released":
            off = cfg.replace({"arpo.alpha": 0.0})
            b0 = rollout(model, tok, task, problems, off, generator=torch.Generator().manual_seed(0), seed=0)
            assert (b0.parent == -1).all()
            assert torch.bincount(b0.prompt_index, minlength=3).tolist() == [G] * 3  # fresh ones filled every slot
    finally:
        torch.set_num_threads(n)
