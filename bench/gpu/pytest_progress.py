"""A pytest plugin for the GPU call's test step: it writes, as they happen, which tests were collected, which started
and how each phase ended, one line per event, to the file named by RAPO_FAST_PYTEST_PROGRESS; and, when
RAPO_FAST_PYTEST_TABLE names a CSV (the call's pytest_gpu.csv, in the folder the device tool brings back), it rewrites
that table (bench/gpu/junit_table.py, without the XML) each time a test ends, so that a call killed during its test
step still brings back every outcome reported so far, a failed test as failed.

Why: a test step stopped at its budget leaves a junit XML that lists only the tests that reported, and lists the test
in flight as passed (its setup passed; the KeyboardInterrupt in its call phase reports nothing). From this file
bench/gpu/junit_table.py tells that test apart as interrupted and counts the tests that never started. It runs in
pytest's main process only (with xdist, the controller: it sees the workers' collections, starts and reports).
Loaded with `-p pytest_progress` (bench/gpu on PYTHONPATH). What this is not: a reporter of results (the junit XML
holds the messages) nor anything a test needs.
"""

from __future__ import annotations

import json
import os

import junit_table
import pytest

ENV = "RAPO_FAST_PYTEST_PROGRESS"
TABLE_ENV = "RAPO_FAST_PYTEST_TABLE"
_EVENTS: list[dict] = []  # what the table is made of, kept here: no re-reading of the progress file per test


def _write(config, event: str, nodeid: str, **extra) -> None:
    if hasattr(config, "workerinput"):  # xdist workers: the controller writes their events
        return
    ev = dict(event=event, nodeid=nodeid, **extra)
    _EVENTS.append(ev)
    path = os.environ.get(ENV)
    if path:
        with open(path, "a") as f:  # one short line per event, flushed on close: a SIGKILL loses at most the last
            f.write(json.dumps(ev) + "\n")


def _table() -> None:
    """The table so far into RAPO_FAST_PYTEST_TABLE (replaced whole), when it is set."""
    path = os.environ.get(TABLE_ENV)
    if path and not hasattr(_CONFIG, "workerinput"):
        junit_table.write(path, junit_table.rows(None, events=_EVENTS))


_CONFIG = None


def pytest_configure(config) -> None:
    global _CONFIG
    _CONFIG = config


def pytest_collection_finish(session) -> None:  # without xdist
    for item in session.items:
        _write(session.config, "collected", item.nodeid)
    _table()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is absent
def pytest_xdist_node_collection_finished(node, ids) -> None:  # with xdist: every worker collects the same ids
    if getattr(_CONFIG, "_rapo_progress_collected", False):
        return
    _CONFIG._rapo_progress_collected = True
    for nodeid in ids:
        _write(_CONFIG, "collected", nodeid)
    _table()


def pytest_runtest_logstart(nodeid, location) -> None:
    _write(_CONFIG, "start", nodeid)


def _message(longrepr) -> str:
    """The table's message, as the junit XML's would read: the exception's line (the assertion), or a skip's reason."""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        text = crash.message
    elif isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2])
    else:
        text = str(longrepr or "")
    return " ".join(text.split())[:160]


def pytest_runtest_logreport(report) -> None:
    extra = dict(when=report.when, outcome=report.outcome)
    if report.outcome != "passed":
        extra["message"] = _message(report.longrepr)
    if report.when == "call":
        extra["seconds"] = f"{report.duration:.3f}"
    _write(_CONFIG, "report", report.nodeid, **extra)
    if report.when == "call" or report.outcome != "passed":  # the test's outcome is known: the table follows
        _table()


def pytest_sessionfinish(session) -> None:
    _table()
