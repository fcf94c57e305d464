"""The steps both GPU calls share (the carried wheels installed, what the machine has, the extension with the backend
the call needs) and the constructor of a bench step, whose command and `--plan` come from one argument string.

What this is not: the runner (_stage.py) nor any measurement.
"""

from __future__ import annotations

from pathlib import Path

from _stage import ROOT, SITE, WHEELS, Step

# Budgets: every figure names where it was measured, or says "estimate, not measured". No step has run on the GPU
# machine yet; the steps print their own times (the log's "===== step: ok in N s", the import times below), so the
# first run replaces the estimates.
# One interpreter importing torch and rapo_fast: 5.7-7.0 s warm, 6.7-8.4 s with torch's files evicted from the page
# cache (posix_fadvise), measured on the 2 shared development cores (CPU torch 2.13, 754 MB; load ~9). On the H200's
# fresh machine: estimate, not measured, 10-30 s: the image's torch 2.11+cu130 maps ~2 GB of CUDA libraries, read from
# a cold disk, on an idle core.
COLD_IMPORT_S = 30


def env(imports: str = "", smoke: bool = False) -> Step:
    """check_env.py, after the wheels step (so it sees them), trying only the optional imports the call uses (trl's
    import alone takes seconds: estimate, not measured). Budget: the cold import (COLD_IMPORT_S) and the optional
    imports; the smoke run's 60 s is a loaded CI machine's (no lease to fit)."""
    return Step("env", f"{{py}} {{here}}/check_env.py --imports '{imports}'", 60 if smoke else COLD_IMPORT_S + 10)


# --no-deps --no-index: the machine has no network and its image's packages stay as they are (docs/gpu_validation.md).
WHEELS_GPU = Step(
    "wheels",
    f"if ls {WHEELS}/*.whl >/dev/null 2>&1; then {{py}} -m pip install -q --no-index --no-deps --no-compile "
    f"--no-cache-dir --upgrade --target {SITE} {WHEELS}/*.whl && ls {SITE}; "
    f'else echo "no wheels in {WHEELS}: trl tests skip, the liger and cce providers say unavailable"; fi',
    10,  # ~3 MB from the carried folder, no resolver: ~5 s, estimate, not measured
)
# The carried wheels are for CPython 3.12 (the GPU image): on the CPU the smoke run only lists them.
WHEELS_SMOKE = Step("wheels", f"ls -l {WHEELS} 2>/dev/null || echo 'no wheels in {WHEELS}'", 10)


# CMake + nvcc for sm_90a on a fresh 16-core machine: 35-60 s, estimate, not measured (the CPU part alone: 18 s on the
# 2 development cores, measured), plus one check interpreter (torch warm after the env step: ~10 s, estimate).
EXT_BUILD_S = 90
# A carried .so: copied without an interpreter, then ONE interpreter imports torch cold and checks the build (call 2
# has no env step before it): COLD_IMPORT_S plus the check and its output, ~5 s (estimate, not measured).
EXT_CARRIED_S = COLD_IMPORT_S + 15


def carried_so() -> list[Path]:
    """The built extension carried in .carry/ext (call 1 brings it back; the driver copies it there)."""
    return sorted((ROOT / ".carry" / "ext").glob("_C*.so"))


def extension(copy_back: bool) -> Step:
    """ensure_ext.py uses a carried build when there is one and builds for sm_90a otherwise; the budget follows which
    (decided when the call starts, on the machine that runs it). Call 1 also copies the .so into its output, so that
    call 2, on this machine or a fresh one, carries it instead of building again."""
    budget = EXT_CARRIED_S if carried_so() else EXT_BUILD_S
    if copy_back:
        cmd = "{py} {here}/ensure_ext.py --archs 90a --copy-to {out}"
        return Step("extension", cmd, budget, ("_C.cpython-312-x86_64-linux-gnu.so",), required=True)
    return Step("extension", "{py} {here}/ensure_ext.py --archs 90a", budget, required=True)


# The CPU build takes ~20 s on 2 quiet cores (measured on the development machine) and several times that on a loaded
# CI machine (estimate): the smoke run has no lease to fit.
EXT_SMOKE = Step("extension", "{py} {here}/ensure_ext.py --cpu", 240, required=True)


def bench(name: str, script: str, args: str, budget_s: int, csv_name: str) -> Step:
    """A step running bench/<script> with `args` into the output folder, without its plot (the device tool brings few
    files back; plot the CSVs here with bench/plot_*.py); its rows are the bench's `--plan` of the same arguments."""
    return Step(
        name,
        f"{{py}} bench/{script} --out {{out}} --no-plot {args}",
        budget_s,
        (csv_name,),
        plan=(f"bench:{script} {args}",),
    )


# The columns each CSV shows in a call's summary table (both calls share the loss and log-prob CSVs).
COLUMNS = {
    "pytest_gpu.csv": ["outcome", "count", "test", "seconds", "message"],
    "loss.csv": ["provider", "N", "V", "median_ms", "peak_mem_mb", "pct_of_copy_bw", "status"],
    "token_logprobs.csv": ["provider", "mode", "N", "V", "median_ms", "peak_mem_mb", "pct_of_copy_bw", "status"],
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
}


def tables(*names: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """A call's (table, record) for its CSVs: the summary's columns, and the bench/results/ name each CSV's rows are
    appended to by --record (<stem>_gpu, e.g. loss.csv -> loss_gpu; retrieval_gpu.csv keeps its name)."""
    table = {n: COLUMNS[n] for n in names}
    stems = {n: n.removesuffix(".csv") for n in names}
    return table, {n: st if st.endswith("_gpu") else f"{st}_gpu" for n, st in stems.items()}
