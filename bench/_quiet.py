"""Silencing native (C++) output around a noisy call: torch.profiler's kineto prints "profiler_start/stop" lines and
c10 warns "Memory block of unknown size was allocated before the profiling started" on every CPU peak-memory reading,
straight to the process's file descriptors 1 and 2, where Python's warnings filters and sys.stdout cannot reach.

What this is not: a logging setup, nor Python's warnings (a smoke run drops those: bench/_common.py run_bench).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def native_output_captured():
    """File descriptors 1 and 2 go to a temporary file inside the block: dropped when the block ends normally, written
    to stderr when it raises (so that an error's native message is never lost). Python's own streams are flushed
    first, so nothing printed before the block is caught."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:  # no file descriptors to redirect (an embedded interpreter): run as is
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if failed:
                sink.seek(0)
                sys.stderr.write(sink.read().decode(errors="replace"))
