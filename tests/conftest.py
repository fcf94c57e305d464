"""Shared pytest setup: the Triton interpreter on machines without a GPU, the gpu marker, a seeded RNG per test.

Not a place for test helpers of one op (those live beside the op's tests); cross-op helpers: tests/helpers/.
"""

import os

import pytest
import torch

# The interpreter must be chosen before any @triton.jit function is defined; without a GPU the kernels can only run
# there, and that is how CI exercises them (docs/interpreter.md).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
