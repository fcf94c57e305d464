"""The experiment's README.md against its recorded runs (results/): the tables it quotes are the sized run's
table1.md verbatim, the run is what the README says it is (GRPO and RAPO on kb_alias_step, 75 seeds, every check
passing), every recorded run it keeps is one it names, and the repository's README links here."""

from __future__ import annotations

import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE.parents[1]
STEP = HERE / "results" / "step"  # the third round's run, sized by results/pilot


def _section() -> str:
    readme = (HERE / "README.md").read_text()
    return readme.split("## The third round: `kb_alias_step`, a run sized by a pilot", 1)[1].split("\n## ", 1)[0]


def test_readme_quotes_the_sized_step_run():
    """The sized run: GRPO and RAPO on kb_alias_step at the pilot's n, every check of the family in
    table1_checks.json and passing, and the README's section holding its tables verbatim (final success, the paired
    difference, the continuous endpoint's difference, the power table, the checks)."""
    with open(STEP / "table1.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["task"] for r in rows} == {"kb_alias_step"} and {r["method"] for r in rows} == {"GRPO", "RAPO"}
    assert len({r["seed"] for r in rows}) == 75
    checks = json.loads((STEP / "table1_checks.json").read_text())["checks"]
    assert {c.split("/")[0] for c in checks} >= {"no_training_recall", "source_quality", "no_answer_leak_per_seed"}
    assert all(c["pass"] for c in checks.values())
    section = _section()
    md = (STEP / "table1.md").read_text()
    for title in (
        "## Final held-out success",
        "## Paired difference against GRPO (same seeds)",
        "## Power of the paired comparison against GRPO (both endpoints)",
        "## Go/no-go checks",
    ):
        table = md.split(title, 1)[1].split("\n\n", 2)[1]
        assert table.strip() in section, title
    endpoint = md.split("After the last step:", 1)[1].split("\n\n", 3)[2]  # the paired difference of the endpoint
    assert endpoint.strip().startswith("| method - GRPO") and endpoint.strip() in section


def test_every_kept_run_is_quoted_and_every_link_resolves():
    readme = (HERE / "README.md").read_text()
    kept = sorted(p.name for p in (HERE / "results").iterdir() if p.is_dir())
    assert kept == ["control", "hop1", "hop1_fallible", "pilot", "step"]
    for name in kept:
        assert f"results/{name}/" in readme, name
        assert (HERE / "results" / name / "PREDICTION.md").exists()  # each run's prediction was written first
    for link in [x.split(")", 1)[0] for x in readme.split("](")[1:]]:
        assert (HERE / link).exists(), link
    assert "187ce6f" in readme and "411b066" in readme and "e95a5e4" in readme  # where the superseded runs live
    top = (ROOT / "README.md").read_text()
    assert "(experiments/table1/README.md)" in top and "python -m experiments.table1" in top


def test_readme_quotes_the_fair_family_s_primary_differences_from_its_table():
    """The fourth round's fair run: the README's primary figures are its table1.md's paired AUC differences."""
    md = (HERE / "results" / "hop1_fallible" / "table1.md").read_text()
    diffs = md.split("| method - GRPO | kb_hop1 |", 1)[1].split("\n\n", 1)[0]
    readme = (HERE / "README.md").read_text()
    for method in ("RAPO", "RAPO_NOISY"):
        cell = diffs.split(f"| {method} | ", 1)[1].split(" (n=", 1)[0]  # e.g. 0.023 ± 0.020
        assert f"{method} - GRPO +{cell}" in readme, (method, cell)
    assert "| source_not_oracle/kb_hop1 | 0.844 | 0.950 | yes | near-oracle |" in md
