"""Smoke test of an installed (non-editable) rapo_fast: run it with the environment's python from outside the source
tree, after `pip install` of a wheel (.ci/run does). It checks that the package imported is the installed one, that
the extension, the Triton kernels (rapo_fast.kernels) and the package data (py.typed) were shipped, and runs one op of
each: a token log-prob (Triton; interpreted under TRITON_INTERPRET=1), a step-buffer search (C++) and its
save/load round trip. What it is not: a test of the numbers (the test suite's job) nor of the CUDA backend.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path


def main() -> int:
    import torch

    import rapo_fast
    from rapo_fast._ext import build_info

    pkg = Path(rapo_fast.__file__).resolve().parent
    if (pkg.parent / "setup.py").exists() or not pkg.is_relative_to(Path(sys.prefix).resolve()):
        raise SystemExit(f"wheel smoke: imported rapo_fast from {pkg}, not from the installed environment {sys.prefix}")
    info = build_info()
    if not (info["extension"] and info["cpu"]):
        raise SystemExit(f"wheel smoke: the extension is missing or has no CPU backend: {info}")
    for what in ("py.typed", "kernels/__init__.py"):
        if not (pkg / what).is_file():
            raise SystemExit(f"wheel smoke: {pkg / what} was not installed")
    if importlib.util.find_spec("rapo_fast.kernels") is None:
        raise SystemExit("wheel smoke: rapo_fast.kernels is not importable")
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    got = rapo_fast.token_logprobs(logits, targets=targets)
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    buf = rapo_fast.StepBuffer(16, 8)
    keys = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    buf.add(keys, torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.ones(4))
    _, ids = buf.search(keys, 1)
    if ids[:, 0].tolist() != [0, 1, 2, 3]:
        raise SystemExit(f"wheel smoke: the search returned {ids.tolist()}")
    with tempfile.TemporaryDirectory() as tmp:
        buf.save(Path(tmp) / "buf")
        if len(rapo_fast.StepBuffer.load(Path(tmp) / "buf")) != 4:
            raise SystemExit("wheel smoke: the saved buffer did not load back")
    print(f"wheel smoke: rapo_fast {rapo_fast.__version__} from {pkg}: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
