"""Consolidated exports: one safetensors file of full tensors plus the config that builds the model.

    DIR/model.safetensors   every parameter and persistent buffer under its moetrain name, at full
                            size (stacked expert weights ``[E, ...]`` in global expert order);
                            header metadata: format, source, step
    DIR/config.yaml         the run's resolved job config (model.vocab_size filled in); for a model
                            imported from Hugging Face, only its ``model`` and ``moe`` sections

Sources (``load_source``): an export folder, a run folder (its latest checkpoint), a folder of
checkpoints (its latest) or one checkpoint. Reading a sharded checkpoint needs one process and no
process group: DCP assembles every tensor from the shards, whatever layout wrote them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from moetrain.config.convert import build_section
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.train.checkpoint import MANIFEST, CheckpointError, load_model_weights, resolve_checkpoint
from moetrain.utils.files import atomic_write_text, atomic_write_with

EXPORT_FORMAT = "moetrain-export/1"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"


def is_export(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / WEIGHTS).is_file() and (path / CONFIG).is_file()


def _checkpoint_of(path: Path) -> Path:
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        return path
    config = path / CONFIG
    if config.is_file():
        # A run folder: its checkpoints live in checkpoint.dir, or <run_dir>/checkpoints.
        raw = yaml.safe_load(config.read_text()) or {}
        folder = (raw.get("checkpoint") or {}).get("dir")
        folder = Path(folder) if folder else path / "checkpoints"
        if not folder.exists():
            raise CheckpointError(f"run folder {str(path)!r} has no checkpoints ({str(folder)!r} does not "
                                  "exist): train with checkpoint.every > 0 or checkpoint.save_final = true")
        return resolve_checkpoint(folder)
    return resolve_checkpoint(path)


def load_source(source: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``(config, state_dict, info)`` of ``source``: the config as nested plain values, full
    tensors by moetrain name, and ``info`` (``source``, ``step``)."""
    path = Path(source)
    if not path.exists():
        raise ValueError(f"source {str(path)!r} does not exist")
    if is_export(path):
        return read_export(path)
    ckpt = _checkpoint_of(path)
    tensors, trainer_state = load_model_weights(ckpt)
    if "config" not in trainer_state:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} holds no config (saved by an older moetrain?)")
    return trainer_state["config"], tensors, {"source": str(ckpt), "step": int(trainer_state["step"])}


def write_export(out_dir: str | os.PathLike, *, config: dict, state_dict: dict[str, torch.Tensor],
                 info: dict | None = None) -> Path:
    """Write ``state_dict`` (full tensors) and ``config`` into ``out_dir``, each file atomically."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share storage (a tied embedding and LM head): one copy each.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    meta = {"format": EXPORT_FORMAT, **{k: str(v) for k, v in (info or {}).items()}}
    # Durable, and readable by others: safetensors creates its files 0600, exports are for sharing.
    atomic_write_with(out / WEIGHTS, lambda p: save_file(tensors, str(p), metadata=meta), shared=True)
    header = (f"# moetrain export ({EXPORT_FORMAT}) of {meta.get('source', 'a model')}"
              + (f" at step {meta['step']}" if "step" in meta else "") + "\n")
    text = header + yaml.safe_dump(config, sort_keys=False)
    atomic_write_text(out / CONFIG, text, durable=True)
    return out


def read_export(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``(config, state_dict, info)`` of an export folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise ValueError(f"{str(path)!r} is not a moetrain export: {name} is missing")
    with safe_open(str(path / WEIGHTS), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{str(path / WEIGHTS)!r} is not a {EXPORT_FORMAT} file "
                         f"(format {meta.get('format')!r})")
    config = yaml.safe_load((path / CONFIG).read_text()) or {}
    info = {k: v for k, v in meta.items() if k != "format"}
    if "step" in info:
        info["step"] = int(info["step"])
    return config, load_file(str(path / WEIGHTS)), info


def _section(cls: type, name: str, values: dict[str, Any] | None) -> Any:
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        warnings.warn(f"config section {name!r} has fields this moetrain does not know, ignored: "
                      f"{', '.join(unknown)}", stacklevel=3)
    # Every field is written out, so a preset name would only be a label here.
    values = {k: v for k, v in values.items() if k in known and k != "preset"}
    return build_section(cls, name, values)


def model_configs(config: dict) -> tuple[ModelConfig, MoEConfig]:
    """The model and moe sections of an export's config, validated."""
    model = _section(ModelConfig, "model", config.get("model"))
    if model.vocab_size is None:
        raise ValueError("model.vocab_size (None) must be set in an export's config")
    return model, _section(MoEConfig, "moe", config.get("moe"))


def build_model(config: dict, state_dict: dict[str, torch.Tensor] | None = None):
    """A single-device ``Transformer`` of ``config`` holding ``state_dict`` (strict: every entry
    must match), e.g. ``build_model(*read_export(DIR)[:2])``."""
    from moetrain.models.transformer import Transformer

    model_cfg, moe_cfg = model_configs(config)
    model = Transformer(model_cfg, moe=moe_cfg if model_cfg.is_moe else None)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model


def export_model(source: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """``moetrain export``: the model of ``source`` (a run folder, a checkpoint, ...) as full
    tensors in ``out_dir``."""
    config, state_dict, info = load_source(source)
    return write_export(out_dir, config=config, state_dict=state_dict, info=info)
