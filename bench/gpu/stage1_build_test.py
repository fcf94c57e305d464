"""GPU stage 1: build rapo_fast._C for sm_90a (or reuse a carried build) and run `pytest -m gpu` (junit XML and a
CSV of the outcomes); the built .so comes back in the output folder so the later stages can carry it.

Usage: `python bench/gpu/stage1_build_test.py --out DIR | --dry-run | --cpu-smoke DIR | --record DIR`
(README.md, "GPU validation"). What this is not: the CPU test suite (CI runs that) nor a benchmark.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402

PYTEST = "{py} -m pytest -m gpu -q -p no:cacheprovider -rfEs --junitxml={out}/pytest_gpu.xml"
JUNIT = Step(
    "outcomes", "{py} {here}/junit_table.py {out}/pytest_gpu.xml {out}/pytest_gpu.csv", 15, ("pytest_gpu.csv",)
)

STAGE = Stage(
    name="stage1_build_test",
    title="build the extension for sm_90a and run pytest -m gpu",
    gpu_steps=[
        _steps.env("trl,liger,datasets"),
        _steps.WHEELS_GPU,
        _steps.extension(copy_out=True),
        Step("pytest_gpu", PYTEST + " tests", 260, ("pytest_gpu.xml",)),
        JUNIT,
    ],
    # On the CPU every gpu test skips; one light module keeps the run short while the junit -> CSV path is exercised.
    smoke_steps=[
        _steps.env("liger", smoke=True),
        _steps.WHEELS_SMOKE,
        _steps.EXT_SMOKE,
        Step("pytest_gpu", PYTEST + " tests/retrieval/test_retrieval_gpu.py", 150, ("pytest_gpu.xml",)),
        JUNIT,
    ],
    table={"pytest_gpu.csv": ["outcome", "count", "test", "seconds", "message"]},
    record={"pytest_gpu.csv": "pytest_gpu"},
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
