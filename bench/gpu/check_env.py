"""Print what this machine offers the GPU calls: Python, torch, triton, the device, rapo_fast's extension backends,
where rapo_fast, its kernels and its extension were imported from, and whether each optional package the tests and
benches use imports (trl's GRPOConfig, liger-kernel, cut-cross-entropy, datasets).

Informational only (exit 0): a missing optional package makes its tests skip and its bench provider drop out, and
the stage's table says so. What this is not: an installer (the stage's wheels step installs the carried wheels).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
import sys
import time

_T0 = time.perf_counter()
import torch  # noqa: E402  (timed: the first run on the GPU machine measures the cold import the budgets estimate)

IMPORT_TORCH_S = time.perf_counter() - _T0

CHECKS = {  # name -> the statement a test module or bench provider runs
    "trl": "from trl import GRPOConfig, GRPOTrainer",
    "liger": "from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss",
    "cce": "from cut_cross_entropy import linear_cross_entropy",
    "datasets": "import datasets",
    "transformers": "import transformers",
}


def _try(stmt: str) -> str:
    try:
        exec(stmt, {})
        return "ok"
    except Exception as exc:  # any failure: the optional path is off, and why
        return f"missing ({type(exc).__name__}: {str(exc)[:100]})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--imports",
        default=",".join(CHECKS),
        help=f"comma-separated optional imports to try, of {', '.join(CHECKS)} (default all; '' for none)",
    )
    names = [n for n in p.parse_args(argv).imports.split(",") if n]
    print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}")
    print(f"import torch: {IMPORT_TORCH_S:.1f} s")
    triton = importlib.util.find_spec("triton")
    print(f"triton {importlib.import_module('triton').__version__ if triton else 'missing'}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(
            f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
        )
    else:
        print("device: none (CPU only)")
    import rapo_fast

    print(f"rapo_fast build_info: {rapo_fast.build_info()}")
    # Where the package, its kernels and its extension were imported from: on the GPU machine (and in CI's copy test)
    # all three must lie in the repository copy, with nothing installed.
    print(f"rapo_fast from: {rapo_fast.__file__}")
    for name in ("rapo_fast.kernels", "rapo_fast._C"):
        try:
            print(f"{name} from: {importlib.import_module(name).__file__}")
        except Exception as exc:  # say it, the stage's extension step decides whether the call can go on
            print(f"{name}: not importable ({type(exc).__name__}: {str(exc)[:200]})")
    for name in names:
        print(f"import {name}: {_try(CHECKS[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
