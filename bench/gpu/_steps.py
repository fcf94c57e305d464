"""The steps both GPU calls share (the carried wheels installed, what the machine has, the extension with the backend
the call needs) and the constructor of a bench step, whose command and `--plan` come from one argument string.

What this is not: the runner (_stage.py) nor any measurement.
"""

from __future__ import annotations

from _stage import SITE, WHEELS, Step


def env(imports: str = "", smoke: bool = False) -> Step:
    """check_env.py, after the wheels step (so it sees them), trying only the optional imports the call uses (trl's
    import alone takes seconds). A cold `import torch` on a fresh machine has taken over 20 s."""
    return Step("env", f"{{py}} {{here}}/check_env.py --imports '{imports}'", 60 if smoke else 30)


# --no-deps --no-index: the machine has no network and its image's packages stay as they are (docs/gpu_validation.md).
WHEELS_GPU = Step(
    "wheels",
    f"if ls {WHEELS}/*.whl >/dev/null 2>&1; then {{py}} -m pip install -q --no-index --no-deps --no-compile "
    f"--no-cache-dir --upgrade --target {SITE} {WHEELS}/*.whl && ls {SITE}; "
    f'else echo "no wheels in {WHEELS}: trl tests skip, the liger and cce providers say unavailable"; fi',
    20,
)
# The carried wheels are for CPython 3.12 (the GPU image): on the CPU the smoke run only lists them.
WHEELS_SMOKE = Step("wheels", f"ls -l {WHEELS} 2>/dev/null || echo 'no wheels in {WHEELS}'", 10)


def extension(build: bool) -> Step:
    """Call 1 builds for sm_90a and brings the .so back in its output; call 2 uses that build, carried."""
    if build:
        cmd = "{py} {here}/ensure_ext.py --archs 90a --copy-to {out}"
        return Step("extension", cmd, 105, ("_C.cpython-312-x86_64-linux-gnu.so",), required=True)
    return Step("extension", "{py} {here}/ensure_ext.py --archs 90a", 30, required=True)


EXT_SMOKE = Step("extension", "{py} {here}/ensure_ext.py --cpu", 90, required=True)


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
