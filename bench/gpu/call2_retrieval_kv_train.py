"""GPU call 2 of 2: step retrieval (paper scale first, then C=4M and C=1M), the KV splice at a 7B model's shape,
compute-sanitizer memcheck and racecheck over small cases of every kernel, and a short trainer run (tokens/s and the
split of step time). It uses the extension call 1 built, carried in .carry/ext.

Usage: `python bench/gpu/call2_retrieval_kv_train.py --out DIR | --dry-run | --cpu-smoke DIR | --record DIR`
(docs/gpu_validation.md). What this is not: the benches themselves, nor the demo's learning result (the trainer
runs too few steps for that; `rapo-fast demo` gives it).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402

RET = "--gpu --rep-ms 100"
# The demo writes its own files (curves, summaries) into {tmp}, outside the output folder; only the split comes back.
DEMO = "{py} -m rapo_fast.cli demo --quick --mode splice --no-progress --eval-every 1000 --out {tmp}/demo "
SPLIT = Step(
    "trainer_split",
    "{py} {here}/trainer_split.py {tmp}/demo {out}/trainer.csv",
    10,
    ("trainer.csv",),
    plan=("trainer,RAPO", "trainer,GRPO"),
)
SAN = "{py} {here}/sanitize.py --out {out} --tool "
SAN_ROWS = "sanitizer,{tool},11 cases: " + "retrieval (CUDA fp16/bf16/fp32, splits, filters; Triton), splice, loss"


def _sanitizer(tool: str, budget: int, smoke: bool) -> Step:
    cmd = SAN + tool + (" --cpu" if smoke else "")
    return Step(tool, cmd, budget, ("sanitizer.csv",), plan=(SAN_ROWS.format(tool=tool),))


STAGE = Stage(
    name="call2_retrieval_kv_train",
    title="retrieval vs torch and the floor; KV splice; compute-sanitizer; trainer tokens/s and step-time split",
    gpu_steps=[
        _steps.env("transformers"),
        _steps.extension(build=False),
        _steps.bench(
            "paper_170k",
            "bench_retrieval.py",
            f"{RET} --shape 170000,384,256,1 --shape 170000,384,256,3",
            50,
            "retrieval_gpu.csv",
        ),
        _steps.bench("kv_splice", "bench_kv_splice.py", "--gpu", 60, "kv_splice.csv"),
        _steps.bench(
            "c4m",
            "bench_retrieval.py",
            f"{RET} --shape 4000000,768,64,64 --shape 4000000,768,4096,64",
            100,
            "retrieval_gpu.csv",
        ),
        _steps.bench(
            "c1m",
            "bench_retrieval.py",
            f"{RET} --shape 1000000,768,1024,64 --shape 1000000,768,64,8",
            60,
            "retrieval_gpu.csv",
        ),
        _sanitizer("memcheck", 50, smoke=False),
        _sanitizer("racecheck", 50, smoke=False),
        Step("trainer", DEMO + "--device cuda --sft-steps 60 --rl-steps 6", 90, ()),
        SPLIT,
    ],
    # The CPU run of bench_retrieval writes retrieval_cpu.csv; renamed so the table and its checks are those of the
    # GPU run. Its rows name the CPU as their device, and --record refuses a smoke run's folder.
    smoke_steps=[
        _steps.env(smoke=True),
        _steps.EXT_SMOKE,
        Step(
            "tiny_retrieval",
            "{py} bench/bench_retrieval.py --out {out} --no-plot --repeats 1 --shape 5000,48,7,3 "
            "&& mv {out}/retrieval_cpu.csv {out}/retrieval_gpu.csv",
            60,
            ("retrieval_gpu.csv",),
            plan=("bench:bench_retrieval.py --repeats 1 --shape 5000,48,7,3",),
        ),
        _steps.bench("kv_splice", "bench_kv_splice.py", "--quick --rep-ms 20", 60, "kv_splice.csv"),
        _sanitizer("memcheck", 40, smoke=True),
        _sanitizer("racecheck", 40, smoke=True),
        Step("trainer", DEMO + "--device cpu --sft-steps 5 --rl-steps 2", 120, ()),
        SPLIT,
    ],
    table={
        "retrieval_gpu.csv": ["provider", "C", "D", "Q", "k", "median_ms", "qps", "time_over_torch", "pct_of_copy_bw"],
        "kv_splice.csv": ["provider", "shape_desc", "median_ms", "gbs", "pct_copy_bw", "time_over_rapo_fast"],
        "sanitizer.csv": ["tool", "cases_ok", "cases_failed", "errors", "seconds", "status"],
        "trainer.csv": [
            "method",
            "steps",
            "tokens_per_s",
            "t_step_s",
            "pct_rollout",
            "pct_retrieval",
            "pct_splice",
            "pct_logprob",
            "pct_loss",
            "pct_optimizer",
        ],
    },
    record={
        "retrieval_gpu.csv": "retrieval_gpu",
        "kv_splice.csv": "kv_splice_gpu",
        "sanitizer.csv": "sanitizer_gpu",
        "trainer.csv": "trainer_gpu",
    },
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
