"""A ``JobConfig`` to and from nested plain values (what YAML and JSON hold), with the type
coercion that names the field: ``moe.top_k ('abc') must be an int``.

Both the YAML loader (``moetrain.config.loader``) and the DeepSpeed import
(``moetrain.config.deepspeed``) build their configs here; so do exports, one section at a time
(``build_section``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from moetrain.config.base import require
from moetrain.config.job import JobConfig
from moetrain.config.log import ROUTING_TRACES
from moetrain.config.presets import get_preset


def _section_classes() -> dict[str, type]:
    sections: dict[str, type] = {}
    for f in dataclasses.fields(JobConfig):
        assert isinstance(f.default_factory, type), f"JobConfig.{f.name} is built by its section's class"
        sections[f.name] = f.default_factory
    return sections


SECTIONS: dict[str, type] = _section_classes()
"""Section name -> dataclass, in the order of ``JobConfig``."""

NULLS = ("null", "none", "~")
"""Text that means None for a field that may be None."""


def config_from_dict(raw: Mapping[str, Any]) -> JobConfig:
    """Build and validate a ``JobConfig`` from nested plain values (as read from YAML).

    ``model.preset`` names a preset whose model and moe values come first; every value given in
    ``raw`` overrides them."""
    require_mapping("config", raw)
    for section, values in raw.items():
        cls = section_class(section, where="config")
        require_mapping(section, values)
        for name in values or {}:
            field_type(cls, section, name, where="config")
    merged = {section: dict(raw.get(section) or {}) for section in SECTIONS}
    preset = merged["model"].get("preset")
    if preset is not None:
        for section, values in preset_dicts(preset).items():
            merged[section] = {**values, **merged[section]}
    return JobConfig(**{section: build_section(cls, section, merged[section]) for section, cls in SECTIONS.items()})


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Nested plain dict of every field (tuples become lists), YAML/JSON ready."""
    return {section: {f.name: _plain(getattr(getattr(cfg, section), f.name))
                      for f in dataclasses.fields(getattr(cfg, section))}
            for section in SECTIONS}


def build_section(cls: type, section: str, values: Mapping[str, Any]):
    """``cls(**values)`` (one section's dataclass) with every value coerced to its field's
    annotation first; ``ValueError`` naming ``<section>.<field>`` for a value of the wrong type."""
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(f"{section}.{name}", value, hints[name]) for name, value in values.items()}
    return cls(**kwargs)


def require_mapping(where: str, value: Any) -> None:
    require(value is None or isinstance(value, Mapping), where, value, "must be a mapping of fields")


def section_class(section: str, *, where: str) -> type:
    """The dataclass of ``section``; ``ValueError`` listing the sections otherwise."""
    if section not in SECTIONS:
        raise ValueError(f"{where}: unknown config section {section!r}; "
                         f"valid sections: {', '.join(SECTIONS)}")
    return SECTIONS[section]


def field_type(cls: type, section: str, name: str, *, where: str) -> Any:
    """The annotation of field ``name`` of ``cls``; ``ValueError`` listing the fields otherwise."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if name not in names:
        raise ValueError(f"{where}: unknown field {section}.{name}; "
                         f"valid fields of {section}: {', '.join(names)}")
    return hints[name]


def unwrap_optional(hint: Any) -> tuple[bool, Any]:
    """``(True, T)`` for ``T | None``, ``(False, T)`` for ``T``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, f"config fields are T or T | None, not {hint}"
        return True, args[0]
    return False, hint


# --- internals ----------------------------------------------------------------------------------


def preset_dicts(name: Any) -> dict[str, dict[str, Any]]:
    """The model and moe values of preset ``name`` (every field but model.preset), by section."""
    p = get_preset(name)
    model = {k: v for k, v in dataclasses.asdict(p.model).items() if k != "preset"}
    return {"model": model, "moe": dataclasses.asdict(p.moe)}


def _coerce(field: str, value: Any, hint: Any) -> Any:
    """``value`` converted to the annotated type, or ValueError naming the field."""
    optional, tp = unwrap_optional(hint)
    if value is None or (optional and tp is not str and isinstance(value, str) and value.lower() in NULLS):
        if optional:
            return None
        raise ValueError(f"{field} ({value!r}) must not be null")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _as_float(value)  # 5e8 in JSON / "5e8" in YAML 1.1 are whole numbers too
        if number is not None and number.is_integer():
            return int(number)
    elif tp is float:
        number = _as_float(value)  # PyYAML reads 3e-4 (no dot) as a string
        if number is not None:
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool):
            return _bool_word(field, value)
    elif typing.get_origin(tp) is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        if isinstance(value, (list, tuple)):  # tuple[T, ...]: a list of any length
            return tuple(_coerce(f"{field}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value))
    elif typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_coerce(f"{field}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):  # a mapping of the dataclass's fields, e.g. one of data.sources
            for name in value:
                field_type(tp, field, name, where=field)
            return build_section(tp, field, value)
    else:
        raise AssertionError(f"unsupported config annotation {hint} of {field}")
    raise ValueError(f"{field} ({value!r}) must be {_type_name(hint)}")


BOOL_WORD_CHOICES: dict[str, tuple[str, ...]] = {"log.routing_trace": ROUTING_TRACES}
"""String fields whose choices hold "off" or "on": YAML 1.1 reads the unquoted words as booleans."""


def _bool_word(field: str, value: bool) -> str:
    """``off``/``on`` for a string field that YAML read as false/true, where the word is one of the
    field's choices; else ValueError asking for quotes."""
    choices = BOOL_WORD_CHOICES.get(field, ())
    word = "on" if value else "off"
    if word in choices:
        return word
    listed = f" (one of {', '.join(map(repr, choices))})" if choices else ""
    raise ValueError(f"{field} ({value!r}) must be a string{listed}: YAML reads unquoted yes/no/on/off/true/false "
                     "as a boolean; write the value quoted")


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _type_name(hint: Any) -> str:
    optional, tp = unwrap_optional(hint)
    if typing.get_origin(tp) is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        name = f"a list of {_type_name(typing.get_args(tp)[0])}"
    elif dataclasses.is_dataclass(tp):
        name = "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp))
    elif typing.get_origin(tp) is tuple:
        name = "a list [" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    else:
        name = {bool: "true or false", int: "an int", float: "a number", str: "a string"}[tp]
    return name + (" or null" if optional else "")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value
