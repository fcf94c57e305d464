"""GPU call 1 of 2: build rapo_fast._C for sm_90a, the headline loss rows, `pytest -m gpu`, then the rest of the loss
and token log-prob rows (the anchors that compile, torch.compile, V=32k). The built .so comes back in the output so
that call 2 carries it instead of building again.

Order (docs/perf.md, "The GPU run: two calls"): the headline rows first (ours vs eager and torch's chunked op at
N=16k, H=4096, V=152k), then correctness, then what compiles for a long time, each in its own step so that a timeout
there loses that step's unfinished rows only.
Usage: `python bench/gpu/call1_build_test_loss.py --out DIR | --dry-run | --cpu-smoke DIR | --record DIR`.
What this is not: the CPU test suite (CI runs that) nor the benches themselves (bench/bench_*.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402

# pytest-xdist (in the GPU image) runs test files on 4 processes: most of the step is Triton compiling, on the CPU.
# A file stays on one process (--dist loadfile), so a file's large-memory tests never overlap each other.
PYTEST = (
    'XD=$({py} -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile"); '
    "{py} -m pytest -m gpu -q -p no:cacheprovider -rfEs --junitxml={out}/pytest_gpu.xml $XD "
)
JUNIT = Step(
    "outcomes", "{py} {here}/junit_table.py {out}/pytest_gpu.xml {out}/pytest_gpu.csv", 10, ("pytest_gpu.csv",)
)
PYTEST_ROWS = ("pytest_gpu.csv: one row per outcome with its count, then one per gpu test that did not pass",)
V152K, V32K = "--shape 16384,4096,152064", "--shape 16384,4096,32768"
HEADLINE = "rapo_fast_hidden,rapo_fast_logits,torch_eager,torch_linear_ce"
VARIANTS = "rapo_fast_hidden_2pass,rapo_fast_logits_lmhead,rapo_fast_logits_lmhead_inplace"
# ours first: the eager references at V=152k take ~1 s a call (fp32 [N, V] logits), the last to lose to a timeout
LOGP = "rapo_fast_logits,rapo_fast_hidden,torch_chunked_hidden,cce,torch_eager_logits,torch_eager_hidden"
SMOKE_LOSS = f"{HEADLINE},{VARIANTS},liger,cce"  # no torch_compile on the CPU: minutes of C++ compilation

STAGE = Stage(
    name="call1_build_test_loss",
    title="build for sm_90a; headline loss rows; pytest -m gpu; loss and log-prob anchors",
    gpu_steps=[
        _steps.WHEELS_GPU,
        _steps.env("trl,liger,cce,datasets"),
        _steps.extension(build=True),
        _steps.bench(
            "loss_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers {HEADLINE}", 60, "loss.csv"
        ),
        Step("pytest_gpu", PYTEST + "tests", 115, ("pytest_gpu.xml",), plan=PYTEST_ROWS),
        JUNIT,
        _steps.bench(
            "variants_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers {VARIANTS}", 40, "loss.csv"
        ),
        _steps.bench(
            "anchors_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers liger,cce", 45, "loss.csv"
        ),
        _steps.bench(
            "compile_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers torch_compile", 40, "loss.csv"
        ),
        _steps.bench(
            "logprobs",
            "bench_token_logprobs.py",
            f"--gpu {V152K} {V32K} --rep-ms 100 --providers {LOGP}",
            40,
            "token_logprobs.csv",
        ),
        _steps.bench("loss_v32k", "bench_loss.py", f"--gpu {V32K} --rep-ms 100 --providers {HEADLINE}", 30, "loss.csv"),
    ],
    # On the CPU every gpu test skips; one light module keeps the run short while the junit -> CSV path is exercised.
    smoke_steps=[
        _steps.WHEELS_SMOKE,
        _steps.env("liger,cce", smoke=True),
        _steps.EXT_SMOKE,
        _steps.bench(
            "loss", "bench_loss.py", f"--shape 64,32,100 --rep-ms 5 --providers {SMOKE_LOSS}", 120, "loss.csv"
        ),
        Step("pytest_gpu", PYTEST + "tests/retrieval/test_retrieval_gpu.py", 90, ("pytest_gpu.xml",), plan=PYTEST_ROWS),
        JUNIT,
        _steps.bench(
            "logprobs", "bench_token_logprobs.py", "--quick --shape 64,32,500 --rep-ms 5", 120, "token_logprobs.csv"
        ),
    ],
    table={
        "pytest_gpu.csv": ["outcome", "count", "test", "seconds", "message"],
        "loss.csv": ["provider", "N", "V", "median_ms", "peak_mem_mb", "pct_of_copy_bw", "status"],
        "token_logprobs.csv": ["provider", "mode", "N", "V", "median_ms", "peak_mem_mb", "pct_of_copy_bw", "status"],
    },
    record={"pytest_gpu.csv": "pytest_gpu", "loss.csv": "loss_gpu", "token_logprobs.csv": "token_logprobs_gpu"},
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
