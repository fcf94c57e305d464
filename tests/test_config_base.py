"""Every options / config object of rapo_fast derives from the one checked-field base, rapo_fast._sections.Section.

The classes are found, not listed: every class defined in a module of the package (read from the source, so that the
verl and TRL modules count without those packages installed) whose name ends in Config, Options or Settings, or whose
fields are made by Section's `option` / `section` (a dataclass that used them without deriving from Section would
never run its checks). A class derives from Section when one of its bases is Section or such a class. Not here: what
each configuration checks (tests/train, tests/rollouts, tests/loss/test_loss_options.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import rapo_fast

PACKAGE = Path(rapo_fast.__file__).parent
SUFFIXES = ("Config", "Options", "Settings")
FIELD_MAKERS = {"option", "section"}


def _name(node: ast.expr) -> str:
    """The last part of a base's name (Section, _sections.Section -> "Section")."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _uses_field_makers(cls: ast.ClassDef) -> bool:
    for stmt in cls.body:
        value = stmt.value if isinstance(stmt, (ast.AnnAssign, ast.Assign)) else None
        if isinstance(value, ast.Call) and _name(value.func) in FIELD_MAKERS:
            return True
    return False


def _classes() -> dict[str, tuple[str, list[str], bool]]:
    """class name -> (module path, base names, is a config by the rules above), over the whole package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                is_config = node.name.endswith(SUFFIXES) or _uses_field_makers(node)
                key = node.name if node.name not in found else f"{node.name}@{path}"
                found[key] = (str(path.relative_to(PACKAGE.parent)), [_name(b) for b in node.bases], is_config)
    return found


def test_every_config_class_derives_from_section():
    classes = _classes()
    derived = {"Section"}
    grew = True
    while grew:  # the closure of "has a base in derived"
        new = {name for name, (_, bases, _) in classes.items() if derived & set(bases)} - derived
        derived |= new
        grew = bool(new)
    configs = {name: where for name, (where, _, is_config) in classes.items() if is_config and name != "Section"}
    # not vacuous: the loss options, the rollout, trainer and verl loop configurations are found
    assert {"LossOptions", "RolloutConfig", "HybridConfig", "TrainerConfig", "RapoLoopConfig"} <= set(configs)
    stray = sorted(f"{name} ({where})" for name, where in configs.items() if name not in derived)
    assert not stray, f"options / config classes not derived from rapo_fast._sections.Section: {stray}"


def test_section_is_defined_once():
    classes = _classes()
    assert [k for k in classes if k.split("@")[0] == "Section"] == ["Section"]
    assert classes["Section"][0] == "rapo_fast/_sections.py"
