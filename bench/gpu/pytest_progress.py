"""A pytest plugin for the GPU call's test step: it writes, as they happen, which tests were collected, which started
and how each phase ended, one line per event, to the file named by RAPO_FAST_PYTEST_PROGRESS.

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

import pytest

ENV = "RAPO_FAST_PYTEST_PROGRESS"


def _write(config, event: str, nodeid: str, **extra) -> None:
    path = os.environ.get(ENV)
    if not path or hasattr(config, "workerinput"):  # xdist workers: the controller writes their events
        return
    with open(path, "a") as f:  # one short line per event, flushed on close: a SIGKILL loses at most the last
        f.write(json.dumps(dict(event=event, nodeid=nodeid, **extra)) + "\n")


_CONFIG = None


def pytest_configure(config) -> None:
    global _CONFIG
    _CONFIG = config


def pytest_collection_finish(session) -> None:  # without xdist
    for item in session.items:
        _write(session.config, "collected", item.nodeid)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is absent
def pytest_xdist_node_collection_finished(node, ids) -> None:  # with xdist: every worker collects the same ids
    if getattr(_CONFIG, "_rapo_progress_collected", False):
        return
    _CONFIG._rapo_progress_collected = True
    for nodeid in ids:
        _write(_CONFIG, "collected", nodeid)


def pytest_runtest_logstart(nodeid, location) -> None:
    _write(_CONFIG, "start", nodeid)


def pytest_runtest_logreport(report) -> None:
    _write(_CONFIG, "report", report.nodeid, when=report.when, outcome=report.outcome)
