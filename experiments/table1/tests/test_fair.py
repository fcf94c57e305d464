"""table1's fair setting: the aliased knowledge base, its warm-up style, the hint probe on a scripted
policy, the rollout reader, the run end to end in quick form (every file written) and the command line.

The setting's claims checked here are structural (what is held out from what, which knowledge base each source
comes from, what the probe and the reader count on constructed cases); what the setting measures is the full run's
business (experiments/table1/design.md)."""

from __future__ import annotations

import csv
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from experiments.table1 import diagnostics as D
from experiments.table1 import run as table1
from experiments.table1 import setting
from experiments.table1.families import RL_CHAINS, AliasFamily, get_family
from experiments.table1.kb import RELATIONS
from experiments.table1.kb_alias import ALIASES, AliasKBTask, alias_table, all_chains, foreign_step
from experiments.table1.report import CSV_COLUMNS


def test_alias_table_is_a_bijection_and_hides_the_chain():
    chains = all_chains()
    assert len(chains) == len(ALIASES) == 18 and len(set(chains)) == 18
    for c in chains:  # types compose hop by hop
        assert all(RELATIONS[a][1] == RELATIONS[b][0] for a, b in zip(c, c[1:]))
    for seed in (0, 1):
        table = alias_table(seed)
        assert sorted(table) == sorted(chains) and sorted(table.values()) == sorted(ALIASES)
    assert alias_table(0) != alias_table(1)
    task = AliasKBTask(chains=RL_CHAINS)
    for p in task.make_problems(50, seed=3):
        words = p.prompt.split()
        assert words[:2] == ["<bos>", "ask"] and words[2] == task.alias_of[p.relations] and len(words) == 4
        assert not set(words) & set(RELATIONS)  # the relations are not in the prompt
    explicit = AliasKBTask(chains=RL_CHAINS, by_alias=False).make_problems(5, seed=3)
    assert all(set(p.relations) <= set(p.prompt.split()) for p in explicit)
    assert AliasKBTask(fact_seed=7).words() == AliasKBTask(chains=RL_CHAINS).words()
    with pytest.raises(ValueError, match="chains must be relation chains of 2-3 hops"):
        AliasKBTask(chains=[("capital", "ceo")])


def test_hints_are_foreign_steps_of_the_same_relation():
    task = AliasKBTask(chains=RL_CHAINS, fact_seed=5)
    for p in task.make_problems(40, seed=1):
        assert len(p.hints) == len(p.relations)
        cur = p.start
        for rel, nxt, hint in zip(p.relations, p.path, p.hints):
            words = hint.split()
            r, ent, obs = words[1], words[5], words[8]
            assert r == rel and ent != cur and task.facts[(rel, ent)] == obs  # a true fact of another entity
            cur = nxt
    assert task.make_problems(10, seed=1) == task.make_problems(10, seed=1)


def test_foreign_warm_up_examples():
    from experiments.table1.kb import KnowledgeBaseTask
    from rapo_fast.rollouts.batch import KIND_GEN, KIND_RET
    from rapo_fast.train.sft import sft_examples

    task = AliasKBTask(chains=RL_CHAINS)
    tok = task.tokenizer()
    probs = task.make_problems(6, seed=0)
    ex = sft_examples(task, tok, probs, retrieve_frac=1.0, rng=random.Random(0), style=foreign_step)
    for p, (ids, kinds) in zip(probs, ex):
        text = tok.decode(ids)
        for k in range(1, len(p.relations)):  # every later hop: the foreign step retrieved, then the own step
            assert f"<retrieve> {p.hints[k]} </retrieve> {task.solution(p)[k]}" in " ".join(text.split())
        assert KIND_RET in kinds and KIND_GEN in kinds
    plain = KnowledgeBaseTask(min_hops=3, max_hops=3)
    with pytest.raises(ValueError, match="foreign_step: problem: expected one hint per step"):
        sft_examples(plain, plain.tokenizer(), plain.make_problems(2, seed=0), 1.0, random.Random(0), foreign_step)


def test_alias_family_holds_out_what_it_says():
    fam, s = AliasFamily(), dict(setting.QUICK, n_train=64, n_eval=64, solver_traces=4)
    d = fam.data(0, s)
    assert not {p.start for p in d["train"]} & {p.start for p in d["evals"]}  # disjoint start entities
    rl_aliases = {d["task"].alias_of[c] for c in RL_CHAINS}
    assert {p.alias for p in d["train"] + d["evals"]} <= rl_aliases
    pool = fam.sft_pool(0)
    assert not {p.alias for p in pool} & rl_aliases  # RL aliases are never demonstrated
    assert {p.relations for p in pool if p.alias is None} >= set(RL_CHAINS)  # their chains are, explicitly
    # RAPO's source is another draw of the facts: its searches mostly disagree with the RL knowledge base
    facts = d["task"].facts
    steps = [st.split() for r in fam.rapo_source(d, s, 0) for st in r["steps"]]
    agree = [facts.get((w[1], w[5])) == w[8] for w in steps if (w[1], w[5]) in facts]
    assert len(agree) > 100 and sum(agree) / len(agree) < 0.3
    # OFFPOLICY_TRAJ's source: the training questions themselves, in the RL knowledge base, imperfect
    off = fam.offpolicy_source(d, s, 0)
    assert {r["query_id"] for r in off} == {p.qid for p in d["train"]}
    assert 0.0 < sum(r["reward"] for r in off) / len(off) < 0.6
    assert 0.0 < fam.chance(d) < 0.1
    assert get_family("kb_alias").name == "kb_alias"
    with pytest.raises(ValueError, match="get_family: name: expected one of"):
        get_family("kb")  # the families before kb_alias live in git history (README.md beside the experiment)


class _ScriptedPolicy(torch.nn.Module):
    """A policy whose greedy step is scripted on the text: after a retrieved block it searches the block's relation
    on its own last observation (a policy that uses a foreign hint); otherwise it searches `default_rel`."""

    def __init__(self, tok, default_rel: str):
        super().__init__()
        self.tok, self.default_rel = tok, default_rel
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        out = torch.full((input_ids.shape[0], input_ids.shape[1], self.tok.vocab_size), -1e4)
        for b, ids in enumerate(input_ids.tolist()):
            words = self.tok.decode(ids).split()
            inside, rel, ent, cut = False, self.default_rel, words[3], 3  # <bos> ask alias start
            for i, w in enumerate(words):
                if w == "<retrieve>":
                    inside = True
                elif w == "</retrieve>":
                    inside, cut = False, i
                elif inside and words[i - 1] == "<think>":
                    rel = w  # the relation of the retrieved step
                elif w == "</obs>" and not inside:
                    ent, cut, rel = words[i - 1], i, self.default_rel  # the own last observation
            script = ["<think>", rel, "<tool>", "search", rel, ent, "</tool>"]
            done = words[cut + 1 :]
            nxt = script[len(done)] if len(done) < len(script) else "</tool>"
            out[b, -1, self.tok.convert_tokens_to_ids(nxt)] = 0.0
        return SimpleNamespace(logits=out)


def test_hint_probe_on_a_scripted_policy():
    task = AliasKBTask(chains=RL_CHAINS)
    tok = task.tokenizer()
    probs = task.make_problems(6, seed=2)
    pr = D.hint_probe(_ScriptedPolicy(tok, "capital"), tok, task, probs)
    want_capital = sum(p.relations[k] == "capital" for p in probs for k in range(1, len(p.relations)))
    assert pr["n"] == sum(len(p.relations) - 1 for p in probs)
    assert pr["p_next_given_hint"] == 1.0 and pr["p_next_without_hint"] == pytest.approx(want_capital / pr["n"])
    c = D.go_no_go({"hint_probe": {"x": pr}})
    assert c["uses_retrieved_step/x"]["pass"]
    blind = D.go_no_go({"hint_probe": {"y": {"p_next_given_hint": 0.3, "p_next_without_hint": 0.3}}})
    assert not blind["uses_retrieved_step/y"]["pass"]


def test_rollout_reader_counts_leaks_by_hand():
    task = AliasKBTask(chains=RL_CHAINS)
    p = task.make_problems(1, seed=0)[0]
    sol = task.solution(p)
    own = " ".join(sol)
    leaked = " ".join([sol[0], f"<retrieve> {sol[1]} </retrieve>", f"<retrieve> {sol[2]} </retrieve>", sol[-1]])
    hinted = " ".join([sol[0], f"<retrieve> {p.hints[1]} </retrieve>", *sol[1:]])
    batch = SimpleNamespace(
        completions=[own, leaked, hinted, own],
        prompt_index=torch.zeros(4, dtype=torch.long),
        hybrid=torch.tensor([False, True, True, False]),
        offpolicy_rows=torch.tensor([False, False, False, True]),
    )
    reader = D.RolloutReader()
    reader.on_step_end(SimpleNamespace(last_batch=batch, last_problems=[p]), 1, {})
    assert reader.hybrid_successes == 2 and reader.leak_frac() == 0.5  # the row off-policy is not the policy's
    sig = reader.signatures()
    assert sig["onpolicy"] == {"SSSA": 1} and sum(sig["hybrid"].values()) == 2
    assert math.isnan(D.RolloutReader().leak_frac())


def test_quick_fair_run_writes_every_file(tmp_path, monkeypatch):
    """kb_alias end to end in miniature: the CSV with the diagnostic columns, the markdown with
    the matched control and the checks, table1_checks.json with the four checks and the per-seed warm-up figures."""
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    methods = ["GRPO", "GRPO_ONPOLICY_MATCHED", "RAPO", "OFFPOLICY_TRAJ", "RAPO_SFT_NO_RETRIEVE"]
    s = dict(
        setting.QUICK,
        seeds=1,
        sft_steps=4,
        rl_steps=1,
        eval_every=1,
        n_eval=6,
        n_train=4,
        solver_traces=4,
        families=["kb_alias"],
        methods=methods,
        encoder="hashed",
    )
    rows = table1.run(s, tmp_path, progress=False, workers=0)
    assert [r["method"] for r in rows] == methods
    with open(tmp_path / "table1.csv") as f:
        got = list(csv.DictReader(f))
    assert tuple(got[0]) == CSV_COLUMNS and {r["task"] for r in got} == {"kb_alias"}
    assert all(0.0 <= float(r["eval_with_retrieval_train_final"]) <= 1.0 for r in got)
    assert all(0.0 <= float(r["unobserved_success_final"]) <= 1.0 for r in got)
    assert (tmp_path / "warm_plain_kb_alias_0.pt").exists() and (tmp_path / "offpolicy_kb_alias_0.jsonl").exists()
    checks = json.loads((tmp_path / "table1_checks.json").read_text())
    assert set(checks["checks"]) == {
        f"{c}/kb_alias" for c in ("no_shortcut", "imperfect_source", "uses_retrieved_step", "no_answer_leak")
    }
    assert "kb_alias/0" in checks["warmup"]
    cond = checks["figures"]["conditioning_probe"]["kb_alias"]  # the hint probe's two probabilities, common name
    assert {"p_next_given_retrieved", "p_next_without_retrieved"} <= set(cond)
    assert cond["p_next_given_retrieved"] == checks["figures"]["hint_probe"]["kb_alias"]["p_next_given_hint"]
    w = checks["warmup"]["kb_alias/0"]
    assert {"rapo_source", "offpolicy_source", "probe", "warmup_rollouts", "chance"} <= set(w)
    md = (tmp_path / "table1.md").read_text()
    assert "against GRPO with RAPO's on-policy row count" in md and "## Go/no-go checks" in md
    assert (tmp_path / "table1.png").stat().st_size > 0


def test_setting_flag():
    p = setting.parser()
    fair = setting.setting_from(p.parse_args([]))
    assert fair["families"] == ["kb_hop1"] and fair["n_eval"] == setting.FULL["n_eval"]
    assert fair["methods"] == list(setting.ALL_METHODS)
    with pytest.raises(SystemExit, match="unknown families"):
        setting.setting_from(p.parse_args(["--families", "arith"]))  # a family before kb_alias: git history
