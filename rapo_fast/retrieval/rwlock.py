"""A reader-writer lock for the step buffer: many concurrent readers (searches, which release the GIL inside the
compiled backend and so really run in parallel), one exclusive writer (add), writers preferred so that a stream of
searches cannot starve an add.

What this is not: re-entrant (a thread holding the read side must not take either side again) or a process lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ReadWriteLock"]


class ReadWriteLock:
    """`with lock.read():` shares the lock with other readers; `with lock.write():` waits for every reader to leave and
    holds it alone. A waiting writer blocks new readers (writer preference)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
