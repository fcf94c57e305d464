"""Turn pytest's junit XML, and the progress file of bench/gpu/pytest_progress.py, into a short CSV: one row per
outcome with its count, then one row per test that did not pass (failed, error, skipped, interrupted, not run) with
its message, so the stage's table shows what matters on one screen.

Counts that do not flatter a step stopped at its budget: a test that started but whose call phase never reported is
`interrupted` (the XML holds an empty element for it, or lists it as passed), and a collected test that never started
is `not run` (the XML does not list it at all); each gets its own row, and the outcome rows say how many. Without a
progress file (or with an empty one) only the XML's outcomes are counted, and a `progress unknown` row says that
interrupted and unstarted tests cannot be told apart. A missing XML (pytest killed before writing it) loses no
outcome: each test the progress file saw reported keeps its outcome (a failed test stays failed, with the last line of
its report as the message). bench/gpu/pytest_progress.py streams this table into the call's output folder as tests
end, so a call killed during its test step still brings one back.
Usage: `python bench/gpu/junit_table.py IN.xml OUT.csv [PROGRESS.jsonl]`. What this is not: a test report renderer (the
XML and the stage log hold the full output).
"""

from __future__ import annotations

import csv
import json
import os
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


def _events(path: Path | None) -> list[dict] | None:
    """The progress file's events; None when there is none to read."""
    if path is None or not path.exists() or not path.read_text().strip():
        return None
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a killed writer
            continue
    return events


_RANK = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}  # a later phase never hides a worse outcome


def _fold(events: list[dict]) -> tuple[list[str], set[str], dict[str, dict]]:
    """(collected, started, reported) from the events: reported maps a node id to the outcome its phases gave (a
    failed call is failed, a failed setup or teardown an error, a skip skipped) once its call phase reported, or its
    setup failed or skipped (no call phase then)."""
    collected: list[str] = []
    started: set[str] = set()
    reported: dict[str, dict] = {}
    for ev in events:
        nodeid = ev.get("nodeid", "")
        if ev["event"] == "collected":
            collected.append(nodeid)
        elif ev["event"] == "start":
            started.add(nodeid)
        elif ev["event"] == "report":
            when, outcome = ev.get("when"), ev.get("outcome")
            name = "failed" if outcome == "failed" and when == "call" else "error" if outcome == "failed" else outcome
            prev = reported.get(nodeid)
            if prev is None and when != "call" and outcome == "passed":
                continue  # a passed setup or teardown alone says nothing of the test
            if prev is None or _RANK.get(name, 0) > _RANK.get(prev["outcome"], 0):
                reported[nodeid] = dict(outcome=name, seconds=ev.get("seconds", ""), message=ev.get("message", ""))
    return list(dict.fromkeys(collected)), started, reported


def rows(
    xml_path: str | Path | None, progress_path: str | Path | None = None, events: list | None = None
) -> list[dict]:
    """The table from the XML and the progress file (or its `events`, as the plugin streams them). The XML's cases
    keep their messages; a test the XML lacks (it was never written: pytest killed) takes the outcome its progress
    reported, so a failed test stays failed; a test that started and never reported is interrupted, one that never
    started is not run."""
    cases = _xml_cases(Path(xml_path)) if xml_path else {}
    if events is None:
        events = _events(Path(progress_path) if progress_path else None)
    extra: list[dict] = []
    if events is None:
        extra.append(
            dict(
                outcome="progress unknown",
                test="",
                message="no progress file: interrupted tests count as "
                "passed and tests that never started are not counted",
            )
        )
    else:
        collected, started, reported = _fold(events)
        for nodeid in collected:
            name = _junit_name(nodeid)
            if nodeid in reported:
                cases.setdefault(name, dict(test=name, **reported[nodeid]))
            elif nodeid in started:
                cases[name] = dict(test=name, outcome="interrupted", seconds="", message="stopped before it reported")
            else:
                cases[name] = dict(test=name, outcome="not run", seconds="", message="never started")
    counts = Counter(c["outcome"] for c in cases.values())
    out = [dict(outcome=k, count=v) for k, v in sorted(counts.items())]
    return out + extra + [c for c in cases.values() if c["outcome"] != "passed"]


def write(path: str | Path, table: list[dict]) -> None:
    """The CSV, replaced whole (a reader, or a call killed mid-write, sees the previous table or this one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(table)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: junit_table.py IN.xml OUT.csv [PROGRESS.jsonl]", file=sys.stderr)
        return 2
    table = rows(argv[0], argv[2] if len(argv) == 3 else None)
    write(argv[1], table)
    print(f"{len(table)} rows written to {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
