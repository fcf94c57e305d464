"""The experiment's tests' setup, as tests/conftest.py gives the library's: the Triton interpreter on machines without
a GPU (chosen before any kernel is defined) and a seeded torch RNG per test. Not a place for test helpers."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
