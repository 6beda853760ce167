"""Loading, overriding, saving and printing a ``JobConfig``.

A job is a YAML file of sections (``model:``, ``moe:``, ``train:`` ...) plus command-line
overrides ``--section.field=value``. Values are parsed as YAML scalars and checked against the
dataclass annotations, so ``--moe.top_k=abc`` fails naming ``moe.top_k``. ``model.preset`` names a
preset whose model and moe values come first; everything written in the file or on the command
line overrides them. The saved config has every field resolved and loads back to an equal config.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from moetrain.config.base import require
from moetrain.config.job import JobConfig

SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
"""Section name -> dataclass, in the order of ``JobConfig``."""

_NULLS = ("null", "none", "~")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                deepspeed: str | Path | Mapping | None = None, world_size: int | None = None) -> JobConfig:
    """The job described by the YAML file at ``path`` (None = all defaults), with ``overrides``
    (``["--train.steps=100", "--model.preset=tiny"]``) applied on top.

    ``deepspeed`` (a JSON path or an already parsed dict) is applied last, for ``world_size``
    processes; see ``moetrain.config.deepspeed.apply_deepspeed_config``.
    """
    raw = _read_yaml(path) if path is not None else {}
    for section, name, value in parse_overrides(overrides):
        raw.setdefault(section, {})[name] = value
    cfg = config_from_dict(raw)
    if deepspeed is not None:
        from moetrain.config.deepspeed import apply_deepspeed_config, load_deepspeed_config

        if world_size is None:
            raise ValueError("world_size (None) must be given with a DeepSpeed config "
                             "(its batch sizes are per rank)")
        ds = deepspeed if isinstance(deepspeed, Mapping) else load_deepspeed_config(deepspeed)
        cfg = apply_deepspeed_config(cfg, ds, world_size=world_size)
    return cfg


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str, Any]]:
    """``["--train.steps=100"]`` -> ``[("train", "steps", 100)]``.

    Accepts ``--a.b=v``, ``a.b=v`` and ``--a.b v``. Values are YAML scalars (``null``, ``true``,
    ``[0.9, 0.95]``), except for string fields, which take the text as written. Section and field
    names are checked here; value types when the config is built.
    """
    items, out, i = list(overrides), [], 0
    while i < len(items):
        item = items[i]
        key, sep, text = item.lstrip("-").partition("=")
        if not sep:
            if i + 1 < len(items) and not items[i + 1].startswith("--"):
                text, i = items[i + 1], i + 1
            else:
                raise ValueError(f"override {item!r} must look like --section.field=value")
        i += 1
        section, dot, name = key.partition(".")
        if not dot or not name:
            raise ValueError(f"override {item!r} must look like --section.field=value")
        hint = _field_types(_section_cls(section, where=f"override {item!r}"), section, name,
                            where=f"override {item!r}")
        out.append((section, name, _parse_text(text, hint)))
    return out


def config_from_dict(raw: Mapping[str, Any]) -> JobConfig:
    """Build and validate a ``JobConfig`` from nested plain values (as read from YAML)."""
    require_mapping("config", raw)
    for section, values in raw.items():
        cls = _section_cls(section, where="config")
        require_mapping(section, values)
        for name in values or {}:
            _field_types(cls, section, name, where="config")
    merged = {section: dict(raw.get(section) or {}) for section in SECTIONS}
    preset = merged["model"].get("preset")
    if preset is not None:
        for section, values in _preset_dicts(preset).items():
            merged[section] = {**values, **merged[section]}
    return JobConfig(**{section: _build(cls, section, merged[section]) for section, cls in SECTIONS.items()})


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Nested plain dict of every field (tuples become lists), YAML/JSON ready."""
    return {section: {f.name: _plain(getattr(getattr(cfg, section), f.name))
                      for f in dataclasses.fields(getattr(cfg, section))}
            for section in SECTIONS}


def save_config(cfg: JobConfig, path: str | Path) -> None:
    """Write the fully resolved config as YAML; ``load_config(path)`` gives back an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Resolved moetrain config: moetrain train --config " + str(path) + "\n"
                    + yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def format_config(cfg: JobConfig) -> str:
    """One ``section.field = value`` line per field; fields that differ from the defaults are
    marked with ``*``."""
    default = config_to_dict(JobConfig())
    lines = []
    for section, values in config_to_dict(cfg).items():
        width = max(len(section) + 1 + len(name) for name in values)
        for name, value in values.items():
            mark = "*" if value != default[section][name] else " "
            lines.append(f"{mark} {section + '.' + name:<{width}} = {value!r}")
    return "\n".join(lines)


def require_mapping(where: str, value: Any) -> None:
    require(value is None or isinstance(value, Mapping), where, value, "must be a mapping of fields")


# --- internals ----------------------------------------------------------------------------------


def _read_yaml(path: str | Path) -> dict:
    text = Path(path).read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if raw is None:
        return {}
    require(isinstance(raw, dict), f"config file {str(path)!r}", type(raw).__name__,
            "must hold a mapping of sections")
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def _section_cls(section: str, *, where: str) -> type:
    if section not in SECTIONS:
        raise ValueError(f"{where}: unknown config section {section!r}; "
                         f"valid sections: {', '.join(SECTIONS)}")
    return SECTIONS[section]


def _field_types(cls: type, section: str, name: str, *, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if name not in names:
        raise ValueError(f"{where}: unknown field {section}.{name}; "
                         f"valid fields of {section}: {', '.join(names)}")
    return hints[name]


def _preset_dicts(name: Any) -> dict[str, dict[str, Any]]:
    from moetrain.models.presets import get_preset  # lazy: presets import the config classes

    p = get_preset(name)
    model = {k: v for k, v in dataclasses.asdict(p.model).items() if k != "preset"}
    return {"model": model, "moe": dataclasses.asdict(p.moe)}


def _build(cls: type, section: str, values: Mapping[str, Any]):
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(f"{section}.{name}", value, hints[name]) for name, value in values.items()}
    return cls(**kwargs)


def _parse_text(text: str, hint: Any) -> Any:
    """A command-line value: the raw text for string fields, else a YAML scalar."""
    optional, inner = _unwrap_optional(hint)
    if inner is str:
        return None if optional and text.strip().lower() in _NULLS + ("",) else text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # reported with the field name by _coerce


def _unwrap_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, f"config fields are T or T | None, not {hint}"
        return True, args[0]
    return False, hint


def _coerce(field: str, value: Any, hint: Any) -> Any:
    """``value`` converted to the annotated type, or ValueError naming the field."""
    optional, tp = _unwrap_optional(hint)
    if value is None or (optional and tp is not str and isinstance(value, str) and value.lower() in _NULLS):
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
    elif typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_coerce(f"{field}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    else:
        raise AssertionError(f"unsupported config annotation {hint} of {field}")
    raise ValueError(f"{field} ({value!r}) must be {_type_name(hint)}")


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
    optional, tp = _unwrap_optional(hint)
    if typing.get_origin(tp) is tuple:
        name = "a list [" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    else:
        name = {bool: "true or false", int: "an int", float: "a number", str: "a string"}[tp]
    return name + (" or null" if optional else "")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
