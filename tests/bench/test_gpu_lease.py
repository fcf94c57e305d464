"""Tests of the GPU calls' lease arithmetic (bench/gpu/_lease.py) on the CPU: each call takes its deadline from the
time it actually starts, call 1 keeps back what call 2 needs without giving up its graded rows, and the modelled
yield: with 3-minute machine starts call 2 runs past its build check and both calls end inside the 15-minute lease.

What this is not: a test of the runner's steps (tests/bench/test_gpu_stages.py) nor of the device tool.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"


@pytest.fixture(scope="module")
def gpu():
    """bench/gpu's modules (not a package: imported from its folder)."""
    sys.path.insert(0, str(GPU))
    try:
        import _lease
        import _stage
        import call1_headline
        import call2_anchors

        yield dict(lease=_lease, stage=_stage, call1=call1_headline.STAGE, call2=call2_anchors.STAGE)
    finally:
        sys.path.remove(str(GPU))


def _names(ran) -> list[str]:
    return [s.name for s, ok in ran if ok]


def test_three_minute_starts_call2_runs_past_its_build_and_ends_inside_the_lease(gpu):
    lease = gpu["lease"]
    steps2 = lease.as_carried(gpu["call2"].gpu_steps)
    c1, c2 = lease.model(gpu["call1"].gpu_steps, steps2, gpu["call1"].keep, start_s=180)
    ran2 = _names(c2.ran)
    assert ran2[:2] == ["wheels", "extension"] and len(ran2) > 2, ran2  # at least one step after the build check
    start = 180 + lease.OUT_S
    assert c2.asked + start + c2.deadline + lease.BACK_S <= lease.LEASE_S, c2  # its deadline ends inside the lease
    assert c2.end <= lease.LEASE_S and c1.end < c2.asked
    assert {"loss_v152k", "logprobs_v152k", "paper_170k", "kv_splice"} <= set(_names(c1.ran)), c1.ran


@pytest.mark.parametrize("start", [60, 120, 180, 240])
def test_every_modelled_start_keeps_call1_graded_rows_inside_the_lease(gpu, start):
    lease = gpu["lease"]
    c1, c2 = lease.model(gpu["call1"].gpu_steps, lease.as_carried(gpu["call2"].gpu_steps), gpu["call1"].keep, start)
    assert "kv_splice" in _names(c1.ran) and c1.deadline <= gpu["stage"].CALL_BUDGET_S
    assert c2.end <= lease.LEASE_S, (start, c1, c2)


def test_the_deadline_follows_the_actual_start(gpu):
    lease = gpu["lease"]
    keep = lease.Keep(next_s=140, own_s=310)
    # The later the call starts, the shorter its deadline; call 1 gives call 2 a start as long as its own.
    assert lease.deadline(600, 75) > lease.deadline(600, 195) == 600 - 195 - lease.BACK_S
    short, long_ = lease.deadline(800, 75, keep=keep), lease.deadline(800, 135, keep=keep)
    assert short - long_ == 2 * 60 and long_ == 800 - 135 - lease.BACK_S - (lease.IDLE_S + 135 + lease.BACK_S + 140)
    assert lease.deadline(900, 255, keep=keep) == 310  # never below call 1's own graded steps
    assert lease.deadline(300, 255, keep=keep) == 300 - 255 - lease.BACK_S  # nor beyond the lease itself
    assert lease.deadline(900, 5) == 540 and lease.deadline(100, 200) == 0  # the call's cap; nothing left


def test_a_call_reads_its_deadline_at_its_start(gpu, tmp_path):
    """`--asked-at` 100 s ago with 140 s of lease left then: 140 - 100 - the files' way back is left; a step that
    cannot end before it is skipped, one that can still runs, and the summary says where the deadline came from."""
    st = gpu["stage"]
    smoke = [st.Step("short", "echo ran > {out}/short.txt", 5, ("short.txt",)), st.Step("long", "sleep 60", 60, ())]
    stage = st.Stage("leased", "a deadline from the lease", [], smoke, {})
    argv = ["--cpu-smoke", str(tmp_path / "out"), "--asked-at", str(time.time() - 100), "--lease-left", "140"]
    assert st.main(stage, argv) == 1  # one step skipped
    summary = (tmp_path / "out" / "leased_summary.txt").read_text()
    expected = 140 - 100 - gpu["lease"].BACK_S
    found = int(re.search(r"deadline: (\d+) s from the start", summary).group(1))
    assert expected - 2 <= found <= expected, summary
    assert re.search(r"lease: 140 s left when asked at \d+; started 10\d s after", summary), summary
    assert re.search(r"step short\s+ok", summary) and re.search(r"step long\s+SKIPPED", summary), summary
    with pytest.raises(SystemExit):  # the two go together
        st.main(stage, ["--cpu-smoke", str(tmp_path / "o2"), "--lease-left", "140"])
