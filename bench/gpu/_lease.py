"""The lease arithmetic of the two GPU calls: each call's deadline from the time it actually starts, and the model the
dry run prints (what each call runs for a given machine start).

A call is given the time it was asked for (`--asked-at`, Unix seconds on the driving machine, taken just before the
device tool's `run`) and the device time left then (`--lease-left`, `status`'s budget_left_s). At its start it reads
the clock: the machine's start and the tree's transfer took `now - asked_at`, the lease ends `lease_left` after the
ask, and the call's deadline is what is left less the transfer of its files back. Call 1 also keeps back what call 2
needs (the idle wait, a start as long as its own, the transfers and call 2's first steps), but never goes below its
own graded steps. What this is not: the runner (_stage.py) nor the device tool's accounting (`status` is the truth).
"""

from __future__ import annotations

from dataclasses import dataclass

from _stage import CALL_BUDGET_S, GRACE_S, Step
from _steps import EXT_CARRIED_S

LEASE_S = 900  # a drawn task's device time: starts, idle waits, transfers and closes included (device README)
OUT_S = 15  # the working tree out (.carry included, well under 64 MiB): estimate, not measured
BACK_S = 15  # a call's files back (at most 8, a few MB with the .so): estimate, not measured
IDLE_S = 30  # a machine stays warm 30 s after a call, counted against the lease (device README, "warm after a call")
STARTS_S = (60, 120, 180, 240)  # the machine starts the dry run models ("a minute or more"; 2-4 minutes seen)


@dataclass(frozen=True)
class Keep:
    """What a call keeps back of the lease for the call after it: `next_s`, the next call's first steps (budgets and
    grace, from its start); `own_s`, this call's floor (its graded steps), kept even at the next call's expense."""

    next_s: int
    own_s: int


def first_s(steps: list[Step], through: str) -> int:
    """The budgets of `steps` up to and including the step named `through`, plus the last one's grace."""
    names = [s.name for s in steps]
    return sum(s.budget_s for s in steps[: names.index(through) + 1]) + GRACE_S


def as_carried(steps: list[Step]) -> list[Step]:
    """Call 2's steps as the procedure runs them: with call 1's .so carried (the extension step's budget then is
    EXT_CARRIED_S whatever this checkout holds now)."""
    return [
        Step(s.name, s.cmd, EXT_CARRIED_S, s.files, s.required, s.plan) if s.name == "extension" else s for s in steps
    ]


def deadline(lease_left_s: float, start_s: float, cap_s: int = CALL_BUDGET_S, keep: Keep | None = None) -> int:
    """Seconds from the call's start until it must end: the lease left at the ask, less the `start_s` the start
    took and the files' way back; with `keep`, less what the next call needs (an idle wait, a start as long as this
    one's, its transfers and first steps), but not below `keep.own_s`; never above `cap_s` nor below 0."""
    left = lease_left_s - start_s - BACK_S
    if keep is not None:
        reserve = IDLE_S + start_s + BACK_S + keep.next_s
        left = max(left - reserve, min(left, keep.own_s))
    return int(max(0, min(cap_s, left)))


def fits(steps: list[Step], deadline_s: float) -> list[tuple[Step, bool]]:
    """The runner's deadline rule applied to budgets (each step taking all of its budget: the worst case): a step
    starts only when its budget and the grace end before the deadline; a skipped step takes no time."""
    used, out = 0.0, []
    for s in steps:
        ok = used + s.budget_s + GRACE_S <= deadline_s
        used += s.budget_s if ok else 0
        out.append((s, ok))
    return out


@dataclass(frozen=True)
class Call:
    """One call in the model: asked at device time `asked`, its deadline, the steps it runs, and when it ends (its
    files back), all in seconds of device time."""

    asked: int
    deadline: int
    ran: list[tuple[Step, bool]]
    end: int

    @property
    def used(self) -> int:
        return sum(s.budget_s for s, ok in self.ran if ok)


def model(steps1: list[Step], steps2: list[Step], keep: Keep, start_s: int, lease_s: int = LEASE_S) -> tuple:
    """(call 1, call 2) in the worst case, each machine starting cold in `start_s` (then the tree's transfer): call 1
    asked at 0; call 2 asked after call 1's files are back and the 30-s idle wait (the machine then went back: a
    cold start again). Device time only: the time between a give-back and the next ask costs nothing."""
    s = start_s + OUT_S
    d1 = deadline(lease_s, s, keep=keep)
    ran1 = fits(steps1, d1)
    end1 = s + sum(st.budget_s for st, ok in ran1 if ok) + BACK_S
    c1 = Call(0, d1, ran1, end1)
    asked2 = end1 + IDLE_S
    d2 = deadline(lease_s - asked2, s)
    ran2 = fits(steps2, d2)
    c2 = Call(asked2, d2, ran2, asked2 + s + sum(st.budget_s for st, ok in ran2 if ok) + BACK_S)
    return c1, c2
