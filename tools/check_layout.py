"""Checks the layout rules of the repository and names what breaks them and where (docs/architecture.md).

Static checks, over the sources (`python tools/check_layout.py`):
- import cycles among rapo_fast modules. Every .py under rapo_fast/ is
  parsed with ast; every import statement counts, inside functions too. `from a.b import c` is an edge to the module
  a.b.c when that is a module, else to a.b; a package's __init__.py is the package's module; the implicit import of
  parent packages is not counted.
- a module over MAX_MODULE_LINES lines (every .py of the repository outside build outputs); one over
  WARN_MODULE_LINES is only a warning (`module_size_warnings`): split a module by concern, never by length alone;
- a function over MAX_FUNCTION_LINES lines (same files; counted from `def` to its last line, docstring excluded),
  unless listed with a reason in LONG_FUNCTION_EXEMPT;
- a module docstring over MAX_MODULE_DOCSTRING_LINES lines in rapo_fast/ (what it is, what it is not,
  where the spec lives: the detail belongs in docs/);
- a library module (rapo_fast/ outside rapo_fast/demo/) importing rapo_fast.demo, except the entry points in
  DEMO_ROUTERS, which no library module may import in turn;
- a module using a `_private` name of a module in another (sub)package: `from m import _x`, or `m._x` on a module
  bound by an import (a private *module* such as rapo_fast._ext is fine: its public names are the shared internals).
With `--benches` it also runs every benchmark's `--quick` through `rapo-fast bench` and fails when the run changed a
tracked file (content hash of every file `git ls-files` lists, before and after; skipped when git is missing). A
Python audit hook in the run's process records what it writes, so that a file edited meanwhile by someone else on a
shared checkout is reported as a note, not blamed on the bench (see bench_findings).

What this is not: a linter for style (ruff does that) nor a test of behaviour; tests/test_layout.py runs it.
Exit status 0 when every rule holds, 1 otherwise (one line per finding: `rule: path[:line]: what`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package name it is installed as
PACKAGE_ROOTS = {"rapo_fast": "rapo_fast"}
WARN_MODULE_LINES = 500
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_MODULE_DOCSTRING_LINES = 12
# "path/to/file.py::qualified.name" -> why this function may stay longer than MAX_FUNCTION_LINES (keep it short)
LONG_FUNCTION_EXEMPT: dict[str, str] = {
    "rapo_fast/kernels/retrieval/search.py::retrieval_topk_kernel": "its device functions take up to 25 arguments, "
    "passed by keyword one per line so that none can be swapped; the kernel's own logic is about 40 lines",
}
DEMO = "rapo_fast.demo"
# library modules allowed to import the demo: the command line, which routes `rapo-fast demo` to it
DEMO_ROUTERS = {"rapo_fast.cli": "`rapo-fast demo` is routed to the demo's own parser"}
SKIP_DIRS = {"build", "dist", "demo_out", "__pycache__", "node_modules"}


@dataclass(frozen=True)
class Edge:
    """One import statement of `src` that loads module `dst` (a rapo_fast module)."""

    src: str
    dst: str
    path: str
    line: int
    function: str | None  # the enclosing function, when the import runs only when that function is called

    def where(self) -> str:
        inside = f" (inside {self.function}())" if self.function else ""
        return f"{self.path}:{self.line}{inside}"


# modules and import edges


def library_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every .py of the package roots (a package's __init__ named as the package)."""
    mods: dict[str, Path] = {}
    for folder, pkg in PACKAGE_ROOTS.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def package_of(name: str, mods: dict[str, Path]) -> str:
    """The (sub)package a module belongs to: itself for a package's __init__, else its parent."""
    return name if name in mods and mods[name].name == "__init__.py" else name.rpartition(".")[0]


def _known_prefix(dotted: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of `dotted` that is a module (None when it is not a rapo_fast module at all)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return None


def _from_base(node: ast.ImportFrom, importer: str, mods: dict[str, Path]) -> str:
    """The absolute module name a `from X import ...` statement reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    pkg = package_of(importer, mods)
    for _ in range(node.level - 1):
        pkg = pkg.rpartition(".")[0]
    return f"{pkg}.{node.module}" if node.module else pkg


def _walk(tree: ast.AST) -> Iterator[tuple[ast.AST, str | None]]:
    """Every node with the qualified name of its innermost enclosing function (None at module or class level)."""
    stack: list[tuple[ast.AST, str | None, str]] = [(tree, None, "")]
    while stack:
        node, func, prefix = stack.pop()
        yield node, func
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((child, prefix + child.name, prefix + child.name + "."))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, func, prefix + child.name + "."))
            else:
                stack.append((child, func, prefix))


def _imports(name: str, tree: ast.AST, rel: str, mods: dict[str, Path]) -> Iterator[tuple[Edge, str | None]]:
    """(edge, imported name) per rapo_fast module loaded by each import statement; the name is the `c` of
    `from a.b import c` when c is not itself a module (None otherwise)."""
    for node, func in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                dst = _known_prefix(alias.name, mods)
                if dst is not None:
                    yield Edge(name, dst, rel, node.lineno, func), None
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, name, mods)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in mods:
                    yield Edge(name, full, rel, node.lineno, func), None
                elif (dst := _known_prefix(base, mods)) is not None:
                    yield Edge(name, dst, rel, node.lineno, func), alias.name


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def import_edges(mods: dict[str, Path], root: Path = ROOT) -> list[tuple[Edge, str | None]]:
    out = []
    for name, path in mods.items():
        out += list(_imports(name, _parse(path), path.relative_to(root).as_posix(), mods))
    return out


# rules


def _cycle_groups(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another (strongly connected components of more than one module), each
    sorted: a module's group is every module it reaches that reaches it back. Reachability by a search from each
    module is quadratic, plenty for a package of a few hundred modules."""
    reach = {}
    for start in graph:
        seen: set[str] = set()
        todo = [start]
        while todo:
            new = graph[todo.pop()] - seen
            seen |= new
            todo += new
        reach[start] = seen
    groups = {tuple(sorted(w for w in reach[v] if v in reach[w])) for v in graph}
    return sorted(list(g) for g in groups if len(g) > 1)


def _shortest_cycle(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest import path start -> ... -> start inside one component (breadth-first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def check_cycles(edges: list[tuple[Edge, str | None]]) -> list[str]:
    graph: dict[str, set[str]] = {}
    first: dict[tuple[str, str], list[Edge]] = {}
    for e, _ in edges:
        graph.setdefault(e.src, set())
        graph.setdefault(e.dst, set())
        if e.src != e.dst:
            graph[e.src].add(e.dst)
            first.setdefault((e.src, e.dst), []).append(e)
    out = []
    for comp in _cycle_groups(graph):
        cycle = _shortest_cycle(comp[0], set(comp), graph)
        steps = "; ".join(
            f"{a} -> {b} at {', '.join(e.where() for e in first[(a, b)])}" for a, b in zip(cycle, cycle[1:])
        )
        out.append(f"import-cycle: {' -> '.join(cycle)} [{steps}] (modules in the cycle group: {', '.join(comp)})")
    return out


def check_demo_imports(edges: list[tuple[Edge, str | None]]) -> list[str]:
    out = []
    for e, _ in edges:
        lib_src = not (e.src == DEMO or e.src.startswith(DEMO + "."))
        if lib_src and (e.dst == DEMO or e.dst.startswith(DEMO + ".")) and e.src not in DEMO_ROUTERS:
            out.append(f"library-imports-demo: {e.where()}: {e.src} imports {e.dst}")
        if e.dst in DEMO_ROUTERS and lib_src:
            out.append(f"library-imports-demo: {e.where()}: {e.src} imports {e.dst}, which imports the demo")
    return out


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    """a.b.c as ["a", "b", "c"] for a chain of attributes on a name; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _module_bindings(tree: ast.AST, name: str, mods: dict[str, Path]) -> dict[str, str]:
    """Local name -> module, for every import that binds a rapo_fast module to a name in this file."""
    binds: dict[str, str] = {}
    for node, _ in _walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _known_prefix(a.name, mods):
                    binds[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, name, mods)
            for a in node.names:
                if f"{base}.{a.name}" in mods:
                    binds[a.asname or a.name] = f"{base}.{a.name}"
    return binds


def _private_attribute_uses(name: str, tree: ast.AST, mods: dict[str, Path]) -> Iterator[tuple[int, str, str]]:
    """(line, module, private name) for each `m._x` where m is bound to a rapo_fast module by an import."""
    binds = _module_bindings(tree, name, mods)
    for node, _ in _walk(tree):
        parts = _dotted(node) if isinstance(node, ast.Attribute) else None
        if not parts or parts[0] not in binds:
            continue
        full = [binds[parts[0]], *parts[1:]]
        mod = _known_prefix(".".join(full[:-1]), mods)
        if mod is not None and mod == ".".join(full[:-1]) and _private(full[-1]) and ".".join(full) not in mods:
            yield node.lineno, mod, full[-1]


def check_private_names(mods: dict[str, Path], edges: list[tuple[Edge, str | None]], root: Path = ROOT) -> list[str]:
    out = []
    for e, imported in edges:
        if _private(imported) and package_of(e.src, mods) != package_of(e.dst, mods):
            out.append(f"private-name: {e.where()}: {e.src} imports {imported} from {e.dst} (another package)")
    for name, path in mods.items():
        rel = path.relative_to(root).as_posix()
        for line, mod, attr in _private_attribute_uses(name, _parse(path), mods):
            if package_of(name, mods) != package_of(mod, mods):
                out.append(f"private-name: {rel}:{line}: {name} uses {mod}.{attr} (another package)")
    return sorted(set(out))


def python_files(root: Path = ROOT) -> list[Path]:
    """Every .py of the repository outside hidden folders and build outputs."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in rel[:-1]):
            continue
        out.append(path)
    return out


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from `def` to the function's last line, less its docstring's lines."""
    n = node.end_lineno - node.lineno + 1
    body0 = node.body[0] if node.body else None
    if isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str):
        n -= body0.end_lineno - body0.lineno + 1
    return n


def module_size_warnings(files: list[Path], root: Path = ROOT) -> list[str]:
    """One line per module between WARN_MODULE_LINES and MAX_MODULE_LINES lines: worth a look, not a failure."""
    out = []
    for path in files:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if WARN_MODULE_LINES < lines <= MAX_MODULE_LINES:
            rel = path.relative_to(root).as_posix()
            out.append(f"module-long: {rel}: {lines} lines (over {WARN_MODULE_LINES}; at most {MAX_MODULE_LINES})")
    return out


def check_sizes(files: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            out.append(f"module-too-long: {rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        doc = (ast.get_docstring(tree, clean=False) or "").count("\n") + 1  # the docstring's lines as written
        if rel.split("/")[0] in PACKAGE_ROOTS and doc > MAX_MODULE_DOCSTRING_LINES:
            what = f"at most {MAX_MODULE_DOCSTRING_LINES}: what it is and is not, where its spec lives; detail in docs/"
            out.append(f"module-docstring-too-long: {rel}:1: {doc} lines ({what})")
        for node, func in _walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and func:
                n = _code_lines(node)
                if n > MAX_FUNCTION_LINES and f"{rel}::{func}" not in LONG_FUNCTION_EXEMPT:
                    out.append(
                        f"function-too-long: {rel}:{node.lineno}: {func}() has {n} lines without its docstring "
                        f"(at most {MAX_FUNCTION_LINES})"
                    )
    return out


def static_findings(root: Path = ROOT) -> list[str]:
    """Every finding of the static rules, one line each (empty when the layout holds)."""
    mods = library_modules(root)
    edges = import_edges(mods, root)
    return [
        *check_cycles(edges),
        *check_demo_imports(edges),
        *check_private_names(mods, edges, root),
        *check_sizes(python_files(root), root),
    ]


# quick benchmark runs leave tracked files alone


def tracked_snapshot(root: Path = ROOT) -> dict[str, str] | None:
    """Content hash of every tracked file (None when git or the work tree is not available)."""
    try:
        res = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=False)
    except OSError:
        return None
    if res.returncode != 0:
        return None
    snap = {}
    for rel in res.stdout.decode().split("\0"):
        path = root / rel
        if rel and path.is_file():
            snap[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif rel:
            snap[rel] = "missing"
    return snap


# Run inside each bench process: records every path its Python code opens for writing, renames or removes (audit
# hooks, PEP 578), so that a changed tracked file can be told apart from an edit made by someone else meanwhile.
_WRITE_AUDIT = """
import json, os, sys
_seen = set()
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_EVENTS = {"os.remove": 1, "os.rename": 2, "os.replace": 2, "os.truncate": 1, "os.rmdir": 1, "shutil.rmtree": 1,
           "shutil.copyfile": 2, "shutil.move": 2}
def _add(path):
    if isinstance(path, (str, bytes, os.PathLike)):
        _seen.add(os.path.abspath(os.fsdecode(path)))
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if (any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE)):
            _add(path)
    elif event in _EVENTS:
        for path in args[: _EVENTS[event]]:
            _add(path)
def _dump(log=sys.argv[1]):
    seen = sorted(_seen)
    with open(log, "w") as f:
        json.dump(seen, f)
sys.addaudithook(_hook)
import atexit
atexit.register(_dump)
from rapo_fast.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def _run_quick(name: str, root: Path, env: dict, timeout_s: int) -> tuple[subprocess.CompletedProcess, set[str] | None]:
    """`rapo-fast bench NAME --quick` in a child process; also the absolute paths its Python code wrote (None when
    the record is missing, e.g. the process was killed)."""
    with tempfile.TemporaryDirectory(prefix="check_layout_") as scratch:
        log = Path(scratch) / "written.json"
        cmd = [sys.executable, "-c", _WRITE_AUDIT, str(log), "bench", name, "--quick"]
        res = subprocess.run(
            cmd,
            cwd=root,
            env={**env, "TMPDIR": scratch},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        written = set(json.loads(log.read_text())) if log.exists() else None
    return res, written


def bench_findings(
    names: list[str] | None = None, root: Path = ROOT, timeout_s: int = 900
) -> tuple[list[str], list[str]] | None:
    """Run `rapo-fast bench NAME --quick` for each benchmark: (findings, notes), or None when git is unavailable.

    A finding: a run that fails, or a tracked file whose content changed during a run and that the run's process
    wrote (or any changed tracked file when the run's write record is missing). A note: a tracked file that changed
    during a run but that the run never opened for writing (an edit made meanwhile by someone else). Tracked files are
    compared by the content hash of every file `git ls-files` lists, so a file already modified before the run counts
    too. The runs' temporary folders go to a scratch folder removed afterwards; Triton is switched off (the CPU rows
    time the fallback paths, not Triton's interpreter)."""
    sys.path.insert(0, str(root))
    try:
        from rapo_fast.cli import BENCHES
    finally:
        sys.path.remove(str(root))
    if tracked_snapshot(root) is None:
        return None
    findings: list[str] = []
    notes: list[str] = []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["RAPO_FAST_DISABLE_TRITON"] = "1"
    for name in names or list(BENCHES):
        before = tracked_snapshot(root) or {}
        res, written = _run_quick(name, root, env, timeout_s)
        after = tracked_snapshot(root) or {}
        run = f"`rapo-fast bench {name} --quick`"
        if res.returncode != 0:
            tail = " | ".join((res.stdout + res.stderr).strip().splitlines()[-3:])
            findings.append(f"bench-quick-failed: {run} exited {res.returncode}: {tail}")
        wrote = {Path(p).resolve() for p in written or ()}
        for rel in sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)):
            if written is None or (root / rel).resolve() in wrote:
                findings.append(f"bench-changed-tracked-file: {rel}: written by {run}")
            else:
                notes.append(f"note: {rel} changed while {run} ran, but that run never opened it for writing")
    return findings, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/check_layout.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--benches",
        action="store_true",
        help="also run every benchmark's --quick (minutes) and fail if a tracked file changed during a run",
    )
    args = p.parse_args(argv)
    findings = static_findings()
    if args.benches:
        bench = bench_findings()
        if bench is None:
            print("note: git unavailable, the quick-bench check was skipped")
        else:
            findings += bench[0]
            print("\n".join(bench[1]) if bench[1] else "note: no tracked file changed during the quick runs")
    for f in [*module_size_warnings(python_files()), *findings]:
        print(f)
    print(f"check_layout: {len(findings)} finding(s)" if findings else "check_layout: the layout holds")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
