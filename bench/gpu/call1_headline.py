"""GPU call 1 of 2: build rapo_fast._C for sm_90a, then the graded headline rows of every path (the loss at N=16k,
H=4096, V=152k; token log-probs at the same shape; retrieval at the paper's scale; the KV splice at a 7B model's
shape; retrieval over 4M keys), then `pytest -m gpu`. Alone it grades every path; call 2 adds the anchors that compile
for long, the sanitizers and the trainer. The built .so comes back in the output so that call 2 carries it.

Order (docs/perf.md, "The GPU run: two calls"): by value, so that a deadline or a timeout loses the least. Each step is
its own process, so a timeout there loses that step's unfinished rows only. Usage: `python bench/gpu/call1_headline.py
--out DIR [--asked-at T --lease-left S] [--deadline-s S] | --dry-run | --cpu-smoke DIR | --record DIR`. What this is
not: the CPU test suite (CI runs that) nor the benches themselves (bench/bench_*.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
import call2_anchors  # noqa: E402
from _lease import Keep, as_carried, first_s  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402


# pytest-xdist (in the GPU image) on 8 of the 16 cores: most of the step is Triton compiling, on the CPU. Its scheduler
# here (bench/gpu/pytest_gpu_scope.py, --dist loadscope) keeps each gpu test file on one process (a file's
# large-memory tests never overlap each other), except the tests marked gpu_spread (many compiles, little memory),
# spread over all; it reads node ids only, so it holds on any pytest (xdist_group markers do not on 9.2).
# The junit XML and the progress file stay in {tmp}; the table (pytest_gpu.csv) is what comes back: the progress
# plugin rewrites it in {out} as each test ends (a call killed mid-step keeps it), then the outcomes step redoes it with
# the XML's messages.
def _pytest(workers: int, paths: str) -> str:
    return (
        f'XD=$({{py}} -c "import xdist" 2>/dev/null && echo "-n {workers} --dist loadscope -p pytest_gpu_scope"); '
        "PYTHONPATH={here}:$PYTHONPATH RAPO_FAST_PYTEST_PROGRESS={tmp}/pytest_progress.jsonl "
        "RAPO_FAST_PYTEST_TABLE={out}/pytest_gpu.csv "
        "{py} -m pytest -m gpu -q -p no:cacheprovider -p pytest_progress -rfEs --junitxml={tmp}/pytest_gpu.xml $XD "
        + paths
    )


JUNIT = Step(
    "outcomes",
    "{py} {here}/junit_table.py {tmp}/pytest_gpu.xml {out}/pytest_gpu.csv {tmp}/pytest_progress.jsonl",
    5,  # no torch import, a few hundred XML cases: < 1 s measured on the development machine
    ("pytest_gpu.csv",),
)
PYTEST_ROWS = ("pytest_gpu.csv: one row per outcome with its count, then one per gpu test that did not pass",)
V152K = "--shape 16384,4096,152064"
HEADLINE = "rapo_fast_hidden,rapo_fast_logits,torch_eager,torch_linear_ce"
LOGP_HEADLINE = "rapo_fast_logits,rapo_fast_hidden,torch_chunked_hidden"  # ours and torch's chunked anchor
RET = "--gpu --rep-ms 100"
SMOKE_LOSS = f"{HEADLINE},rapo_fast_hidden_2pass,rapo_fast_logits_lmhead,rapo_fast_logits_lmhead_inplace,liger,cce"

TABLE, RECORD = _steps.tables("pytest_gpu.csv", "loss.csv", "token_logprobs.csv", "retrieval_gpu.csv", "kv_splice.csv")

STAGE = Stage(
    name="call1_headline",
    title="build for sm_90a; the headline rows of loss, log-probs, retrieval and splice; pytest -m gpu",
    # GPU budgets: estimates, not measured (no step has run on a GPU yet); docs/perf.md, "The GPU run: two calls",
    # gives each one's reasoning, and the first run's log ("===== step: ok in N s") replaces them.
    gpu_steps=[
        _steps.WHEELS_GPU,
        _steps.env("trl,liger,cce,datasets"),
        _steps.extension(copy_back=True),
        _steps.bench(
            "loss_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers {HEADLINE}", 50, "loss.csv"
        ),  # Triton's cold compiles 10-20 s + eager ~10 s + the chunked reference ~2 s: estimate, not measured
        _steps.bench(
            "logprobs_v152k",
            "bench_token_logprobs.py",
            f"--gpu {V152K} --rep-ms 100 --providers {LOGP_HEADLINE}",
            30,  # the log-prob kernels' cold compiles 5-10 s + the timed calls: estimate, not measured
            "token_logprobs.csv",
        ),
        _steps.bench(
            "paper_170k",
            "bench_retrieval.py",
            f"{RET} --shape 170000,384,256,1 --shape 170000,384,256,3",
            40,  # one Triton compile per k + sub-ms calls: estimate, not measured
            "retrieval_gpu.csv",
        ),
        # splice, plain torch (~24 ms a call), re-prefill (~0.8 s a call) and the copy floor: estimate, not measured
        _steps.bench("kv_splice", "bench_kv_splice.py", "--gpu", 45, "kv_splice.csv"),
        _steps.bench(
            "c4m",
            "bench_retrieval.py",
            f"{RET} --shape 4000000,768,64,64 --shape 4000000,768,4096,64",
            70,  # 6 GB of keys made on the device; torch's anchor ~160 ms a call at Q=4096: estimate, not measured
            "retrieval_gpu.csv",
        ),
        # ~280 gpu tests, mostly Triton compiling on the CPU, over 8 processes: estimate, not measured
        Step("pytest_gpu", _pytest(8, "tests"), 105, ("pytest_gpu.csv",), plan=PYTEST_ROWS),
        JUNIT,
    ],
    # Smoke budgets are generous (a loaded 2-core CI machine, no lease to fit). On the CPU every gpu test skips; one
    # light module keeps the run short while the junit -> CSV path is exercised.
    # The CPU run of bench_retrieval writes retrieval_cpu.csv; renamed so the table is the GPU run's. Its rows name
    # the CPU as their device, and --record refuses a smoke run's folder.
    smoke_steps=[
        _steps.WHEELS_SMOKE,
        _steps.env("liger,cce", smoke=True),
        _steps.EXT_SMOKE,
        _steps.bench(
            "loss", "bench_loss.py", f"--shape 64,32,100 --rep-ms 5 --providers {SMOKE_LOSS}", 180, "loss.csv"
        ),
        _steps.bench(
            "logprobs", "bench_token_logprobs.py", "--quick --shape 64,32,500 --rep-ms 5", 150, "token_logprobs.csv"
        ),
        Step(
            "tiny_retrieval",
            "{py} bench/bench_retrieval.py --out {out} --no-plot --repeats 1 --shape 5000,48,7,3 "
            "&& mv {out}/retrieval_cpu.csv {out}/retrieval_gpu.csv",
            90,
            ("retrieval_gpu.csv",),
            plan=("bench:bench_retrieval.py --repeats 1 --shape 5000,48,7,3",),
        ),
        _steps.bench("kv_splice", "bench_kv_splice.py", "--quick --rep-ms 20", 90, "kv_splice.csv"),
        Step(
            "pytest_gpu",
            _pytest(2, "tests/retrieval/test_retrieval_gpu.py"),
            180,
            ("pytest_gpu.csv",),
            plan=PYTEST_ROWS,
        ),
        JUNIT,
    ],
    table=TABLE,
    record=RECORD,
)
# Call 1 keeps back what call 2 needs for its build check and the Liger/CCE anchors (call 2 then runs past its
# extension step), but never gives up its own graded rows, through the splice, for that.
STAGE.keep = Keep(
    next_s=first_s(as_carried(call2_anchors.STAGE.gpu_steps), "anchors_v152k"),
    own_s=first_s(STAGE.gpu_steps, "kv_splice"),
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
