"""Checked configuration: dataclasses whose fields carry their own check, built from (nested) mappings, with the
dotted path of the field in every error ("rollout.arpo.beam: expected an int in [1, inf], got 0").

What this is: `Section`, the one base of every options / config object of the package (tests/test_config_base.py
finds them all), the field makers `option` / `section`, the `rule_*` makers and `expand_dotted`.
What this is not: any particular configuration (rapo_fast/rollouts/config.py, rapo_fast/train/config.py,
rapo_fast/loss/options.py) or the checks of function arguments (rapo_fast/_checks.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

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


def rule_real(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, allow_none: bool = False
) -> Rule:
    """A finite real number (bool refused) in [lo, hi], or (lo, hi] with lo_open: rapo_fast._checks.check_float."""
    bounds = dict(min_value=lo, max_value=hi, min_inclusive=not lo_open, allow_none=allow_none)
    return lambda name, v: C.check_float(name, v, **bounds)


def rule_choice(*choices: str) -> Rule:
    return lambda name, v: C.check_choice(name, v, choices)


def rule_bool(allow_none: bool = False) -> Rule:
    """A bool (or None)."""
    return rule_type((bool, type(None)), "a bool or None") if allow_none else rule_type((bool,), "a bool")


def rule_type(kinds: tuple[type, ...], what: str) -> Rule:
    def check(name: str, v: Any) -> None:
        if not isinstance(v, kinds):
            raise TypeError(f"{name}: expected {what}, got {type(v).__name__} {C.brief(v)}")

    return check


def option(default: Any, check: Rule, **metadata: Any) -> Any:
    """A field with its default and its check (called with the field's dotted path and value); `metadata`: what
    else a reader of the fields needs (LossOptions: how the kernels take the option)."""
    return dataclasses.field(default=default, metadata={"check": check, **metadata})


def section(cls: type[Section]) -> Any:
    """A field holding a sub-section (default: cls()); a mapping given for it updates the default."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


def expand_dotted(d: Mapping[str, Any]) -> dict[str, Any]:
    """{"rollout.arpo.beam": 3, "seed": 1} -> {"rollout": {"arpo": {"beam": 3}}, "seed": 1} (later keys win)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if not isinstance(key, str):
            raise TypeError(f"config keys: expected strings, got {type(key).__name__} {C.brief(key)}")
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


class _Field(NamedTuple):
    """What Section does with one field, read once from its dataclass field (see Section.plan)."""

    name: str
    check: Rule | None
    section: type | None  # a sub-section's class
    coerce: Callable[[Any, Mapping], Any] | None  # (current value, a mapping given for the field) -> its value
    factory: Callable[[], Any] | None  # the default of a field that has a coerce
    to_dict: Callable[[Any], Any] | None


class Section:
    """Base of a configuration dataclass; PATH is its dotted place ("" for a root). Validated on construction."""

    PATH: ClassVar[str] = ""
    _plan: ClassVar[tuple[type, tuple[_Field, ...]] | None] = None

    @classmethod
    def plan(cls) -> tuple[_Field, ...]:
        """The fields as Section reads them, computed on the first call and kept on the class: no method reads
        dataclasses.fields() after that, which torch.compile cannot trace (LossOptions is built in compiled code)."""
        if cls._plan is None or cls._plan[0] is not cls:  # a subclass of a section has its own fields
            fields = []
            for f in dataclasses.fields(cls):  # type: ignore[arg-type]
                m = f.metadata
                sub = m.get("section")
                coerce = m.get("coerce") or ((lambda current, value: current.replace(value)) if sub else None)
                factory = f.default_factory if coerce else None
                fields.append(_Field(f.name, m.get("check"), sub, coerce, factory, m.get("to_dict")))
            cls._plan = (cls, tuple(fields))
        return cls._plan[1]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls.plan())

    def __post_init__(self) -> None:
        for f in self.plan():
            value = getattr(self, f.name)
            if f.coerce is not None and isinstance(value, Mapping):
                object.__setattr__(self, f.name, f.coerce(f.factory(), value))
        self.validate()

    def path(self, name: str) -> str:
        return f"{self.PATH}.{name}" if self.PATH else name

    def validate(self) -> Any:
        """Check every field (its rule; a sub-section's type), then the rules across fields; return self."""
        for f in self.plan():
            value = getattr(self, f.name)
            if f.check is not None:
                f.check(self.path(f.name), value)
            elif f.section is not None and not isinstance(value, f.section):
                raise TypeError(
                    f"{self.path(f.name)}: expected a {f.section.__name__} or a dict, got {type(value).__name__}"
                )
        self.check_together()
        return self

    def check_together(self) -> None:
        """Rules across fields (overridden by sections that have some)."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in self.plan():
            v = getattr(self, f.name)
            out[f.name] = f.to_dict(v) if f.to_dict else v.to_dict() if isinstance(v, Section) else v
        return out

    def replace(self, changes: Mapping[str, Any] | None = None, /, **kw: Any) -> Any:
        """A copy with `changes` (a mapping, dotted keys allowed: {"arpo.beam": 3}) and keywords applied, checked. A
        mapping for a sub-section updates it field by field; an object replaces it. Unknown keys raise ValueError."""
        if changes is not None and not isinstance(changes, Mapping):
            raise TypeError(f"{self.PATH or type(self).__name__}: expected a dict, got {type(changes).__name__}")
        merged = expand_dotted({**(changes or {}), **kw}) if changes else kw
        plan = {f.name: f for f in self.plan()}
        unknown = sorted(set(merged) - set(plan))
        if unknown:
            where = self.PATH or type(self).__name__
            raise ValueError(f"{where}: expected fields among {sorted(plan)}, got unknown fields {unknown}")
        values = {name: getattr(self, name) for name in plan}
        for name, value in merged.items():
            coerce = plan[name].coerce
            values[name] = coerce(values[name], value) if coerce is not None and isinstance(value, Mapping) else value
        return type(self)(**values)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        """The default section updated by `d` (see replace)."""
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.PATH or cls.__name__}.from_dict: expected a dict, got {type(d).__name__}")
        return cls().replace(d)
