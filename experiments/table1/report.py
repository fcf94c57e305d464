"""The files of the Table-1 experiment: table1.csv (one row per run), table1.md (the paper-style table, paired
differences against GRPO and the matched control, the continuous endpoint beside success, the power of both,
efficiency, diagnostics), table1.png (mean held-out curve +- band
per method, one panel per family) and table1_checks.json (the go/no-go checks with the figures behind them).

What this is: formatting of rows that experiments/table1/run.py produced, with the statistics of
experiments/table1/stats.py. What this is not: the runs, or any claim about them.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from experiments.table1.stats import detectable_effect, fmt, mean_ci, n_for_power, paired_diff, paired_sd

COLORS = {
    "GRPO": "tab:blue",
    "ARPO": "tab:green",
    "RAPO": "tab:red",
    "OFFPOLICY_TRAJ": "tab:purple",
    "GRPO_ONPOLICY_MATCHED": "tab:cyan",
    "RAPO_NO_RET_REWARD": "tab:orange",
    "RAPO_NO_SHAPING": "tab:brown",
    "RAPO_SFT_NO_RETRIEVE": "tab:pink",
}
# leak_frac: over the run's hybrid successes that retrieved (hybrid_successes of them), the fraction whose answer was a
# retrieved observation; unobserved_success_final: final greedy evaluation, right answers no observation of the
# row showed; eval_with_retrieval_train_final: the final policy, greedy, on the training questions with retrieval
# from RAPO's source (NaN where the family's completions cannot be read hop by hop); heldout_logp_start / _final:
# the continuous endpoint (experiments/table1/endpoint.py) at the warm-up and after the last step.
CSV_COLUMNS = (
    "task",
    "method",
    "seed",
    "eval_start",
    "eval_final",
    "eval_best",
    "auc",
    "heldout_logp_start",
    "heldout_logp_final",
    "steps_to_target",
    "tokens_to_target",
    "tokens_generated",
    "wall_s",
    "encoder",
    "arpo_rule",
    "leak_frac",
    "hybrid_successes",
    "unobserved_success_final",
    "eval_with_retrieval_train_final",
    "first_reward_step",
    "first_onpolicy_reward_step",
    "signal_frac",
    "retrievals_hop1",
    "retrievals_hop2",
    "retrievals_hop3",
    "hybrid_rows",
    "auc_from_hop1",
    "eval_from_hop1_start",
    "eval_from_hop1_final",
    "hop1_right_start",
    "hop1_right_final",
    "success_after_hop1_start",
    "success_after_hop1_final",
)


def _by(rows: list[dict], task: str, method: str, key: str) -> dict[int, float]:
    return {r["seed"]: float(r.get(key, math.nan)) for r in rows if r["task"] == task and r["method"] == method}


def write_csv(path: Path, rows: list[dict], columns) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k, "")) for k in columns})


def main_table(rows: list[dict], tasks: list[str], methods: list[str], key: str = "eval_final") -> list[str]:
    """Methods as rows, each task and the average over tasks as columns: `key` (final eval by default) mean +- 95% CI
    over seeds (the average column averages each seed's tasks first, so its interval is over seeds too)."""
    lines = ["| method | " + " | ".join(tasks) + " | average |", "|---" * (len(tasks) + 2) + "|"]
    for m in methods:
        cells = [fmt(*mean_ci(list(_by(rows, t, m, key).values()))) for t in tasks]
        per_seed = [_by(rows, t, m, key) for t in tasks]
        seeds = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
        avg = [sum(p[s] for p in per_seed) / len(per_seed) for s in seeds]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {fmt(*mean_ci(avg))} |")
    return lines


def paired_table(
    rows: list[dict], tasks: list[str], methods: list[str], base: str = "GRPO", key: str = "eval_final"
) -> list[str]:
    """Each method's paired per-seed difference of `key` against `base`: mean +- 95% t interval, seeds paired."""
    lines = [f"| method - {base} | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for m in (m for m in methods if m != base):
        cells = []
        for t in tasks:
            d, h, n = paired_diff(_by(rows, t, m, key), _by(rows, t, base, key))
            cells.append(f"{fmt(d, h)} (n={n})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


# The effects the power table sizes n for. Success: +0.05, the paper's average gain. Log-probability: +1 nat per
# question, the correct trajectory e = 2.7 times as likely (about 0.04 nats on each of a 3-hop question's 24 policy
# tokens); measured before it was chosen (fair setting, 3 seeds x 20 RL steps): the warm-up near -15 nats, 20 steps
# lowering it by 0.4-6.6 nats, RAPO - GRPO -0.6 to +2.6 per seed. The table's SD column rescales n to any other
# effect: n is proportional to (SD / effect)^2.
# The primary endpoint is the area under the held-out success curve (exploration.auc: mean success over the run's
# evaluations), sized at the same +0.05; final success and the log-probability (a calibration measure) beside it.
ENDPOINTS = (
    ("auc", "success AUC (primary)", 0.05),
    ("eval_final", "final success", 0.05),
    ("heldout_logp_final", "log-probability (calibration, nats)", 1.0),
)
POWER, ALPHA = 0.8, 0.05


def power_table(rows: list[dict], tasks: list[str], methods: list[str], base: str = "GRPO") -> list[str]:
    """Per task, endpoint and method: the paired per-seed difference against `base` (mean +- 95% t interval, n seeds),
    its per-seed SD, the seeds a two-sided paired test at ALPHA needs for POWER at the endpoint's stated effect, and
    the smallest effect this run's n detects with that power (both by the normal approximation of stats.py)."""
    lines = [
        f"| task | endpoint | method - {base} | difference (n) | SD of difference | effect | n for {POWER:.0%} power "
        f"| detectable at this n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in tasks:
        for key, name, effect in ENDPOINTS:
            for m in (m for m in methods if m != base):
                a, b = _by(rows, t, m, key), _by(rows, t, base, key)
                d, h, n = paired_diff(a, b)
                sd, _ = paired_sd(a, b)
                need = n_for_power(sd, effect, ALPHA, POWER)
                mde = detectable_effect(sd, n, ALPHA, POWER) if n else math.nan
                lines.append(
                    f"| {t} | {name} | {m} | {fmt(d, h)} (n={n}) | {fmt(sd, math.nan)} | {effect:g} "
                    f"| {fmt(need, math.nan, 0)} | {fmt(mde, math.nan)} |"
                )
    return lines


def _reached(rows: list[dict], task: str, method: str, level: float) -> tuple[dict[int, tuple[float, float]], int]:
    """(seed -> (steps, tokens) to reach `level`) over the runs of (task, method) starting below it, and their count."""
    below = [r for r in rows if r["task"] == task and r["method"] == method and float(r["eval_start"]) < level]
    got = {
        r["seed"]: (float(r["steps_to_target"]), float(r["tokens_to_target"]))
        for r in below
        if r["steps_to_target"] != ""
    }
    return got, len(below)


def efficiency_table(rows: list[dict], tasks: list[str], methods: list[str], base: str = "GRPO") -> list[str]:
    """Steps and generated tokens to reach GRPO's final mean eval on the task (the paper's efficiency measure). Only
    seeds whose shared start is below that level count: a seed starting above it "reaches" it at step 0 with every
    method, which says nothing of learning (and, averaged over different seeds per method, made ratios of 0). The
    ratios to GRPO are paired: over the seeds that both the method and GRPO reached, the method's total over GRPO's
    (< 1: faster than GRPO); n is the number of those seeds."""
    lines = [
        "| task | method | reached | steps (mean) | tokens (mean) | steps / GRPO | tokens / GRPO | n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in tasks:
        level = mean_ci([float(r["eval_final"]) for r in rows if r["task"] == t and r["method"] == base])[0]
        b = _reached(rows, t, base, level)[0]
        for m in methods:
            got, n = _reached(rows, t, m, level)
            st = mean_ci([v[0] for v in got.values()])[0]
            tk = mean_ci([v[1] for v in got.values()])[0]
            both = sorted(set(got) & set(b))
            rs = sum(got[s][0] for s in both) / sum(b[s][0] for s in both) if both else math.nan
            rt = sum(got[s][1] for s in both) / sum(b[s][1] for s in both) if both else math.nan
            lines.append(
                f"| {t} | {m} | {len(got)}/{n} | {fmt(st, math.nan, 1)} | {fmt(tk, math.nan, 0)} "
                f"| {fmt(rs, math.nan, 2)} | {fmt(rt, math.nan, 2)} | {len(both)} |"
            )
    return lines


def plot(path: Path, rows: list[dict], tasks: list[str], methods: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for m in methods:
            curves = [r["_curve"] for r in rows if r["task"] == t and r["method"] == m]
            if not curves:
                continue
            steps = [s for s, _ in curves[0]]
            stats = [mean_ci([c[i][1] for c in curves if i < len(c)]) for i in range(len(steps))]
            mean = [s[0] for s in stats]
            half = [0.0 if math.isnan(s[1]) else s[1] for s in stats]
            ax.plot(steps, mean, color=COLORS.get(m), label=m)
            # a success rate lies in [0, 1]: so does its band (a t interval over few seeds can reach past either end)
            lo, hi = [max(0.0, a - b) for a, b in zip(mean, half)], [min(1.0, a + b) for a, b in zip(mean, half)]
            ax.fill_between(steps, lo, hi, color=COLORS.get(m), alpha=0.15)
        ax.set_title(f"{t}: held-out greedy success (mean ± 95% CI)")
        ax.set_xlabel("RL step")
        ax.set_ylabel("held-out greedy success rate (higher is better)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def diagnostics_table(rows: list[dict], tasks: list[str], methods: list[str]) -> list[str]:
    """Per task and method: generated tokens and wall time (means over seeds), leak_frac pooled over the seeds'
    hybrid successes, the final evaluation's unobserved-answer success and the greedy success with retrieval on the
    training questions (means +- 95% CI)."""
    lines = [
        "| task | method | tokens (mean) | wall s (mean) | leak_frac (pooled, n) | unobserved success | "
        "policy with retrieval (train; not the paper's claim) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in tasks:
        for m in methods:
            rs = [r for r in rows if r["task"] == t and r["method"] == m]
            if not rs:
                continue
            n_hits = sum(int(r.get("hybrid_successes", 0) or 0) for r in rs)
            leaked = sum(
                float(r["leak_frac"]) * int(r["hybrid_successes"])
                for r in rs
                if int(r.get("hybrid_successes", 0) or 0) > 0
            )
            leak = f"{leaked / n_hits:.3f} ({n_hits})" if n_hits else "- (0)"
            tokens = fmt(mean_ci([float(r["tokens_generated"]) for r in rs])[0], math.nan, 0)
            wall = fmt(mean_ci([float(r["wall_s"]) for r in rs])[0], math.nan, 0)
            unobs, with_ret = (
                fmt(*mean_ci([float(r.get(k, math.nan)) for r in rs]))
                for k in ("unobserved_success_final", "eval_with_retrieval_train_final")
            )
            lines.append(f"| {t} | {m} | {tokens} | {wall} | {leak} | {unobs} | {with_ret} |")
    return lines


def exploration_table(rows: list[dict], tasks: list[str], methods: list[str]) -> list[str]:
    """Per task and method, RAPO's mechanism (exploration.py): runs that ever saw a reward and the mean first step
    (any row; on-policy rows: the policy on its own), the mean share of groups with a learning signal per step, and
    retrieved steps per run at each hop."""
    lines = [
        "| task | method | runs rewarded | first reward (step) | runs rewarded on-policy | first on-policy reward "
        "(step) | groups with signal | retrievals hop 1 / 2 / 3 (per run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in tasks:
        for m in methods:
            rs = [r for r in rows if r["task"] == t and r["method"] == m and "signal_frac" in r]
            if not rs:
                continue
            cells = []
            for key in ("first_reward_step", "first_onpolicy_reward_step"):
                got = [float(r[key]) for r in rs if r[key] != ""]
                cells += [f"{len(got)}/{len(rs)}", fmt(mean_ci(got)[0], math.nan, 1)]
            signal = fmt(*mean_ci([float(r["signal_frac"]) for r in rs]))
            per_hop = (mean_ci([float(r[f"retrievals_hop{h}"]) for r in rs])[0] for h in (1, 2, 3))
            hops = " / ".join(fmt(v, math.nan, 1) for v in per_hop)
            lines.append(f"| {t} | {m} | " + " | ".join(cells) + f" | {signal} | {hops} |")
    return lines


def checks_lines(checks: dict) -> list[str]:
    lines = ["| check | value | bound | pass | label |", "|---|---|---|---|---|"]
    for name, c in checks.items():
        label = c.get("label", "")
        lines.append(f"| {name} | {c['value']:.3f} | {c['bound']:.3f} | {'yes' if c['pass'] else 'NO'} | {label} |")
    return lines


def _heldout(rows: list[dict]) -> str:
    """The range of distinct held-out questions per run ('?' for rows without the count)."""
    ns = sorted({int(r["n_heldout"]) for r in rows if "n_heldout" in r})
    return "?" if not ns else str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"


def _per_task(v, tasks: list[str]) -> str:
    return ", ".join(f"{t} {v[t]}" for t in tasks) if isinstance(v, dict) else str(v)


def _endpoint_lines(rows: list[dict], tasks: list[str], methods: list[str]) -> list[str]:
    """table1.md's continuous endpoint (warm-up, final, paired difference) and the power table of both endpoints."""
    return [
        "## Calibration: held-out log-probability of the correct hops (teacher-forced, distinct questions; "
        "mean ± 95% CI)",
        "",
        "Per distinct held-out question, the summed log-probability of the policy's tokens of the correct searches and "
        "the answer, observations given (experiments/table1/endpoint.py); nats, higher is better. At the warm-up:",
        "",
        *main_table(rows, tasks, methods, key="heldout_logp_start"),
        "",
        "After the last step:",
        "",
        *main_table(rows, tasks, methods, key="heldout_logp_final"),
        "",
        *paired_table(rows, tasks, methods, key="heldout_logp_final"),
        "",
        "## Power of the paired comparison against GRPO (every endpoint)",
        "",
        *power_table(rows, tasks, methods),
        "",
        f"n: seeds for {POWER:.0%} power, two-sided alpha {ALPHA}, at the stated effect (success and its AUC +0.05, "
        "the paper's average gain; log-probability +1 nat, the correct trajectory e = 2.7 times as likely), from this "
        "run's per-seed SD of the difference; detectable: the smallest true difference this run's n detects with that "
        "power. Normal approximation: n = ((z_0.975 + z_0.8) SD / effect)^2, a few seeds short of a t test's at "
        "small n.",
        "",
    ]


def _withheld_lines(withheld_by: list[str], checks: dict) -> list[str]:
    """table1.md of a run whose gating checks failed: a note naming them, and the checks."""
    return [
        "# Table 1 (miniature): withheld",
        "",
        "The table is withheld: these checks failed, so this run cannot test the claim: "
        + ", ".join(withheld_by)
        + ". The per-run rows are in table1.csv, the figures behind the checks in table1_checks.json.",
        "",
        "## Go/no-go checks (table1_checks.json)",
        "",
        *checks_lines(checks["checks"]),
        "",
    ]


def _success_lines(rows: list[dict], tasks: list[str], methods: list[str], s: dict) -> list[str]:
    """table1.md's success sections: the primary endpoint (AUC), warm-up and final success, the exploration columns
    and the split at hop 1."""
    return [
        "## Primary endpoint: held-out success AUC (mean ± 95% t interval over seeds)",
        "",
        f"The area under the greedy held-out success curve (evaluations every {s['eval_every']} steps, the warm-up "
        "included), divided by the steps: the mean success over training. The policy on its own: no retrieval at "
        "evaluation.",
        "",
        *main_table(rows, tasks, methods, key="auc"),
        "",
        *paired_table(rows, tasks, methods, key="auc"),
        "",
        "## Held-out success at the warm-up and after the last step",
        "",
        "At the warm-up (shared by the methods of a seed):",
        "",
        *main_table(rows, tasks, methods, key="eval_start"),
        "",
        "After the last step:",
        "",
        *main_table(rows, tasks, methods),
        "",
        "## Paired difference against GRPO (same seeds), final success",
        "",
        *paired_table(rows, tasks, methods),
        "",
        "## Exploration (RAPO's mechanism, per run)",
        "",
        *exploration_table(rows, tasks, methods),
        "",
        "Greedy held-out, split at hop 1 (exploration.hop_split): the share of questions whose first step is the "
        "policy's right hop 1, at the warm-up and after the last step, and the success among those after the last "
        "step (retrieval at hop 1 shows hop 1; the retrieved step itself gets no gradient):",
        "",
        *main_table(rows, tasks, methods, key="hop1_right_start"),
        "",
        *main_table(rows, tasks, methods, key="hop1_right_final"),
        "",
        *main_table(rows, tasks, methods, key="success_after_hop1_final"),
        "",
        "From the state a retrieved hop 1 puts a row in (held-out questions with their right hop 1 taken, the policy "
        "alone from hop 2 on): success AUC, and its paired difference against GRPO:",
        "",
        *main_table(rows, tasks, methods, key="auc_from_hop1"),
        "",
        *paired_table(rows, tasks, methods, key="auc_from_hop1"),
        "",
    ]


def write_outputs(
    out: Path,
    rows: list[dict],
    s: dict,
    encoder: str,
    wall_s: float,
    checks: dict | None = None,
    withheld_by: list[str] = (),
) -> None:
    """table1.csv, table1.md and table1.png; with `withheld_by` (failing checks that gate the table), table1.md holds
    only a note naming them and the checks: a setting that cannot test the claim reports no table."""
    if withheld_by:
        write_csv(out / "table1.csv", rows, CSV_COLUMNS)
        (out / "table1.md").write_text("\n".join(_withheld_lines(withheld_by, checks)))
        return
    tasks = [t for t in s["families"] if any(r["task"] == t for r in rows)]
    methods = [m for m in s["methods"] if any(r["method"] == m for r in rows)]
    write_csv(out / "table1.csv", rows, CSV_COLUMNS)
    # RAPO_SFT_NO_RETRIEVE's point is another warm-up (one that never showed a retrieved step)
    other = " but RAPO_SFT_NO_RETRIEVE (a warm-up without retrieve blocks)" if "RAPO_SFT_NO_RETRIEVE" in methods else ""
    md = [
        "# Table 1 (miniature)",
        "",
        f"{s['seeds']} seed(s) per task; every method{other} from the same SFT warm-up weights per seed, "
        f"{s['rl_steps']} RL steps of {s['prompts_per_step']} prompts x G={s['group_size']}, lr {s['lr']:g}, "
        f"PPO mini-batches of {s['mini_batch_groups']} group(s); "
        f"training problems: {_per_task(s['n_train'], tasks)}; greedy evaluation without retrieval on held-out "
        f"questions whose start entities no training question has ({_heldout(rows)} distinct questions per seed); "
        f"history encoder: {encoder}; ARPO: the released code's branching rule; wall time {wall_s:.0f} s.",
        "",
        *_success_lines(rows, tasks, methods, s),
        *_endpoint_lines(rows, tasks, methods),
        "## Efficiency: steps and generated tokens to reach GRPO's final mean eval",
        "",
        *efficiency_table(rows, tasks, methods),
        "",
        "Seeds whose shared start is already at or above GRPO's final mean are left out (every method 'reaches' it at "
        "step 0 there); `reached` counts the others. Steps and tokens (mean): over the seeds the method reached. "
        "Ratios to GRPO: the method's total over GRPO's on the n seeds both reached.",
        "",
    ]
    if "GRPO_ONPOLICY_MATCHED" in methods:
        md += [
            "## Paired difference against GRPO with RAPO's on-policy row count",
            "",
            *paired_table(rows, tasks, methods, base="GRPO_ONPOLICY_MATCHED"),
            "",
        ]
    md += ["## Budgets and diagnostics", "", *diagnostics_table(rows, tasks, methods), ""]
    if checks is not None:
        md += ["## Go/no-go checks (table1_checks.json)", "", *checks_lines(checks["checks"]), ""]
    (out / "table1.md").write_text("\n".join(md))
    plot(out / "table1.png", rows, tasks, methods)


__all__ = [
    "COLORS",
    "CSV_COLUMNS",
    "ENDPOINTS",
    "write_outputs",
    "write_csv",
    "main_table",
    "paired_table",
    "power_table",
    "efficiency_table",
    "plot",
    "diagnostics_table",
    "exploration_table",
    "checks_lines",
]
