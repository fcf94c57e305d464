"""A pytest-xdist scheduler for the GPU call's test step (`-p pytest_gpu_scope --dist loadscope`): each test file's
tests run on one process, so a file's large-memory gpu tests never overlap, except the tests marked `gpu_spread` (many
Triton compiles, little memory), each its own unit, spread over all the processes.

Why not `xdist_group` markers under `--dist loadgroup`: xdist turns the markers into a suffix of the node id in each
worker, and pytest 9.2 no longer lets a plugin rename a node (its id is built from a structured form): with
pytest-xdist 3.8 the grouping then silently does nothing (seen here with pytest 9.2.0; it worked on 9.0.3 only because
the hook adding the markers ran first). This scheduler needs only the node ids the controller already has. Which
tests are gpu_spread it reads from the test files' source (a `@pytest.mark.gpu_spread` decorator on a top-level test
function or class, or a module's `pytestmark`), since the controller collects nothing itself.
Loaded with `-p pytest_gpu_scope` (bench/gpu on PYTHONPATH). What this is not: anything a test needs, nor the
grouping of a plain `pytest -n` run (that is xdist's own).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

MARK = "gpu_spread"


def _is_mark(node: ast.AST) -> bool:
    """`pytest.mark.gpu_spread` or `mark.gpu_spread(...)` as written in a decorator or a pytestmark."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == MARK


@cache
def spread_names(path: str) -> frozenset[str] | None:
    """The top-level functions and classes of the test file at `path` marked gpu_spread; None when the module's
    pytestmark marks all of it; empty when none, or when the file cannot be read (then it stays one unit)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if any(_is_mark(d) for d in node.decorator_list):
                names.add(node.name)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(_is_mark(v) for v in values):
                return None
    return frozenset(names)


def scope(nodeid: str, rootdir: Path) -> str:
    """The unit a test is scheduled in: its file, or the test itself when it is marked gpu_spread."""
    file, _, rest = nodeid.partition("::")
    names = spread_names(str(Path(rootdir) / file))
    owner = rest.split("::")[0].split("[")[0]
    return nodeid if names is None or owner in names else file


@pytest.hookimpl(tryfirst=True)  # before xdist's own (trylast) scheduler choice; a firstresult hook
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrSpread(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid, config.rootpath)

    return FileOrSpread(config, log)
