"""Progress display: a tqdm bar on a terminal, plain progress lines when stderr is not one (a redirected log).

What it is: `progress_bar(total, desc)`, an object with tqdm's update / set_postfix / close, used by the trainer and
the SFT warm-up. Off a terminal, tqdm's carriage-return redraws pile up in the log file (77 KB for one demo run);
there `PlainProgress` prints about `lines` whole lines per run instead. What it is not: a logger or a timer.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["PlainProgress", "progress_bar"]


class PlainProgress:
    """tqdm's update / set_postfix / close, printing `desc: n/total (elapsed) fields` every total/lines updates
    (lines=0: silent)."""

    def __init__(self, total: int, desc: str, stream: TextIO | None = None, lines: int = 10) -> None:
        self.total, self.desc, self.n = int(total), desc, 0
        self.stream = stream if stream is not None else sys.stderr
        self.lines, self.every = lines, max(1, -(-self.total // max(1, lines)))
        self.postfix: dict[str, Any] = {}
        self.t0 = time.perf_counter()

    def set_postfix(self, fields: dict[str, Any]) -> None:
        self.postfix = dict(fields)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.lines > 0 and (self.n % self.every == 0 or self.n == self.total):
            fields = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            line = f"{self.desc}: {self.n}/{self.total} ({time.perf_counter() - self.t0:.0f} s) {fields}"
            print(line.rstrip(), file=self.stream, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar when stderr is a terminal, else a PlainProgress on stderr."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        tty = False
    if tty:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, leave=False)
    return PlainProgress(total, desc)
