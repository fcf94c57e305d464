"""table1_checks.json: the go/no-go checks of a whole run, from the warm-up files and the runs' rows, per family;
and which failing checks withhold table1.md.

What this is: the gathering of the figures (the checks themselves are diagnostics.go_no_go and
step_checks.step_checks). What this is not: the jobs that measure the figures (jobs.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from experiments.table1 import diagnostics as D
from experiments.table1.families import get_family
from experiments.table1.step_checks import step_checks


def withheld_by(checks: dict) -> list[str]:
    """The failing checks of families whose table a failing check withholds (`gates_table`: kb_alias_step)."""
    return [
        name
        for name, c in checks["checks"].items()
        if not c["pass"] and get_family(name.rsplit("/", 1)[-1]).gates_table
    ]


def _mean(xs) -> float:
    xs = [float(x) for x in xs if not math.isnan(float(x))]
    return sum(xs) / len(xs) if xs else math.nan


def build_checks(rows: list[dict], prepared: dict[tuple[str, int], dict], s: dict) -> dict:
    """table1_checks.json: the go/no-go checks (diagnostics.go_no_go) from the figures of the warm-up
    files and of the runs, per family: no shortcut (the final evaluations' successes with an answer never observed,
    the largest method mean, against the chance of guessing the answer's type), an imperfect source (RAPO's kept
    traces), a policy that can use a retrieved step (the warm-up probe), no answer leak (pooled over RAPO's runs). The
    figures, the per-seed warm-up files and the successes' signatures per method are kept beside the checks."""
    warm = {f"{f}/{seed}": json.loads(Path(p["checks"]).read_text()) for (f, seed), p in sorted(prepared.items())}
    figures: dict = {
        k: {}
        for k in (
            "unobserved_answer_success",
            "kept_trace_correct_frac",
            "conditioning_probe",
            "hint_probe",
            "leak_frac",
        )
    }
    sigs: dict = {}
    for fam in s["families"]:
        ws = [w for key, w in warm.items() if key.split("/")[0] == fam]
        fr = [r for r in rows if r["task"] == fam]
        if not ws:
            continue
        figures["kept_trace_correct_frac"][fam] = _mean(w["rapo_source"]["kept_trace_correct_frac"] for w in ws)
        if "probe" not in ws[0]:
            continue  # a family whose completions are not read hop by hop (arithmetic)
        probe = "hint_probe" if "p_next_given_hint" in ws[0]["probe"] else "conditioning_probe"
        figures[probe][fam] = {k: _mean(w["probe"][k] for w in ws) for k in ws[0]["probe"] if k != "n"}
        per_method = {m: _mean(r["unobserved_success_final"] for r in fr if r["method"] == m) for m in s["methods"]}
        per_method = {m: v for m, v in per_method.items() if not math.isnan(v)}
        if per_method:
            worst = max(per_method, key=per_method.get)
            figures["unobserved_answer_success"][fam] = {
                "value": per_method[worst],
                "method": worst,
                "chance": _mean(w["chance"] for w in ws),
                "n": s["n_eval"] * s["seeds"],
            }
        rapo = [r for r in fr if r["method"] == "RAPO" and int(r.get("hybrid_successes", 0) or 0) > 0]
        n_hits = sum(int(r["hybrid_successes"]) for r in rapo)
        if any(r["method"] == "RAPO" for r in fr):
            figures["leak_frac"][fam] = (
                sum(float(r["leak_frac"]) * int(r["hybrid_successes"]) for r in rapo) / n_hits if n_hits else math.nan
            )
        sigs[fam] = {r["method"] + f"/{r['seed']}": r.get("_signatures", {}) for r in fr}
    checks = D.go_no_go(figures)
    for fam in s["families"]:
        if get_family(fam).gates_table:
            ws = [w for key, w in warm.items() if key.split("/")[0] == fam]
            checks |= step_checks(fam, [r for r in rows if r["task"] == fam], ws)
    for fam, pr in figures["hint_probe"].items():
        # The aliased setting's conditioning probe is the hint probe: its two probabilities under the common name too
        # (the check reads them from hint_probe).
        figures["conditioning_probe"][fam] = {
            "probe": "hint",
            "p_next_given_retrieved": pr["p_next_given_hint"],
            "p_next_without_retrieved": pr["p_next_without_hint"],
        }
    return {
        "checks": checks,
        "figures": figures,
        "warmup": warm,
        "signatures": sigs,
    }


__all__ = ["build_checks", "withheld_by"]
