"""Turn pytest's junit XML, and the progress file of bench/gpu/pytest_progress.py, into a short CSV: one row per
outcome with its count, then one row per test that did not pass (failed, error, skipped, interrupted, not run) with
its message, so the stage's table shows what matters on one screen.

Counts that do not flatter a step stopped at its budget: a test that started but whose call phase never reported is
`interrupted` (the XML holds an empty element for it, or lists it as passed), and a collected test that never started
is `not run` (the XML does not list it at all); each gets its own row, and the outcome rows say how many. Without a
progress file (or with an empty one) only the XML's outcomes are counted, and a `progress unknown` row says that
interrupted and unstarted tests cannot be told apart. A missing XML (pytest killed before writing it) is read as no
reports.
Usage: `python bench/gpu/junit_table.py IN.xml OUT.csv [PROGRESS.jsonl]`. What this is not: a test report renderer (the
XML and the stage log hold the full output).
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FIELDS = ["outcome", "count", "test", "seconds", "message"]


def _xml_cases(xml_path: Path) -> dict[str, dict]:
    """name -> case from the XML; names are `file-stem-or-class::test` as junit writes them."""
    cases: dict[str, dict] = {}
    if not xml_path.exists():
        return cases
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if not case.get("name"):  # the test in flight at the interrupt: an empty element (the progress file names it)
            continue
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, message = tag, (el.get("message") or "").replace("\n", " ")[:160]
                break
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name', '')}"
        cases[name] = dict(test=name, outcome=outcome, seconds=case.get("time", ""), message=message)
    return cases


def _junit_name(nodeid: str) -> str:
    """The XML's name for a pytest node id: `tests/a/test_b.py::C::t[x]` -> `C::t[x]`, `tests/a/test_b.py::t` ->
    `test_b::t` (junit's classname is the dotted module, plus the class when there is one)."""
    parts = nodeid.split("::")
    owner = parts[-2] if len(parts) > 2 else Path(parts[0]).stem
    return f"{owner}::{parts[-1]}"


def _progress(path: Path | None) -> tuple[list[str], set[str], set[str]] | None:
    """(collected, started, called) node ids from the progress file; None when there is none to read."""
    if path is None or not path.exists() or not path.read_text().strip():
        return None
    collected: list[str] = []
    started, called = set(), set()
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed writer
            continue
        if ev["event"] == "collected":
            collected.append(ev["nodeid"])
        elif ev["event"] == "start":
            started.add(ev["nodeid"])
        elif ev["event"] == "report" and (ev["when"] == "call" or ev["outcome"] != "passed"):
            called.add(ev["nodeid"])  # the call phase reported, or setup failed/skipped (no call phase then)
    return list(dict.fromkeys(collected)), started, called


def rows(xml_path: str | Path, progress_path: str | Path | None = None) -> list[dict]:
    cases = _xml_cases(Path(xml_path))
    prog = _progress(Path(progress_path) if progress_path else None)
    extra: list[dict] = []
    if prog is None:
        extra.append(
            dict(
                outcome="progress unknown",
                test="",
                message="no progress file: interrupted tests count as "
                "passed and tests that never started are not counted",
            )
        )
    else:
        collected, started, called = prog
        for nodeid in collected:
            name = _junit_name(nodeid)
            if nodeid in started and nodeid not in called:
                cases[name] = dict(test=name, outcome="interrupted", seconds="", message="stopped before it reported")
            elif nodeid not in started:
                cases[name] = dict(test=name, outcome="not run", seconds="", message="never started")
    counts = Counter(c["outcome"] for c in cases.values())
    out = [dict(outcome=k, count=v) for k, v in sorted(counts.items())]
    return out + extra + [c for c in cases.values() if c["outcome"] != "passed"]


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: junit_table.py IN.xml OUT.csv [PROGRESS.jsonl]", file=sys.stderr)
        return 2
    table = rows(argv[0], argv[2] if len(argv) == 3 else None)
    with open(argv[1], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(table)
    print(f"{len(table)} rows written to {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
