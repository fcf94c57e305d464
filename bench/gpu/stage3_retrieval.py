"""GPU stage 3: exact step retrieval (StepBuffer.search, fp16 keys: the default dispatch `ours`, and each backend
forced, `ours_cuda` and `ours_triton`) against torch matmul+topk and the bandwidth floor, at the README's acceptance
shapes: the paper's scale (170k x 384, Q=256, k in {1, 3}), C=1M x 768 at Q=1024, and C=4M x 768 at Q=64 (the
floor) and Q=4096 (vs torch). One step per buffer size.

Usage: `python bench/gpu/stage3_retrieval.py --out DIR | --dry-run | --cpu-smoke DIR | --record DIR` (README.md,
"GPU validation"). What this is not: the bench itself (bench/bench_retrieval.py); faiss-gpu is not in the image.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402

# 100 ms of repeats (was 150) makes room for five providers and the Triton kernel's first compiles (one per k).
RET = "{py} bench/bench_retrieval.py --gpu --out {out} --rep-ms 100 "
FILES = ("retrieval_gpu.csv",)

STAGE = Stage(
    name="stage3_retrieval",
    title="StepBuffer.search (CUDA and Triton) vs torch matmul+topk and the bandwidth floor",
    gpu_steps=[
        _steps.env(),
        _steps.extension(),
        Step("paper_170k", RET + "--shape 170000,384,256,1 --shape 170000,384,256,3", 90, FILES),
        Step("c1m", RET + "--shape 1000000,768,1024,64 --shape 1000000,768,64,8", 90, FILES),
        Step("c4m", RET + "--shape 4000000,768,64,64 --shape 4000000,768,4096,64", 140, FILES),
    ],
    # The CPU run writes retrieval_cpu.csv; renamed so the table and its checks are those of the GPU run. Its rows
    # name the CPU as their device, and --record refuses a smoke run's folder.
    smoke_steps=[
        _steps.env(smoke=True),
        _steps.EXT_SMOKE,
        Step(
            "tiny",
            "{py} bench/bench_retrieval.py --out {out} --repeats 1 --shape 5000,48,7,3 "
            "&& mv {out}/retrieval_cpu.csv {out}/retrieval_gpu.csv",
            150,
            FILES,
        ),
    ],
    table={
        "retrieval_gpu.csv": ["provider", "C", "D", "Q", "k", "median_ms", "qps", "ratio_vs_torch", "pct_of_copy_bw"]
    },
    record={"retrieval_gpu.csv": "retrieval_gpu"},
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
