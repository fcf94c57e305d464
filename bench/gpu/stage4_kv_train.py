"""GPU stage 4: the KV splice against plain torch, re-prefill and the copy floor at a 7B model's shape, then a short
trainer run on the GPU (the demo's RAPO and GRPO runs, splice mode, a few RL steps) summarised as tokens/s and the
split of step time (rollout, retrieval, splice, log-prob, loss, optimiser, buffer).

Usage: `python bench/gpu/stage4_kv_train.py --out DIR | --dry-run | --cpu-smoke DIR | --record DIR` (README.md,
"GPU validation"). What this is not: the demo's learning result (too few steps; `rapo-fast demo` gives that).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402

# The demo writes its own files (curves, summaries) into {tmp}, outside the output folder; only the split comes back.
DEMO = "{py} -m rapo_fast.cli demo --quick --mode splice --no-progress --eval-every 1000 --out {tmp}/demo "
SPLIT = Step("trainer_split", "{py} {here}/trainer_split.py {tmp}/demo {out}/trainer.csv", 20, ("trainer.csv",))

STAGE = Stage(
    name="stage4_kv_train",
    title="KV splice vs plain torch and re-prefill; trainer tokens/s and step-time split",
    gpu_steps=[
        _steps.env("transformers"),
        _steps.extension(),
        Step("kv_splice", "{py} bench/bench_kv_splice.py --gpu --out {out}", 120, ("kv_splice.csv",)),
        Step("trainer", DEMO + "--device cuda --sft-steps 60 --rl-steps 6", 150, ()),
        SPLIT,
    ],
    smoke_steps=[
        _steps.env(smoke=True),
        _steps.EXT_SMOKE,
        Step("kv_splice", "{py} bench/bench_kv_splice.py --quick --rep-ms 20 --out {out}", 150, ("kv_splice.csv",)),
        Step("trainer", DEMO + "--device cpu --sft-steps 5 --rl-steps 2", 150, ()),
        SPLIT,
    ],
    table={
        "kv_splice.csv": ["provider", "shape_desc", "median_ms", "gbs", "pct_copy_bw", "ours_speedup"],
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
    record={"kv_splice.csv": "kv_splice_gpu", "trainer.csv": "trainer_gpu"},
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
