"""Configuration sections: dataclasses whose fields carry their own check, built from (nested) mappings, with the
dotted path of the field in every error ("rollout.arpo.beam: expected an int in [1, inf], got 0").

What this is: `Section` (the base of RolloutConfig and its sub-configs, and of TrainerConfig and its sections), the
field makers `option` / `section`, the rule makers `rule_int`, `rule_real`, `rule_choice`, `rule_type`, and
`expand_dotted` ({"a.b": 1} -> {"a": {"b": 1}}). A mapping given for a sub-section updates it field by field (unknown
keys refused, naming them); an object replaces it. What this is not: any particular configuration
(rapo_fast/rollouts/config.py, rapo_fast/train/config.py) or the checks of function arguments (rapo_fast/_checks.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from rapo_fast import _checks as C

Rule = Callable[[str, Any], None]


def rule_int(lo: int, hi: int | None = None, allow_none: bool = False) -> Rule:
    """An int (bool refused) in [lo, hi]."""

    def check(name: str, v: Any) -> None:
        if v is None and allow_none:
            return
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__} {C.brief(v)}")
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"{name}: expected an int in [{lo}, {hi if hi is not None else 'inf'}], got {C.brief(v)}")

    return check


def rule_real(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
              allow_none: bool = False) -> Rule:  # fmt: skip
    """A finite real number (bool refused) in [lo, hi], or (lo, hi] with lo_open: rapo_fast._checks.check_float."""
    bounds = dict(min_value=lo, max_value=hi, min_inclusive=not lo_open, allow_none=allow_none)
    return lambda name, v: C.check_float(name, v, **bounds)


def rule_choice(*choices: str) -> Rule:
    return lambda name, v: C.check_choice(name, v, choices)


def rule_type(kinds: tuple[type, ...], what: str) -> Rule:
    def check(name: str, v: Any) -> None:
        if not isinstance(v, kinds):
            raise TypeError(f"{name}: expected {what}, got {type(v).__name__} {C.brief(v)}")

    return check


def option(default: Any, check: Rule) -> Any:
    """A field with its default and its check (called with the field's dotted path and value)."""
    return dataclasses.field(default=default, metadata={"check": check})


def section(cls: type[Section]) -> Any:
    """A field holding a sub-section (default: cls()); a mapping given for it updates the default."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


def expand_dotted(d: Mapping[str, Any]) -> dict[str, Any]:
    """{"rollout.arpo.beam": 3, "seed": 1} -> {"rollout": {"arpo": {"beam": 3}}, "seed": 1} (later keys win)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if not isinstance(key, str):
            raise TypeError(f"config keys must be strings, got {type(key).__name__} {C.brief(key)}")
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            nxt = node.get(p)
            node[p] = nxt = dict(nxt) if isinstance(nxt, Mapping) else {}
            node = nxt
        if isinstance(value, Mapping) and isinstance(node.get(leaf), Mapping):
            value = {**node[leaf], **expand_dotted(value)}
        node[leaf] = value
    return out


class Section:
    """Base of a configuration dataclass; PATH is its dotted place ("" for a root). Validated on construction."""

    PATH: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Mapping) and ("section" in f.metadata or "coerce" in f.metadata):
                object.__setattr__(self, f.name, self.coerce(f, f.default_factory(), value))  # type: ignore[misc]
        self.validate()

    def path(self, name: str) -> str:
        return f"{self.PATH}.{name}" if self.PATH else name

    def coerce(self, f: dataclasses.Field, current: Any, value: Mapping) -> Any:
        """A mapping given for field f: the update of its current value (a sub-section) by it."""
        if "section" in f.metadata:
            return current.replace(value)
        return f.metadata["coerce"](current, value)

    def validate(self) -> Section:
        """Check every field (its rule; a sub-section's type), then the rules across fields; return self."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if "check" in f.metadata:
                f.metadata["check"](self.path(f.name), value)
            elif "section" in f.metadata and not isinstance(value, f.metadata["section"]):
                want = f.metadata["section"].__name__
                raise TypeError(f"{self.path(f.name)}: expected a {want} or a dict, got {type(value).__name__}")
        self.check_together()
        return self

    def check_together(self) -> None:
        """Rules across fields (overridden by sections that have some)."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = f.metadata["to_dict"](v) if "to_dict" in f.metadata else v
            if isinstance(v, Section):
                out[f.name] = v.to_dict()
        return out

    def replace(self, changes: Mapping[str, Any] | None = None, /, **kw: Any) -> Any:
        """A copy with `changes` (a mapping, dotted keys allowed: {"arpo.beam": 3}) and keywords applied, checked. A
        mapping for a sub-section updates it field by field; an object replaces it. Unknown keys raise ValueError."""
        if changes is not None and not isinstance(changes, Mapping):
            raise TypeError(f"{self.PATH or type(self).__name__}: expected a dict, got {type(changes).__name__}")
        merged = expand_dotted({**(changes or {}), **kw})
        fields = {f.name: f for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        unknown = sorted(set(merged) - set(fields))
        if unknown:
            where = self.PATH or type(self).__name__
            raise ValueError(f"{where}: unknown fields {unknown}; expected a subset of {sorted(fields)}")
        new = {}
        for name, value in merged.items():
            f = fields[name]
            if isinstance(value, Mapping) and ("section" in f.metadata or "coerce" in f.metadata):
                value = self.coerce(f, getattr(self, name), value)
            new[name] = value
        return dataclasses.replace(self, **new)  # type: ignore[type-var]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        """The default section updated by `d` (see replace)."""
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.PATH or cls.__name__}.from_dict: expected a dict, got {type(d).__name__}")
        return cls().replace(d)
