"""Shared hypothesis pieces of the property tests (tests/fuzz/): the example budget and small strategies.

Budget: `fuzz_settings(n)` runs n examples in the default run (keep n a few dozen: CI runs tests/fuzz under
TRITON_INTERPRET=1 in about two minutes) and at least 1,000 under the `thorough` profile (tests/conftest.py: set
HYPOTHESIS_PROFILE=thorough, or run `pytest -m slow tests/fuzz`). Not a test file; op-specific builders stay beside
their tests (tests/helpers/loss_cases.py, retrieval_cases.py).
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

THOROUGH_EXAMPLES = 1000
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Values that are not finite numbers; each must be refused wherever a finite number is expected.
NON_FINITE = (math.nan, math.inf, -math.inf)


def fuzz_settings(n: int, **kw) -> settings:
    """n examples, or the thorough profile's count (>= THOROUGH_EXAMPLES) when that profile is loaded."""
    budget = settings.default.max_examples
    examples = budget if budget >= THOROUGH_EXAMPLES else n
    suppress = [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,  # fixtures of the fuzz tests (capsys, a process group) are stateless
    ]
    return settings(max_examples=examples, deadline=None, suppress_health_check=suppress, **kw)


seeds = st.integers(0, 2**31 - 1)
float_dtypes = st.sampled_from(FLOAT_DTYPES)


@st.composite
def finite_tensors(draw, shape, *, scale: float | None = None, dtype=torch.float32) -> torch.Tensor:
    """A random finite tensor of `shape` (seeded normal times a drawn scale; values exact in `dtype`)."""
    g = torch.Generator().manual_seed(draw(seeds))
    s = scale if scale is not None else draw(st.sampled_from([1e-3, 0.1, 1.0, 10.0]))
    return (torch.randn(shape, generator=g) * s).to(dtype)


def not_a_number_like():
    """Values that are not a usable number: None, bool, str, NaN/inf, a list."""
    return st.sampled_from([None, True, "1", [1.0], *NON_FINITE])
