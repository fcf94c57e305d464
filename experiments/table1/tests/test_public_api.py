"""The experiment uses rapo_fast's public API only: every import of rapo_fast in experiments/ names a public module
(no `_`-prefixed part: rapo_fast._checks, rapo_fast._tokens, ... are the library's internals) and public names (no
`_x`; from the top package only names in rapo_fast.__all__), and no `_x` attribute is read off a rapo_fast module.
Checked on the source with ast, and the checker first on made-up sources that break each rule."""

from __future__ import annotations

import ast
from pathlib import Path

import rapo_fast

EXPERIMENTS = Path(__file__).resolve().parents[2]


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def violations(source: str, where: str = "<src>") -> list[str]:
    """Each use of rapo_fast's private API in `source`, as `where:line: what`."""
    out: list[str] = []
    bound: set[str] = set()  # local names bound to a rapo_fast module or package
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "rapo_fast":
                    if _private(a.name):
                        out.append(f"{where}:{node.lineno}: import {a.name}")
                    bound.add(a.asname or "rapo_fast")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rapo_fast":
            mod = node.module or ""
            if _private(mod):
                out.append(f"{where}:{node.lineno}: from {mod} import ...")
                continue
            for a in node.names:
                if a.name.startswith("_") or (mod == "rapo_fast" and a.name not in rapo_fast.__all__):
                    out.append(f"{where}:{node.lineno}: from {mod} import {a.name}")
                else:
                    bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in bound:
                out.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


def test_the_checker_catches_each_kind_of_private_use():
    bad = {
        "import rapo_fast._checks": "import rapo_fast._checks",
        "from rapo_fast._tokens import encode_plain": "from rapo_fast._tokens",
        "from rapo_fast.train.sft import _collate": "import _collate",
        "from rapo_fast import build_info, _PUBLIC": "import _PUBLIC",
        "from rapo_fast import loss": "from rapo_fast import loss",  # a subpackage, not in __all__: import it by path
        "from rapo_fast.train import sft\nsft._collate([], 0)": "sft._collate",
        "import rapo_fast.train.trainer as T\nT._sigterm_flag(True)": "T._sigterm_flag",
    }
    for src, what in bad.items():
        found = violations(src)
        assert len(found) == 1 and what in found[0], (src, found)
    ok = (
        "import rapo_fast\nfrom rapo_fast import RAPOTrainer, TrainerConfig\n"
        "from rapo_fast.train.sft import sft_warmup\nfrom rapo_fast.demo.tasks import write_jsonl\n"
        "from experiments.table1 import _private_of_the_experiment\nx._y\nrapo_fast.__version__\n"
    )
    assert violations(ok) == []


def test_the_experiment_uses_the_public_api_only():
    files = sorted(EXPERIMENTS.rglob("*.py"))
    assert len(files) > 15 and any(p.name == "families.py" for p in files)  # the walk sees the experiment
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(EXPERIMENTS.parent)))]
    assert found == []
