"""Makes `rapo_fast.kernels` importable from a source checkout that was never installed (PYTHONPATH only).

What this is: `install()`, which puts a finder for exactly `rapo_fast.kernels` first on sys.meta_path when rapo_fast is
imported from a checkout, mapping the name to the top-level `kernels/` folder (as setup.py and an editable install
do). Why and when it applies: docs/extension.md, "Loading".
What this is not: a general import hook (it answers for one name), nor an installer (`_C` is built by CMake or pip).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

NAME = "rapo_fast.kernels"
_PACKAGE = Path(__file__).resolve().parent


class _KernelsFinder(importlib.abc.MetaPathFinder):
    """Finds `rapo_fast.kernels` in the checkout's `kernels/` folder; None for every other name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (importlib's protocol)
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            NAME, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)]
        )


def checkout_kernels() -> Path | None:
    """The checkout's `kernels/` folder when rapo_fast runs from a source tree, else None (an installed package)."""
    folder = _PACKAGE.parent / "kernels"
    if (folder / "__init__.py").is_file() and not (_PACKAGE / "kernels").exists():
        return folder
    return None


def install() -> None:
    """Put the finder first on sys.meta_path once (before an editable install's finder, which may point at another
    checkout than the one on PYTHONPATH)."""
    folder = checkout_kernels()
    if folder is None or any(isinstance(f, _KernelsFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _KernelsFinder(folder))
