"""The repository's layout rules (tools/check_layout.py): no import cycle, no module over 800 lines (a warning over
500), no function over 80 lines, no module docstring over 12 lines in rapo_fast/, the library never
imports the demo, no `_private` name used across packages, and no tracked file changed by a `--quick` benchmark
run. The first tests
check that the checker itself catches each rule on a small made-up tree, so that a passing layout test means the
rules hold, not that the checker is blind.
What this is not: a behaviour test of any op.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_layout", mod)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


CL = _checker()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    root = _tree(
        tmp_path,
        {
            "rapo_fast/__init__.py": "",
            "rapo_fast/loss/__init__.py": '"""doc"""\n',
            "rapo_fast/loss/a.py": "from rapo_fast.loss import b\n",
            "rapo_fast/loss/b.py": "def f():\n    from .a import thing\n    return thing\n",
            "rapo_fast/loss/c.py": "import rapo_fast.loss.a\nfrom rapo_fast.loss import b\n",  # no cycle through c
            "rapo_fast/kernels/__init__.py": "",
        },
    )
    found = CL.static_findings(root)
    cycles = [f for f in found if f.startswith("import-cycle")]
    assert len(cycles) == 1, found
    assert "rapo_fast.loss.a -> rapo_fast.loss.b -> rapo_fast.loss.a" in cycles[0]
    assert "rapo_fast/loss/b.py:2 (inside f())" in cycles[0] and "rapo_fast/loss/a.py:1" in cycles[0]


def test_checker_resolves_packages_and_skips_implicit_parent_imports(tmp_path):
    # rapo_fast/__init__ imports its subpackage and the subpackage module imports a name of the top package: that is a
    # cycle (package module <-> module); importing rapo_fast.kernels.x alone (implicitly running rapo_fast/__init__)
    # is not.
    root = _tree(
        tmp_path,
        {
            "rapo_fast/__init__.py": "from rapo_fast.loss.a import f\n",
            "rapo_fast/loss/__init__.py": "",
            "rapo_fast/loss/a.py": "import rapo_fast.kernels.x\n\ndef f():\n    from rapo_fast import g\n",
            "rapo_fast/kernels/__init__.py": "",
            "rapo_fast/kernels/x.py": "",
        },
    )
    cycles = [f for f in CL.static_findings(root) if f.startswith("import-cycle")]
    assert len(cycles) == 1 and "rapo_fast -> rapo_fast.loss.a -> rapo_fast" in cycles[0], cycles


def test_checker_finds_demo_imports_private_names_and_sizes(tmp_path):
    long_fn = "def big():\n    '''doc\n    more doc'''\n" + "    x = 1\n" * 81
    root = _tree(
        tmp_path,
        {
            "rapo_fast/__init__.py": "",
            "rapo_fast/cli.py": "def main():\n    from rapo_fast.demo import main\n",  # the router: allowed
            "rapo_fast/train/__init__.py": "",
            "rapo_fast/train/t.py": "def f():\n    from rapo_fast.demo.tiny import helper\n",
            "rapo_fast/train/u.py": "from rapo_fast.loss.a import _secret, public\nfrom rapo_fast.loss import a as la\n"
            "la._other()\nimport rapo_fast.cli\n",
            "rapo_fast/loss/__init__.py": "",
            "rapo_fast/loss/a.py": "_secret = 1\npublic = 2\n",
            "rapo_fast/loss/b.py": "from rapo_fast.loss.a import _secret\n",  # same package: fine
            "rapo_fast/demo/__init__.py": "",
            "rapo_fast/demo/tiny.py": "def helper(): pass\n",
            "rapo_fast/demo/long.py": "\n" * 801,
            "rapo_fast/demo/longish.py": "\n" * 501,  # a warning only
            "rapo_fast/kernels/__init__.py": "",
            "tools/long_fn.py": long_fn,
        },
    )
    found = CL.static_findings(root)
    text = "\n".join(found)
    demo = "library-imports-demo: rapo_fast/train/t.py:2 (inside f()): rapo_fast.train.t imports rapo_fast.demo.tiny"
    assert demo in text
    assert "rapo_fast/train/u.py:4: rapo_fast.train.u imports rapo_fast.cli, which imports the demo" in text
    assert "rapo_fast/cli.py" not in text
    assert "private-name: rapo_fast/train/u.py:1: rapo_fast.train.u imports _secret from rapo_fast.loss.a" in text
    assert "private-name: rapo_fast/train/u.py:3: rapo_fast.train.u uses rapo_fast.loss.a._other" in text
    assert "rapo_fast/loss/b.py" not in text
    assert "module-too-long: rapo_fast/demo/long.py: 801 lines" in text and "longish" not in text
    warned = CL.module_size_warnings(CL.python_files(root), root)
    assert warned == ["module-long: rapo_fast/demo/longish.py: 501 lines (over 500; at most 800)"], warned
    assert "function-too-long: tools/long_fn.py:1: big() has 82 lines without its docstring" in text
    assert len(found) == 6, found


def test_checker_finds_long_module_docstrings_in_the_library_only(tmp_path):
    doc = '"""' + "line\n" * 12 + '"""\n'  # 13 lines: the closing quotes sit on a line of their own
    root = _tree(
        tmp_path,
        {
            "rapo_fast/__init__.py": "",
            "rapo_fast/long_doc.py": doc,
            "rapo_fast/ok_doc.py": '"""' + "line\n" * 11 + '"""\n',
            "rapo_fast/kernels/__init__.py": doc,
            "tools/long_doc.py": doc,  # outside the library: not checked
        },
    )
    found = [f for f in CL.static_findings(root) if f.startswith("module-docstring-too-long")]
    assert len(found) == 2, found
    assert any(f.startswith("module-docstring-too-long: rapo_fast/long_doc.py:1: 13 lines") for f in found), found
    assert any(f.startswith("module-docstring-too-long: rapo_fast/kernels/__init__.py:1: 13 lines") for f in found), (
        found
    )


def test_layout_holds():
    """The rules hold on this repository (each finding names the rule, the file and the line); a module over 500
    lines is a warning."""
    for w in CL.module_size_warnings(CL.python_files()):
        warnings.warn(w, stacklevel=1)
    findings = CL.static_findings()
    assert not findings, "tools/check_layout.py found:\n" + "\n".join(findings)


def test_kernels_import_only_kernels_and_shared_constants():
    """Arrows run down: the Triton kernels (rapo_fast/kernels/) import only other kernel modules and
    rapo_fast._constants, never the launchers above them (rapo_fast/loss/, rapo_fast/retrieval/, ...): what both need
    (codes, layouts, option vocabularies) sits in rapo_fast/kernels/ or rapo_fast/_constants.py."""
    edges = CL.import_edges(CL.library_modules())
    kernel_edges = [e for e, _ in edges if e.src.startswith("rapo_fast.kernels")]
    assert any(e.dst == "rapo_fast._constants" for e in kernel_edges), "the check sees no kernel import at all"
    allowed = ("rapo_fast.kernels", "rapo_fast._constants")
    bad = sorted({f"{e.where()}: {e.src} imports {e.dst}" for e in kernel_edges if not e.dst.startswith(allowed)})
    assert not bad, "\n".join(bad)


def test_tests_import_helpers_not_tests_package():
    """Test modules import their helpers as `helpers...` (tests/ is on sys.path through the rootdir conftest), never
    as `tests.helpers...`: verl 0.9.1 and transferqueue install a top-level `tests` package in site-packages, so once
    the verl extra is installed (.ci/run's verl stage; CI reuses that environment) `tests` is theirs, not ours."""
    import ast

    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad = [n for n in names if n == "tests" or n.startswith("tests.")]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {n}" for n in bad]
    assert not found, "import the helpers as `helpers...`:\n" + "\n".join(found)


def test_quick_benchmarks_leave_tracked_files_alone():
    """Every `rapo-fast bench NAME --quick` runs and changes no tracked file (runs each quick benchmark: minutes)."""
    if shutil.which("git") is None or CL.tracked_snapshot() is None:
        pytest.skip("git or the git work tree is not available: nothing to compare tracked files with")
    findings, notes = CL.bench_findings()
    print("\n".join(notes))  # edits made meanwhile by others on a shared checkout: not the benches' doing
    assert not findings, "tools/check_layout.py --benches found:\n" + "\n".join(findings)
