"""Shared pytest setup: the Triton interpreter on machines without a GPU, the gpu marker, a seeded RNG per test, the
hypothesis profiles of the property tests (tests/fuzz/: the default run small, `thorough` >= 1,000 examples each).

Not a place for test helpers of one op (those live beside the op's tests); cross-op helpers: tests/helpers/.
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

# The interpreter must be chosen before any @triton.jit function is defined; without a GPU the kernels can only run
# there, and that is how CI exercises them (docs/interpreter.md).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A fresh inductor cache per run (xdist's workers inherit it): torch's FX graph cache keys do not cover a custom op's
# output shapes, so graphs an earlier checkout's rapo_fast ops compiled (a reused machine's /tmp/torchinductor_*) would
# be replayed against changed ops (docs/pitfalls.md). Here, not in CI's environment: the README's command needs it too.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache = tempfile.mkdtemp(prefix="rapo_fast_inductor_")
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)


# `thorough`: the slow property run of tests/fuzz (HYPOTHESIS_PROFILE=thorough, or `-m slow`, which also selects
# those tests); tests/helpers/strategies.py gives each fuzz test that many examples, the default run a few dozen.
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def _thorough(config) -> bool:
    return os.environ.get("HYPOTHESIS_PROFILE") == "thorough" or (config.option.markexpr or "").strip() == "slow"


def pytest_configure(config):
    if _thorough(config):
        settings.load_profile("thorough")


@pytest.hookimpl(tryfirst=True)  # before the -m selection, which must see the slow marks added here
def pytest_collection_modifyitems(config, items):
    thorough = _thorough(config)
    for item in items:
        if "tests/fuzz/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.fuzz)
            if thorough:
                item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        # The GPU call's processes take a file's gpu tests together (gpu_spread ones apart) by its own xdist scheduler,
        # bench/gpu/pytest_gpu_scope.py: xdist_group markers added here do nothing on pytest >= 9.2 with xdist 3.8.
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
