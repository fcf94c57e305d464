"""The Table-1 runner: the confidence-interval arithmetic against hand computations, and a tiny configuration end to
end (every method from one SFT warm-up per seed, the same seeds, the CSV's columns, the markdown's numbers equal to
the CSV's). The Triton kernels are off here (their own tests cover them); the run is about the runner."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from experiments.table1 import run as table1
from experiments.table1 import setting
from experiments.table1.families import AliasFamily
from experiments.table1.report import CSV_COLUMNS
from experiments.table1.stats import first_reach, fmt, mean_ci, paired_diff, t975


def test_interval_arithmetic_by_hand():
    m, h = mean_ci([0.5, 0.7, 0.6])
    sd = math.sqrt(((0.5 - 0.6) ** 2 + (0.7 - 0.6) ** 2 + 0) / 2)  # 0.1
    assert m == pytest.approx(0.6) and h == pytest.approx(4.303 * sd / math.sqrt(3))
    assert mean_ci([0.25, 0.75]) == (pytest.approx(0.5), pytest.approx(12.706 * math.sqrt(0.125) / math.sqrt(2)))
    assert math.isnan(mean_ci([0.3])[1]) and mean_ci([0.3])[0] == pytest.approx(0.3)
    assert all(math.isnan(x) for x in mean_ci([]))
    assert t975(1) == 12.706 and t975(4) == 2.776 and abs(t975(100) - 1.9840) < 1e-3 and abs(t975(60) - 2.0003) < 1e-3
    d, hd, n = paired_diff({0: 0.6, 1: 0.8, 2: 0.5}, {0: 0.5, 1: 0.6, 3: 0.9})  # seeds 0, 1: diffs 0.1, 0.2
    assert n == 2 and d == pytest.approx(0.15) and hd == pytest.approx(12.706 * math.sqrt(0.005) / math.sqrt(2))
    assert first_reach([(0, 0.2), (2, 0.5), (4, 0.4)], 0.45) == 2 and first_reach([(0, 0.1)], 0.5) is None
    assert fmt(0.5, 0.1234) == "0.500 ± 0.123" and fmt(0.5, math.nan) == "0.500" and fmt(math.nan, 1) == "n/a"


def test_tiny_table1_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    n = torch.get_num_threads()
    warmups = []
    real_warm_up = AliasFamily.warm_up

    def counting_warm_up(self, data, s, seed, retrieve_frac=None):
        warmups.append(seed)
        return real_warm_up(self, data, s, seed, retrieve_frac)

    monkeypatch.setattr(AliasFamily, "warm_up", counting_warm_up)
    seen = []
    real_run_one = table1.run_one

    def recording_run_one(family, method, seed, s, paths, enc):
        seen.append((family, method, seed, paths["warm"]))
        return real_run_one(family, method, seed, s, paths, enc)

    monkeypatch.setattr(table1, "run_one", recording_run_one)
    s = dict(
        setting.QUICK,
        seeds=2,
        sft_steps=4,
        rl_steps=2,
        eval_every=1,
        n_eval=6,
        n_train=4,
        solver_traces=4,
        families=["kb_alias"],
        methods=list(setting.METHODS),
        encoder="hashed",  # the pipeline is the point; MiniLM's path: the workers test (.ci/run's MiniLM stage)
    )
    rows = table1.run(s, tmp_path, progress=False, workers=0)  # in this process, so that the patches hold
    assert torch.get_num_threads() == n  # restored after the run's 1-thread jobs
    assert warmups == [0, 1]  # one SFT warm-up per (family, seed), shared by the 4 methods
    for seed in (0, 1):
        assert {w for f, m, sd, w in seen if sd == seed} == {tmp_path / f"warm_kb_alias_{seed}.pt"}
        assert sorted(m for _, m, sd, _ in seen if sd == seed) == sorted(setting.METHODS)
        starts = {r["eval_start"] for r in rows if r["seed"] == seed}
        assert len(starts) == 1  # the same weights, the same greedy evaluation: the same start for every method
    with open(tmp_path / "table1.csv") as f:
        got = list(csv.DictReader(f))
    assert tuple(got[0].keys()) == CSV_COLUMNS and len(got) == 8
    assert {r["arpo_rule"] for r in got if r["method"] == "ARPO"} == {"released"}
    assert all(r["encoder"] in ("hashed", "minilm") for r in got)
    assert all(int(r["tokens_generated"]) > 0 for r in got)
    md = (tmp_path / "table1.md").read_text()
    for method in setting.METHODS:  # the table's cells are the CSV's numbers through mean_ci
        finals = [float(r["eval_final"]) for r in got if r["method"] == method]
        assert f"| {method} | {fmt(*mean_ci(finals))} |" in md
    assert (tmp_path / "table1.png").stat().st_size > 0


def test_results_do_not_depend_on_the_number_of_workers(tmp_path, monkeypatch):
    """Every job runs at one thread, in this process (workers 0) or in worker processes that finish in any order:
    the CSV is the same apart from wall times, rows in (family, seed, method) order."""
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")  # inherited by the spawned workers
    # One seed (speed: CI runs this test twice): the two family kinds x two methods still make 2 prepare and 4 run
    # jobs, so each worker runs several jobs in an order of its own while the in-process run takes them in turn.
    s = dict(
        setting.QUICK,
        seeds=1,
        sft_steps=4,
        rl_steps=2,
        eval_every=1,
        n_eval=6,
        n_train=4,
        prompts_per_step=2,
        solver_traces=4,
        families=["kb_alias", "kb_alias_step"],
        methods=["GRPO", "RAPO"],
    )
    got, returned = {}, {}

    def same(v):  # NaN (a figure the family does not have) compares equal to NaN here
        return "nan" if isinstance(v, float) and math.isnan(v) else v

    for w in (0, 2):
        returned[w] = [
            {k: same(v) for k, v in r.items() if k != "wall_s"}
            for r in table1.run(s, tmp_path / f"w{w}", progress=False, workers=w)
        ]
        with open(tmp_path / f"w{w}" / "table1.csv") as f:
            got[w] = [{k: v for k, v in r.items() if k != "wall_s"} for r in csv.DictReader(f)]
    assert len(got[0]) == 4 and got[0] == got[2]
    assert returned[0] == returned[2]  # exactly: every curve point and token count, not only the CSV's 6 digits
    assert [(r["task"], r["seed"], r["method"]) for r in got[0]] == [
        (f, "0", m) for f in s["families"] for m in s["methods"]
    ]
    for f in s["families"]:  # the shared inputs every method of a (family, seed) started from
        assert (tmp_path / "w2" / f"warm_{f}_0.pt").stat().st_size > 0
        assert (tmp_path / "w2" / f"traces_{f}_0.jsonl").read_text() == (
            tmp_path / "w0" / f"traces_{f}_0.jsonl"
        ).read_text()


def test_a_failed_job_names_itself_and_ends_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    s = dict(
        setting.QUICK,
        seeds=1,
        sft_steps=2,
        rl_steps=1,
        eval_every=1,
        n_eval=4,
        n_train=4,
        solver_traces=4,
        mini_batch_groups=0,
        families=["kb_alias"],
        methods=["GRPO", "RAPO"],
    )
    for w in (0, 2):
        with pytest.raises(RuntimeError, match=r"the run job of kb_alias/(GRPO|RAPO)/seed 0 failed: .*mini_batch"):
            table1.run(s, tmp_path / f"w{w}", progress=False, workers=w)


def test_a_resume_without_the_warm_up_figures_measures_them_again_from_the_kept_files(tmp_path, monkeypatch):
    """--reuse-prepared with the weights and sources kept but warmup_*.json gone (a source form changed, a cut run):
    the figures are measured again from the kept files, equal to the first ones, and nothing else is rewritten."""
    import json

    from experiments.table1.jobs import prepare

    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    s = dict(setting.QUICK, sft_steps=2, n_eval=4, n_train=4, solver_traces=4, methods=["GRPO"], encoder="hashed")
    s["reuse_prepared"] = True
    first = prepare("kb_hop1", 0, s, tmp_path)
    figures, kept = json.loads(first["checks"].read_text()), {n: first[n].stat().st_mtime_ns for n in ("warm", "jsonl")}
    first["checks"].unlink()
    again = prepare("kb_hop1", 0, s, tmp_path)
    assert again == first and json.loads(again["checks"].read_text()) == figures
    assert {n: again[n].stat().st_mtime_ns for n in ("warm", "jsonl")} == kept


def test_bad_workers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="workers: expected >= 0, got -1"):
        table1.run(dict(setting.QUICK, families=["kb_alias"], methods=["GRPO"]), tmp_path, progress=False, workers=-1)
    for key, bad in (("seeds", 0), ("methods", []), ("families", [])):
        s = dict(setting.QUICK, families=["kb_alias"], methods=["GRPO"])
        with pytest.raises(ValueError, match=f"setting '{key}': expected"):
            table1.run(dict(s, **{key: bad}), tmp_path, progress=False, workers=0)
    with pytest.raises(SystemExit, match="--workers: expected >= 0"):
        table1.main(["--workers", "-2", "--out", str(tmp_path)])


def test_efficiency_table_by_hand():
    """Seeds starting at or above GRPO's final mean are left out (they 'reach' it at step 0 with every method); the
    ratios to GRPO are paired over the seeds both reached."""
    from experiments.table1.report import efficiency_table

    def row(method, seed, start, final, steps, tokens):
        return {
            "task": "t",
            "method": method,
            "seed": seed,
            "eval_start": start,
            "eval_final": final,
            "steps_to_target": steps,
            "tokens_to_target": tokens,
        }

    rows = [  # GRPO's final mean: (0.7 + 0.5 + 0.6) / 3 = 0.6; seed 2 starts at 0.65, above it
        row("GRPO", 0, 0.3, 0.7, 40, 400), row("GRPO", 1, 0.4, 0.5, "", ""), row("GRPO", 2, 0.65, 0.6, 0, 0),
        row("RAPO", 0, 0.3, 0.8, 20, 300), row("RAPO", 1, 0.4, 0.7, 60, 500), row("RAPO", 2, 0.65, 0.9, 0, 0),
    ]  # fmt: skip
    lines = efficiency_table(rows, ["t"], ["GRPO", "RAPO"])
    assert lines[2] == "| t | GRPO | 1/2 | 40.0 | 400 | 1.00 | 1.00 | 1 |"
    # RAPO reached on seeds 0 and 1 (mean 40 steps, 400 tokens); paired with GRPO on seed 0 only: 20/40, 300/400
    assert lines[3] == "| t | RAPO | 2/2 | 40.0 | 400 | 0.50 | 0.75 | 1 |"


def test_controls_and_ablations_configs():
    """The controls: GRPO with RAPO's on-policy row count, RAPO without the retrieval reward, RAPO without
    importance shaping; every other option equal to the method they control."""
    s = dict(setting.QUICK, group_size=8)
    rapo, grpo = setting.config("RAPO", s, 0), setting.config("GRPO", s, 0)
    matched = setting.config("GRPO_ONPOLICY_MATCHED", s, 0)
    assert matched.rollout.group_size == rapo.rollout.group_size - rapo.rollout.hybrid.n_hybrid == 4
    assert matched.rollout.hybrid.n_hybrid == 0
    assert _without(matched, "rollout.group_size") == _without(grpo, "rollout.group_size")
    no_ret, no_shape = setting.config("RAPO_NO_RET_REWARD", s, 0), setting.config("RAPO_NO_SHAPING", s, 0)
    assert no_ret.advantages.ret_coef == 0.0 and rapo.advantages.ret_coef > 0 and no_shape.loss.shaping_m == 0.0
    assert rapo.loss.shaping_m > 0
    for cfg, field in ((no_ret, "advantages.ret_coef"), (no_shape, "loss")):
        assert _without(cfg, field) == _without(rapo, field)


def _without(cfg, field: str) -> dict:
    """The config's options as {dotted name: value}, the field (or section) `field` left out."""

    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    return {k: v for k, v in flat(cfg.to_dict()) if k != field and not k.startswith(field + ".")}


def test_extra_methods_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPO_FAST_DISABLE_TRITON", "1")
    s = dict(
        setting.QUICK,
        seeds=1,
        sft_steps=4,
        rl_steps=1,
        eval_every=1,
        n_eval=4,
        n_train=4,
        solver_traces=4,
        families=["kb_alias"],
        methods=list(setting.EXTRA_METHODS),
        encoder="hashed",  # as the end-to-end test: MiniLM's path is the workers test's
    )
    rows = table1.run(s, tmp_path, progress=False, workers=0)
    assert [r["method"] for r in rows] == list(setting.EXTRA_METHODS)
    assert len({r["eval_start"] for r in rows}) == 1  # one warm-up for every method
    with pytest.raises(SystemExit, match="unknown methods"):
        setting.setting_from(setting.parser().parse_args(["--methods", "RAPO,NOPE"]))
