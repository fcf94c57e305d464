"""GPU stage 2: the fused policy loss and the token log-probs against their anchors in one run (torch eager,
torch.compile, torch's chunked F.linear_cross_entropy, Liger's fused linear GRPO loss) at the README's headline
shapes: N=16384 tokens, H=4096, V in {32k, 152k}, bf16. One step per shape, so a timeout loses one shape only.

Usage: `python bench/gpu/stage2_loss.py --out DIR | --dry-run | --cpu-smoke DIR | --record DIR` (README.md, "GPU
validation"). What this is not: the benches themselves (bench/bench_loss.py, bench/bench_token_logprobs.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _steps  # noqa: E402
from _stage import Stage, Step, check_bounds, main  # noqa: E402

LOSS = "{py} bench/bench_loss.py --out {out} "
LOGP = "{py} bench/bench_token_logprobs.py --out {out} "
V152K = "--shape 16384,4096,152064"
# torch.compile's compilation at V=152k can take a minute: its own step (with torch_eager again, the reference the
# loss agreement is checked against), so a timeout there keeps the other providers' rows. On the CPU it costs minutes
# of C++ compilation: the smoke run leaves it out.
NO_COMPILE = (
    "torch_eager,rapo_fast_hidden,rapo_fast_hidden_2pass,rapo_fast_logits,rapo_fast_logits_lmhead,"
    "rapo_fast_logits_lmhead_inplace,torch_linear_ce,liger"
)
SMOKE_PROVIDERS = NO_COMPILE

STAGE = Stage(
    name="stage2_loss",
    title="policy loss and token log-probs vs eager, torch.compile, torch chunked and Liger",
    gpu_steps=[
        _steps.env("liger"),
        _steps.WHEELS_GPU,
        _steps.extension(),
        Step("loss_v32k", LOSS + "--gpu --shape 16384,4096,32768 --rep-ms 200", 80, ("loss.csv",)),
        Step("loss_v152k", LOSS + f"--gpu {V152K} --rep-ms 150 --providers {NO_COMPILE}", 70, ("loss.csv",)),
        Step(
            "compile_v152k",
            LOSS + f"--gpu {V152K} --rep-ms 150 --providers torch_eager,torch_compile",
            70,
            ("loss.csv",),
        ),
        Step(
            "logprobs",
            LOGP + "--gpu --shape 16384,4096,32768 --shape 16384,4096,152064 --rep-ms 150",
            55,
            ("token_logprobs.csv",),
        ),
    ],
    smoke_steps=[
        _steps.env(smoke=True),
        _steps.WHEELS_SMOKE,
        _steps.EXT_SMOKE,
        Step("loss", LOSS + f"--shape 64,32,100 --rep-ms 5 --providers {SMOKE_PROVIDERS}", 150, ("loss.csv",)),
        Step("logprobs", LOGP + "--quick --shape 64,32,500 --rep-ms 5", 150, ("token_logprobs.csv",)),
    ],
    table={
        "loss.csv": ["provider", "N", "V", "median_ms", "peak_mem_mb", "pct_of_copy_bw", "status"],
        "token_logprobs.csv": ["provider", "mode", "N", "V", "median_ms", "peak_mem_mb", "pct_of_copy_bw", "status"],
    },
    record={"loss.csv": "loss_gpu", "token_logprobs.csv": "token_logprobs_gpu"},
)
check_bounds(STAGE)

if __name__ == "__main__":
    raise SystemExit(main(STAGE))
