"""Fixtures of tests/reliability: torch's global RNG restored after each test (the savers' cases move it), and `work`,
a scratch directory on tmpfs when there is one. Not a place for the save formats' cases (reliability_states.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_global_rng():
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


@pytest.fixture
def work(tmp_path):
    """Where the saves go: tmpfs when there is one. A SIGKILL or an exception loses nothing of the page cache, so what
    these tests check does not depend on the disk; on tmpfs the saves' fsyncs (which guard against power loss) cost
    nothing."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="rapo_fast_fault_", dir=shm))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
