"""The steps every GPU stage begins with: what the machine has (check_env.py), the carried wheels installed, and the
extension with the backend the stage needs (ensure_ext.py). Each stage script adds its own measuring steps after.

What this is not: the runner (_stage.py) nor any measurement.
"""

from __future__ import annotations

from _stage import SITE, WHEELS, Step


def env(imports: str = "", smoke: bool = False) -> Step:
    """check_env.py, trying only the optional imports the stage uses (trl's import alone takes seconds)."""
    return Step("env", f"{{py}} {{here}}/check_env.py --imports '{imports}'", 60 if smoke else 20)


# --no-deps --no-index: the machine has no network and its image's packages stay as they are (docs in README.md).
WHEELS_GPU = Step(
    "wheels",
    f"if ls {WHEELS}/*.whl >/dev/null 2>&1; then {{py}} -m pip install -q --no-index --no-deps --no-compile "
    f"--no-cache-dir --upgrade --target {SITE} {WHEELS}/*.whl && ls {SITE}; "
    f'else echo "no wheels in {WHEELS}: trl tests skip, the liger provider drops out"; fi',
    45,
)
# The carried wheels are for CPython 3.12 (the GPU image): on the CPU the smoke run only lists them.
WHEELS_SMOKE = Step("wheels", f"ls -l {WHEELS} 2>/dev/null || echo 'no wheels in {WHEELS}'", 10)


def extension(copy_out: bool = False) -> Step:
    """Stage 1 builds (or reuses a carried build) and brings the .so back in its output; later stages reuse it."""
    cmd = "{py} {here}/ensure_ext.py --archs 90a" + (" --copy-to {out}" if copy_out else "")
    files = ("_C.cpython-312-x86_64-linux-gnu.so",) if copy_out else ()
    return Step("extension", cmd, 130, files, required=True)


EXT_SMOKE = Step("extension", "{py} {here}/ensure_ext.py --cpu", 90, required=True)
