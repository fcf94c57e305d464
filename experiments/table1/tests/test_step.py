"""table1's family kb_alias_step: facts drawn per RL step, the advancing retrieval form (never the last hop), the
"advance" warm-up blocks, the recall reader, its checks and the run end to end in miniature (table withheld when a
check fails). Structural claims on constructed cases; what the family measures is a run's business
(experiments/table1/design.md)."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from experiments.table1 import diagnostics as D
from experiments.table1 import run as table1
from experiments.table1 import setting
from experiments.table1.diagnostics import source_quality
from experiments.table1.families import RL_CHAINS, StepFamily, get_family
from experiments.table1.kb_alias import AliasKBTask
from experiments.table1.kb_step import advance_step, advanced_step, chain_length
from experiments.table1.step_checks import advance_probe, step_checks
from rapo_fast.rollouts.batch import KIND_GEN, KIND_RET
from rapo_fast.train.sft import sft_examples

S = dict(n_train=8, n_eval=6, prompts_per_step=3, rl_steps=3)


def test_each_step_asks_its_own_draw_of_the_facts():
    fam = get_family("kb_alias_step")
    d = fam.data(0, S)
    (t0, q0), (t1, q1) = d["step"](0), d["step"](1)
    assert t0.facts != t1.facts and t0.facts != d["task"].facts  # a draw per step, the held-out one its own
    assert t0.entity_type == t1.entity_type == d["task"].entity_type  # the same entities and types
    assert all(p.path == tuple(t0.walk(p.start, p.relations)) for p in q0)  # answered in the step's facts
    assert len(q1) == 3 and {p.qid for p in q0}.isdisjoint(p.qid for p in q1)
    held = {p.start for p in d["evals"]}
    assert held.isdisjoint(p.start for p in d["train"] + q0 + q1)
    assert fam.data(0, S)["step"](1)[1] == q1  # deterministic: every method of a seed sees the same questions


def test_trainer_switches_env_and_buffer_per_step():
    fam = StepFamily()
    d = fam.data(0, S)
    buf = SimpleNamespace(task=None)
    trainer = fam.trainer(d, _tiny(d), buf, _grpo(), None)
    trainer.step_count = 2
    probs = trainer.sample_problems()  # the library's task_sampler, given by the family
    assert trainer.env is d["step"](2)[0] and buf.task is trainer.env and probs == d["step"](2)[1]


def _tiny(d):
    from rapo_fast.demo.tiny_policy import build_tiny_policy

    return build_tiny_policy(d["tok"].vocab_size, seed=0)


def _grpo():
    from rapo_fast.train.trainer import TrainerConfig

    return TrainerConfig.GRPO({"rollout.group_size": 2, "prompts_per_step": 3})


def test_advanced_step_takes_the_hop_for_this_row_and_never_the_last():
    task = AliasKBTask(chains=RL_CHAINS, fact_seed=5)
    p = task.make_problems(1, seed=3)[0]
    sol = task.solution(p)
    h1 = f"{p.prompt} {sol[0]}"
    assert chain_length(task, h1) == 3
    other = task.step_text(p.relations[1], "e0", "e1")  # the source's step: right relation, foreign entity
    assert advanced_step(task, h1, other) == sol[1]  # the relation applied to this row's entity, in its facts
    wrong = next(r for r in RL_CHAINS[0] + RL_CHAINS[1] if r != p.relations[1])
    got = advanced_step(task, h1, task.step_text(wrong, "e0", "e1"))
    assert got == task.step_text(wrong, p.path[0], task.execute(f"search {wrong} {p.path[0]}").split()[1])
    assert advanced_step(task, f"{h1} {sol[1]}", other) is None  # the next hop is the last: no retrieval
    assert advanced_step(task, f"{h1} {sol[1]} {sol[2]}", other) is None  # the chain is complete
    assert chain_length(task, "<bos> ask works_for ceo e3") == 2


def test_advance_warm_up_blocks_stand_for_a_middle_hop_only():
    task = AliasKBTask(chains=RL_CHAINS)
    tok = task.tokenizer()
    probs = task.make_problems(20, seed=1)
    for ids, kinds in sft_examples(task, tok, probs, 1.0, random.Random(0), advance_step):
        text = tok.decode(ids)
        assert text.count("<retrieve>") == 1  # 3 hops: hop 2 only (not the first, not the last)
        gen = [t for t, k in zip(ids, kinds) if k == KIND_GEN]
        ret = [t for t, k in zip(ids, kinds) if k == KIND_RET]
        assert gen.count(tok.convert_tokens_to_ids("<tool>")) == 2 and ret  # the policy writes hops 1 and 3


def test_recall_reader_and_source_quality_by_hand():
    task = AliasKBTask(chains=RL_CHAINS)
    p = task.make_problems(1, seed=0)[0]
    sol = task.solution(p)
    recalled = " ".join([task.step_text(p.relations[0], p.start, "e999"), sol[1], sol[2], sol[3]])
    guessed = " ".join([sol[0], sol[-1]])
    advanced = " ".join([sol[0], f"<retrieve> {sol[1]} </retrieve>", sol[2], sol[3]])
    batch = SimpleNamespace(
        completions=[" ".join(sol), recalled, guessed, advanced],
        prompt_index=torch.zeros(4, dtype=torch.long),
        hybrid=torch.tensor([False, False, False, True]),
        offpolicy_rows=torch.zeros(4, dtype=torch.bool),
    )
    reader = D.RolloutReader(hint_copies=False)
    reader.on_step_end(SimpleNamespace(last_batch=batch, last_problems=[p]), 1, {})
    assert reader.successes == 4 and reader.recall_frac() == 0.5  # a search from e999, an answer never observed
    assert reader.signatures()["hybrid"] == {"SRSA": 1} and reader.leak_frac() == 0.0
    wrong_first = " ".join([task.step_text("capital", p.start, "none"), f"<retrieve> {sol[1]} </retrieve>"])
    reads = [D.read_completion(p, t, hint_copies=False) for t in (advanced, wrong_first)]
    q = source_quality([p, p], reads)
    assert q["right_prefix"] == 1.0 and q["n_right_prefix"] == 1 and q["wrong_prefix"] == 1.0
    assert reader.source_quality() == source_quality([p], reads[:1])  # the run's retrieved steps, read the same
    hinted = D.read_completion(p, " ".join([sol[0], f"<retrieve> {p.hints[1]} </retrieve>", *sol[1:]]))
    assert source_quality([p], [hinted], advancing=False)["right_prefix"] == 1.0  # the hint is for hop 2, as taken


def test_advance_probe_and_checks_on_the_warm_up_policy():
    task = AliasKBTask(chains=RL_CHAINS)
    tok = task.tokenizer()
    d = {"tok": tok}
    model = _tiny(d)
    pr = advance_probe(model, tok, task, task.make_problems(3, seed=0))
    assert pr["n"] == 3 and 0.0 < pr["p_next_given_retrieved"] < 1.0 and 0.0 < pr["p_next_given_own"] < 1.0

    def run(method, seed, recalled, successes, rows, leak):
        frac = recalled / successes if successes else math.nan
        return dict(
            method=method,
            seed=seed,
            training_recall_frac=frac,
            training_recalled=recalled,
            training_successes=successes,
            training_rows=rows,
            leak_frac=leak,
        )

    rows = [
        run("RAPO", 0, 1, 20, 100, 0.1),
        run("GRPO", 0, 4, 10, 1000, math.nan),  # 40% of the successes, but at a guessing rate per row: passes
        run("RAPO", 1, 0, 0, 100, 0.3),
    ]
    warm = [
        {
            "chance": 0.056,
            "source_quality": {"right_prefix": 0.8, "wrong_prefix": 0.1, "n_right_prefix": 10, "n_wrong_prefix": 5},
        }
    ]
    c = step_checks("f", rows, warm)
    assert c["no_training_recall/f"]["pass"] and c["no_training_recall/f"]["per_run"]["GRPO/0"]["frac"] == 0.4
    recalling = step_checks("f", rows + [run("GRPO", 1, 45, 50, 100, math.nan)], warm)["no_training_recall/f"]
    assert not recalling["pass"] and not recalling["per_run"]["GRPO/1"]["pass"] and recalling["value"] == 0.45
    assert recalling["worst_frac"] == 0.9 and recalling["per_run"]["GRPO/1"]["rate_bound"] < 0.45
    assert c["source_quality/f"]["pass"] and c["source_quality/f"]["wrong_prefix"] == 0.1
    assert not c["no_answer_leak_per_seed/f"]["pass"] and c["no_answer_leak_per_seed/f"]["per_seed"] == {
        "0": 0.1,
        "1": 0.3,
    }
    assert step_checks("f", [dict(r, leak_frac=0.0) for r in rows], warm)["no_answer_leak_per_seed/f"]["pass"]
    assert not step_checks(
        "f", rows, [dict(warm[0], source_quality=dict(warm[0]["source_quality"], right_prefix=0.4))]
    )["source_quality/f"]["pass"]


def test_quick_step_run_withholds_the_table_when_a_check_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    methods = ["GRPO", "RAPO", "OFFPOLICY_TRAJ"]
    s = dict(
        setting.QUICK,
        seeds=1,
        sft_steps=4,
        rl_steps=2,
        eval_every=1,
        n_eval=6,
        n_train=4,
        prompts_per_step=2,
        group_size=4,
        solver_traces=4,
        families=["kb_alias_step"],
        methods=methods,
        encoder="hashed",
    )
    rows = table1.run(s, tmp_path, progress=False, workers=0)
    assert [r["method"] for r in rows] == methods
    checks = json.loads((tmp_path / "table1_checks.json").read_text())
    names = {n.split("/")[0] for n in checks["checks"]}
    assert {"no_training_recall", "source_quality", "no_answer_leak_per_seed", "uses_retrieved_step"} <= names
    w = checks["warmup"]["kb_alias_step/0"]
    assert {"probe", "warmup_rollouts", "source_quality"} <= set(w)
    assert "p_next_given_own" in checks["figures"]["conditioning_probe"]["kb_alias_step"]
    failed = [n for n, c in checks["checks"].items() if not c["pass"]]
    md = (tmp_path / "table1.md").read_text()
    assert ("withheld" in md) == bool(failed) and all(n in md for n in failed)


def test_step_family_is_selectable_but_not_the_default():
    p = setting.parser()
    assert setting.setting_from(p.parse_args([]))["families"] == ["kb_hop1"]  # the fourth round's, the default
    assert setting.setting_from(p.parse_args(["--families", "kb_alias_step"]))["families"] == ["kb_alias_step"]
    with pytest.raises(SystemExit, match="unknown families"):
        setting.setting_from(p.parse_args(["--families", "kb_alias_step,kb"]))
    hint = get_family("kb_alias_step_hint")  # the named variant: kb_alias's hint form on the per-step facts
    assert hint.retrieve_style == "foreign" and type(hint.step_traces(*_traces_args())).__name__ == "StepTraces"
    assert type(StepFamily().step_traces(*_traces_args())).__name__ == "AdvancingTraces"


def _traces_args():
    from experiments.table1.kb import kb_solver_trajectories
    from rapo_fast.demo.tasks import write_jsonl
    from rapo_fast.retrieval.encoders import HashedNgramEncoder

    task = AliasKBTask(chains=RL_CHAINS)
    path = _traces_args.tmp / "t.jsonl"
    write_jsonl(kb_solver_trajectories(task, task.make_problems(2, seed=0), 2, 0.2), path)
    return path, HashedNgramEncoder(), task.tokenizer(), 2


@pytest.fixture(autouse=True)
def _tmp_for_traces(tmp_path):
    _traces_args.tmp = tmp_path
