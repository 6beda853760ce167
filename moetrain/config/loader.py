"""Loading, overriding, saving and printing a ``JobConfig``.

A job is a YAML file of sections (``model:``, ``moe:``, ``train:`` ...) plus command-line
overrides ``--section.field=value``. Values are parsed as YAML scalars and checked against the
dataclass annotations, so ``--moe.top_k=abc`` fails naming ``moe.top_k``. ``model.preset`` names a
preset whose model and moe values come first; everything written in the file or on the command
line overrides them. The saved config has every field resolved and loads back to an equal config.
A key written twice in one mapping (a section repeated further down the file) is refused: plain YAML
would keep only the last.

The job files shipped with the package (``moetrain/configs/*.yaml``) load by name as well as by
path: ``load_config("tiny")``, ``moetrain train --config tiny``, or ``--config configs/tiny.yaml`` where
no such file exists (from any directory, as from an installed wheel).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from moetrain.config.base import InactiveFieldError, require
from moetrain.config.convert import (
    NULLS,
    config_from_dict,
    config_to_dict,
    field_type,
    preset_dicts,
    section_class,
    unwrap_optional,
)
from moetrain.config.deepspeed import apply_deepspeed_config, load_deepspeed_config
from moetrain.config.job import JobConfig

__all__ = ["SHIPPED_CONFIGS", "config_from_dict", "config_to_dict", "format_config", "load_config",
           "parse_overrides", "resolve_config_path", "save_config", "shipped_config_names"]

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
"""Folder of the job files installed with the package (package data)."""


def shipped_config_names() -> list[str]:
    """Names ``--config`` accepts besides a path: the shipped job files without ``.yaml``, sorted."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def resolve_config_path(config: str | Path) -> Path:
    """The file of ``--config``: an existing file, else the shipped job file of that name
    (``tiny``, ``tiny.yaml``, or ``configs/tiny.yaml`` as the package's folder is ``configs``);
    ``ValueError`` listing the shipped names otherwise. Another folder never falls back to a
    shipped file: a typo there must not train someone else's job."""
    path = Path(config)
    if path.is_file():
        return path
    name = str(path.name if path.parent == Path("configs") else config).removesuffix(".yaml")
    if name in shipped_config_names():
        return SHIPPED_CONFIGS / f"{name}.yaml"
    raise ValueError(f"--config ({str(config)!r}) is neither a file nor a shipped config; shipped configs: "
                     f"{', '.join(shipped_config_names())}")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                deepspeed: str | Path | Mapping | None = None, world_size: int | None = None) -> JobConfig:
    """The job described by the YAML file at ``path`` (a shipped config's name works too; None =
    all defaults), with ``overrides`` (``["--train.steps=100", "--model.preset=tiny"]``) applied
    on top.

    ``deepspeed`` (a JSON path or an already parsed dict) is applied over the file, for
    ``world_size`` processes (see ``moetrain.config.deepspeed.apply_deepspeed_config``); the
    ``overrides`` win over it too.
    """
    file = resolve_config_path(path) if path is not None else None
    raw = _read_yaml(file) if file is not None else {}
    parsed = parse_overrides(overrides)
    _check_preset_acts(raw, parsed)
    cfg = _from_dict(_with_overrides(raw, parsed), saved=file is not None and _is_saved(file),
                     given={(section, name) for section, name, _ in parsed}, name=str(file))
    if deepspeed is None:
        return cfg
    if world_size is None:
        raise ValueError("world_size (None) must be given with a DeepSpeed config "
                         "(its batch sizes are per rank)")
    ds = deepspeed if isinstance(deepspeed, Mapping) else load_deepspeed_config(deepspeed)
    cfg = apply_deepspeed_config(cfg, ds, world_size=world_size)
    if not parsed:
        return cfg
    # An explicit --section.field=value is the user's last word: it wins over the DeepSpeed JSON too
    # (applied before it as well, so the JSON's per-rank batch sizes see the overridden layout).
    resolved = config_to_dict(cfg)
    named = {(section, name) for section, name, _ in parsed}
    if named & {("train", "global_batch_size"), ("train", "micro_batch_size")} and ("train", "grad_accum") not in named:
        resolved["train"]["grad_accum"] = None  # the JSON's accumulation follows the overridden batch sizes
    if _cos_min_ratio(ds) is not None:  # the JSON's floor is a ratio of the lr, not the YAML's absolute one
        _follow_min_lr(resolved, {(section, name): value for section, name, value in parsed})
    return config_from_dict(_with_overrides(resolved, parsed))


def _cos_min_ratio(ds: Mapping) -> Any:
    scheduler = ds.get("scheduler") or {}
    if not isinstance(scheduler, Mapping) or scheduler.get("type") != "WarmupCosineLR":
        return None
    return (scheduler.get("params") or {}).get("cos_min_ratio")


def _follow_min_lr(resolved: dict, given: dict) -> None:
    """The cosine floor as DeepSpeed's WarmupCosineLR has it, a ratio of the lr (cos_min_ratio):
    an overridden lr keeps the ratio, an overridden schedule without a cosine drops the floor."""
    optim = resolved["optim"]
    if ("optim", "min_lr") in given or optim["min_lr"] is None:
        return
    if ("optim", "lr") in given and optim["lr"]:
        optim["min_lr"] = optim["min_lr"] * float(given[("optim", "lr")]) / optim["lr"]
    if given.get(("optim", "schedule"), "cosine") != "cosine":
        optim["min_lr"] = None


SAVED_HEADERS = ("# Resolved moetrain config", "# moetrain export")
"""The first line of a config a run (save_config) or an export wrote: every field at its value."""


def _is_saved(file: Path) -> bool:
    with open(file, encoding="utf-8") as f:
        return f.readline().startswith(SAVED_HEADERS)


def _from_dict(raw: dict, *, saved: bool, given: set, name: str) -> JobConfig:
    """``config_from_dict``; for a saved config, a field of a switched-off feature that an older
    moetrain accepted (and ignored) is reset to its default with a warning, so the run still
    resumes, evaluates and exports. The user's own overrides are never reset."""
    for _ in range(64):
        try:
            return config_from_dict(raw)
        except InactiveFieldError as e:
            section, _, field = e.field.partition(".")
            if not saved or (section, field) in given or not isinstance(raw.get(section), dict) \
                    or field not in raw[section]:
                raise
            warnings.warn(f"{name}: {e}; it did nothing when this config was saved, and is reset to its "
                          "default", stacklevel=3)
            raw = {**raw, section: {k: v for k, v in raw[section].items() if k != field}}
    return config_from_dict(raw)


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
        hint = field_type(section_class(section, where=f"override {item!r}"), section, name,
                          where=f"override {item!r}")
        out.append((section, name, _parse_text(text, hint)))
    return out


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


# --- internals ----------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping: plain YAML keeps the
    last, so a section written twice would silently lose its first block."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor" merges another mapping: its keys may be overridden here
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                break  # the parent class refuses it as YAML does ("found unhashable key")
            if key in seen:
                raise ValueError(f"config file {self.name!r}: key {key!r} is written twice in one mapping "
                                 f"(line {key_node.start_mark.line + 1}); YAML would keep only the last")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, name: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused (``name`` is the file the error names)."""
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path) -> dict:
    text = path.read_text()
    try:
        raw = _load_yaml(text, str(path))
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if raw is None:
        return {}
    require(isinstance(raw, dict), f"config file {str(path)!r}", type(raw).__name__,
            "must hold a mapping of sections")
    # A section holding only comments reads as null: the same as an empty section.
    return {k: {} if v is None else dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def _check_preset_acts(raw: Mapping[str, Any], parsed: Sequence[tuple[str, str, Any]]) -> None:
    """A command-line ``--model.preset`` that would change only the label is refused: the file's
    explicit fields win over any preset, so over a file that writes every model and moe field the
    preset sets (a saved run config) the new preset would have no effect at all."""
    preset = next((v for s, n, v in reversed(parsed) if (s, n) == ("model", "preset")), None)
    sections = {k: v for k, v in raw.items() if isinstance(v, Mapping)}
    if preset is None or preset == sections.get("model", {}).get("preset"):
        return
    if all(set(values) <= set(sections.get(section, {})) for section, values in preset_dicts(preset).items()):
        raise ValueError(f"--model.preset ({preset!r}) would change only the label: the config file sets "
                         "every model and moe field, and a file's explicit fields win over a preset (a saved "
                         "run config writes them all); start from a config without model fields, or override "
                         "the fields themselves")


def _with_overrides(raw: Mapping[str, Any], parsed: Sequence[tuple[str, str, Any]]) -> dict:
    """``raw`` (sections of the file) with the parsed overrides written into it."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for section, name, value in parsed:
        values = out.setdefault(section, {})
        if values is None:
            values = out[section] = {}
        require(isinstance(values, dict), f"config section {section!r}", values,
                f"must be a mapping of fields (overridden by --{section}.{name})")
        values[name] = value
    return out


def _parse_text(text: str, hint: Any) -> Any:
    """A command-line value: the raw text for string fields, else a YAML scalar."""
    optional, inner = unwrap_optional(hint)
    if inner is str:
        return None if optional and text.strip().lower() in NULLS + ("",) else text
    try:
        return _load_yaml(text, "<command line>")
    except yaml.YAMLError:
        return text  # reported with the field name by the coercion in config_from_dict
