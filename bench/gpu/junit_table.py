"""Turn pytest's junit XML into a short CSV: one row per outcome with its count, then one row per test that did not
pass (failed, error, skipped) with its message, so the stage's table shows what matters on one screen.

Usage: `python bench/gpu/junit_table.py IN.xml OUT.csv`. What this is not: a test report renderer (the XML and the
stage log hold the full output).
"""

from __future__ import annotations

import csv
import sys
import xml.etree.ElementTree as ET
from collections import Counter


def rows(xml_path: str) -> list[dict]:
    cases = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, message = tag, (el.get("message") or "").replace("\n", " ")[:160]
                break
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name', '')}"
        cases.append(dict(test=name, outcome=outcome, seconds=case.get("time", ""), message=message))
    counts = Counter(c["outcome"] for c in cases)
    out = [dict(outcome=k, count=v) for k, v in sorted(counts.items())]
    return out + [c for c in cases if c["outcome"] != "passed"]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: junit_table.py IN.xml OUT.csv", file=sys.stderr)
        return 2
    table = rows(argv[0])
    with open(argv[1], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["outcome", "count", "test", "seconds", "message"])
        w.writeheader()
        w.writerows(table)
    print(f"{len(table)} rows written to {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
