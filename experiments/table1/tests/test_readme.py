"""The README's `rapo-fast table1` section against the recorded full runs (bench/results/table1*/): the tables it
quotes are the runs' table1.md verbatim, and table1.md's numbers are the CSV's through the report's statistics, so
the README quotes what the run measured. tools/table1_readme.py (which writes the section) is run on the
recorded files."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from experiments.table1.report import efficiency_table, main_table, paired_table

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "results" / "table1_legacy"  # the legacy setting's full run (--setting legacy)


def _rows() -> list[dict]:
    with open(RUN / "table1.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["seed"] = int(r["seed"])
        r["steps_to_target"] = int(r["steps_to_target"]) if r["steps_to_target"] else ""
        r["tokens_to_target"] = int(r["tokens_to_target"]) if r["tokens_to_target"] else ""
    return rows


def test_recorded_markdown_is_the_csv_through_the_report():
    rows = _rows()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    md = (RUN / "table1.md").read_text()
    assert len({r["seed"] for r in rows}) == 5 and set(tasks) == {"arith", "kb"}  # the full run: 5 seeds, both
    for make in (main_table, paired_table, efficiency_table):
        assert "\n".join(make(rows, tasks, methods)) in md, make.__name__


def test_readme_quotes_the_recorded_run():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Comparing methods: `rapo-fast table1`", 1)[1].split("\n## ", 1)[0]
    md = (RUN / "table1.md").read_text()
    table = md.split("## Final held-out success", 1)[1].split("\n\n", 2)[1]  # the table right under the title
    assert table.strip() in section and "bench/results/table1_legacy/table1.md" in section
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "table1_readme.py"), str(RUN), "c0ffee", "a CPU"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wall = md.split("wall time ", 1)[1].split(" s", 1)[0]
    assert f"**{int(wall) // 60} min {int(wall) % 60} s**" in section
    verdict = out.split("What it shows: ")[1].split(" This is a miniature")[0].replace("\n", " ")
    assert verdict in section.replace("\n", " ")


FAIR = ROOT / "bench" / "results" / "table1"  # the fair setting's full run (the default)


def test_readme_quotes_the_recorded_fair_run():
    """The fair run: 5 seeds of every method on kb_alias, table1_checks.json with the four go/no-go checks, and the
    README's section holds its tables verbatim (final success, the paired difference, the checks; the rest is in the
    recorded table1.md it names)."""
    from experiments.table1.run import ALL_METHODS

    with open(FAIR / "table1.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["task"] for r in rows} == {"kb_alias"} and len({r["seed"] for r in rows}) == 5
    assert {r["method"] for r in rows} == set(ALL_METHODS)
    checks = json.loads((FAIR / "table1_checks.json").read_text())
    assert {c.split("/")[0] for c in checks["checks"]} == {
        "no_shortcut",
        "imperfect_source",
        "uses_retrieved_step",
        "no_answer_leak",
    }
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Comparing methods: `rapo-fast table1`", 1)[1].split("\n## ", 1)[0]
    md = (FAIR / "table1.md").read_text()
    for title in (
        "## Final held-out success",
        "## Paired difference against GRPO (same seeds)",
        "## Go/no-go checks",
    ):
        table = md.split(title, 1)[1].split("\n\n", 2)[1]
        assert table.strip() in section, title


STEP = ROOT / "bench" / "results" / "table1_step"  # the third round's run, sized by bench/results/table1_pilot


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
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Comparing methods: `rapo-fast table1`", 1)[1].split("\n## ", 1)[0]
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
