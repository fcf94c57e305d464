"""GPU call 2 of 2: what call 1 leaves out, by value: the loss's anchors that compile for long (Liger's fused linear
GRPO loss, Cut Cross-Entropy, torch.compile), compute-sanitizer memcheck and racecheck over small cases of every
kernel, a short trainer run (tokens/s and the split of step time), then the loss variants and the log-prob anchors.
It uses the extension call 1 built, carried in .carry/ext (or builds it, with the budget that needs).

Run with `--asked-at` and `--lease-left` (docs/gpu_validation.md): the call takes its deadline from what is left of the
lease when it actually starts, and the steps that cannot finish before it are skipped, in order, so the files come back.
Usage: `python bench/gpu/call2_anchors.py --out DIR [--asked-at T --lease-left S] [--deadline-s S] | --dry-run |
--cpu-smoke DIR | --record DIR`. What this is not: the benches themselves, nor the demo's learning result (the trainer
runs too few steps for that; `rapo-fast demo` gives it).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402

V152K = "--shape 16384,4096,152064"
VARIANTS = "rapo_fast_hidden_2pass,rapo_fast_logits_lmhead,rapo_fast_logits_lmhead_inplace"
LOGP_ANCHORS = "cce,torch_eager_logits,torch_eager_hidden"  # the eager ones take ~1 s a call (fp32 [N, V]): last
# The demo writes its own files (curves, summaries) into {tmp}, outside the output folder; only the split comes back.
DEMO = "{py} -m rapo_fast.cli demo --quick --mode splice --no-progress --eval-every 1000 --out {tmp}/demo "
SPLIT = "{py} {here}/trainer_split.py {tmp}/demo {out}/trainer.csv"
TRAINER_ROWS = ("trainer,RAPO", "trainer,GRPO")
SAN = "{py} {here}/sanitize.py --out {out} --tool "
SAN_ROWS = "sanitizer,{tool},11 cases: " + "retrieval (CUDA fp16/bf16/fp32, splits, filters; Triton), splice, loss"


def _sanitizer(tool: str, budget: int, smoke: bool) -> Step:
    cmd = SAN + tool + (" --cpu" if smoke else "")
    return Step(tool, cmd, budget, ("sanitizer.csv",), plan=(SAN_ROWS.format(tool=tool),))


TABLE, RECORD = _steps.tables("loss.csv", "sanitizer.csv", "trainer.csv", "token_logprobs.csv")

STAGE = Stage(
    name="call2_anchors",
    title="Liger, CCE and torch.compile anchors; compute-sanitizer; trainer tokens/s and split; loss variants",
    # GPU budgets: estimates, not measured (no step has run on a GPU yet); docs/perf.md, "The GPU run: two calls",
    # gives each one's reasoning, and the first run's log ("===== step: ok in N s") replaces them.
    gpu_steps=[
        _steps.WHEELS_GPU,
        _steps.extension(copy_back=False),
        _steps.bench(
            "anchors_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers liger,cce", 70, "loss.csv"
        ),  # Liger's compiled path 15-30 s cold, CCE's Triton compiles ~10 s: estimate, not measured
        _steps.bench(
            "compile_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers torch_compile", 80, "loss.csv"
        ),  # a cold torch.compile 20-40 s + the timed calls and agreement check: estimate, not measured
        # torch's start under compute-sanitizer, then 11 small cases: estimate, not measured
        _sanitizer("memcheck", 50, smoke=False),
        _sanitizer("racecheck", 50, smoke=False),
        Step(
            "trainer",
            DEMO + "--device cuda --sft-steps 60 --rl-steps 6 && " + SPLIT,
            100,  # the demo's RAPO and GRPO runs, 6 RL steps each: estimate, not measured
            ("trainer.csv",),
            plan=TRAINER_ROWS,
        ),
        _steps.bench(
            "variants_v152k", "bench_loss.py", f"--gpu {V152K} --rep-ms 100 --providers {VARIANTS}", 40, "loss.csv"
        ),  # three providers, ~100-133 ms a call, kernels compiled by then: estimate, not measured
        _steps.bench(
            "logprobs_anchors",
            "bench_token_logprobs.py",
            f"--gpu {V152K} --rep-ms 100 --providers {LOGP_ANCHORS}",
            30,  # CCE and the eager references (fp32 [N, V], ~1 s a call): estimate, not measured
            "token_logprobs.csv",
        ),
    ],
    smoke_steps=[
        _steps.WHEELS_SMOKE,
        _steps.EXT_SMOKE,
        _steps.bench(
            "anchors",
            "bench_loss.py",
            "--shape 64,32,100 --rep-ms 5 --providers liger,cce,torch_eager",
            150,
            "loss.csv",
        ),
        _sanitizer("memcheck", 90, smoke=True),
        _sanitizer("racecheck", 90, smoke=True),
        Step(
            "trainer",
            DEMO + "--device cpu --sft-steps 5 --rl-steps 2 && " + SPLIT,
            240,
            ("trainer.csv",),
            plan=TRAINER_ROWS,
        ),
        _steps.bench(
            "logprobs_anchors",
            "bench_token_logprobs.py",
            "--shape 64,32,500 --rep-ms 5 --providers torch_eager_logits,torch_eager_hidden",
            150,
            "token_logprobs.csv",
        ),
    ],
    table=TABLE,
    record=RECORD,
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
