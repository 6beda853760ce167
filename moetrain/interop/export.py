"""Consolidated exports: safetensors of full tensors plus the config that builds the model.

    DIR/model.safetensors   every parameter and persistent buffer under its moetrain name, at full
                            size (stacked expert weights ``[E, ...]`` in global expert order);
                            header metadata: format, source, step. A large export is sharded:
                            model-0000i-of-0000n.safetensors + model.safetensors.index.json
    DIR/config.yaml         the run's resolved job config (model.vocab_size filled in); for a model
                            imported from Hugging Face, only its ``model`` and ``moe`` sections
    DIR/tokenizer.json      the tokenizer the run trained with, when its run folder holds one, with
                            its tokenizer_config.json (``moetrain.data.tokenizer.save_tokenizer``);
                            for an imported model, its Hugging Face folder's

Sources (``open_source``): an export folder, a run folder (its latest checkpoint), a folder of
checkpoints (its latest) or one checkpoint. Reading a sharded checkpoint needs one process and no
process group: DCP assembles every tensor from the shards, whatever layout wrote them. Exports
stream: one tensor in memory at a time (``moetrain.interop.sources``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from moetrain.config.checkpoint import checkpoint_folder
from moetrain.config.convert import build_section
from moetrain.config.finetune import FinetuneConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import load_saved_tokenizer, save_tokenizer
from moetrain.interop.sources import CheckpointTensors, ExportTensors, MergedLoRATensors
from moetrain.train.checkpoint.files import MANIFEST, CheckpointError, resolve_checkpoint
from moetrain.utils.files import atomic_write_text
from moetrain.utils.safetensors_io import INDEX, WEIGHTS, ShardedWriter, TensorSpec

EXPORT_FORMAT = "moetrain-export/1"
CONFIG = "config.yaml"


def is_export(path: str | os.PathLike) -> bool:
    path = Path(path)
    return ((path / WEIGHTS).is_file() or (path / INDEX).is_file()) and (path / CONFIG).is_file()


def _checkpoint_of(path: Path) -> Path:
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        return path
    config = path / CONFIG
    if config.is_file():
        # A run folder: its checkpoints live in checkpoint.dir, or <run_dir>/checkpoints.
        raw = yaml.safe_load(config.read_text()) or {}
        folder = checkpoint_folder(path, (raw.get("checkpoint") or {}).get("dir"))
        if not folder.exists():
            raise CheckpointError(f"run folder {str(path)!r} has no checkpoints ({str(folder)!r} does not "
                                  "exist): train with checkpoint.every > 0 or checkpoint.save_final = true")
        return resolve_checkpoint(folder)
    if (path / "config.json").is_file() and not (path / ".metadata").exists():
        raise CheckpointError(f"{str(path)!r} is a Hugging Face model folder (config.json), not a moetrain run, "
                              f"checkpoint or export: convert it first with `moetrain convert --from-hf {path} "
                              "--to EXPORT`")
    return resolve_checkpoint(path)


def source_folder(source: str | os.PathLike) -> Path | None:
    """The folder that holds ``source``'s config.yaml, and with it the tokenizer the run saved: an
    export or run folder itself, the run of a folder of checkpoints or of a checkpoint
    (RUN/checkpoints/step_N); None when none of them has one (checkpoints kept outside the run)."""
    path = Path(source)
    return next((p for p in (path, path.parent, path.parent.parent) if (p / CONFIG).is_file()), None)


def check_output_folder(source: str | os.PathLike, out: str | os.PathLike, flag: str, *,
                        writes: str = "export") -> None:
    """ValueError naming ``flag`` when writing ``out`` could destroy what is read, trained or saved:
    ``out`` is ``source`` or contains it; lies inside a run's checkpoints/ or inside a checkpoint
    (a folder inside a run, an export or a Hugging Face folder is harmless: their readers look at
    top-level files only, and RUN/export is the documented place of a run's export); is a run or
    checkpoint folder (an export written there replaces the run's config.yaml: the run resumes, and
    exports, from the wrong config); or holds a model of the other format than the one ``writes``
    ("export" or "hf"), which the new files would overwrite in part."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src or dst in src.parents or (src in dst.parents and _inside_checkpoints(src, dst)):
        raise ValueError(f"{flag} {str(out)!r} would overwrite the source {str(source)!r} (it is or contains it, "
                         "or lies inside its checkpoints): pick a folder apart from it")
    checkpoint = (dst / MANIFEST).is_file() or (dst / ".metadata").is_file()
    if checkpoint or ((dst / CONFIG).is_file() and not is_export(dst)) or (dst / "checkpoints").is_dir():
        raise ValueError(f"{flag} {str(out)!r} is a moetrain {'checkpoint' if checkpoint else 'run'} folder: "
                         "pick a new or export folder")
    if writes == "hf" and is_export(dst):
        raise ValueError(f"{flag} {str(out)!r} is a moetrain export: pick a new or Hugging Face folder")
    if writes == "export" and (dst / "config.json").is_file() and not (dst / CONFIG).is_file():
        raise ValueError(f"{flag} {str(out)!r} is a Hugging Face model folder (config.json): pick a new or "
                         "export folder")


def _inside_checkpoints(src: Path, dst: Path) -> bool:
    """Whether ``dst``, inside ``src``, is where checkpoints are: under a run's checkpoints/, or
    anywhere inside a source that is neither a run, an export nor a Hugging Face folder (a
    checkpoint or a folder of them)."""
    if is_export(src) or ((src / "config.json").is_file() and not (src / CONFIG).is_file()):
        return False
    if (src / CONFIG).is_file():
        return dst.relative_to(src).parts[0] == "checkpoints"
    return True


def open_source(source: str | os.PathLike) -> tuple[dict, ExportTensors | CheckpointTensors, dict]:
    """``(config, tensors, info)`` of ``source``: the config as nested plain values, a lazy
    source of full tensors by moetrain name, and ``info`` (``source``, ``step``)."""
    path = Path(source)
    if not path.exists():
        raise ValueError(f"source {str(path)!r} does not exist")
    if is_export(path):
        return _merged(*_open_export(path))
    ckpt = _checkpoint_of(path)
    tensors = CheckpointTensors(ckpt)
    state = tensors.trainer_state
    if "config" not in state:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} holds no config (saved by an older moetrain?)")
    return _merged(state["config"], tensors, {"source": str(ckpt), "step": int(state["step"])})


def _merged(config: dict, tensors, info: dict):
    """A LoRA fine-tuning run as the plain model it trained (merge on export): the adapters folded
    into their base weights and the finetune section reset, so what is written builds without
    adapters, here and in Hugging Face."""
    finetune = build_section(FinetuneConfig, "finetune", dict(config.get("finetune") or {}))
    if not finetune.enabled:
        return config, tensors, info
    return without_adapters(config), MergedLoRATensors(tensors, finetune), {**info, "merged_lora": finetune.lora_rank}


def without_adapters(config: dict) -> dict:
    """``config`` with its finetune section at the defaults (no adapters)."""
    plain = {"lora_rank": 0, "lora_alpha": FinetuneConfig.lora_alpha,
             "lora_targets": list(FinetuneConfig.lora_targets)}
    return {**config, "finetune": plain} if "finetune" in config else dict(config)


def load_source(source: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``open_source`` with every tensor read: ``(config, state_dict, info)``."""
    config, tensors, info = open_source(source)
    return config, {name: tensors.get(name).clone() for name in tensors.names()}, info


def _open_export(path: Path) -> tuple[dict, ExportTensors, dict]:
    for name in (CONFIG,):
        if not (path / name).is_file():
            raise ValueError(f"{str(path)!r} is not a moetrain export: {name} is missing")
    tensors = ExportTensors(path)
    meta = tensors.metadata
    if meta.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a {EXPORT_FORMAT} export (format {meta.get('format')!r})")
    config = yaml.safe_load((path / CONFIG).read_text()) or {}
    info: dict[str, Any] = {k: v for k, v in meta.items() if k != "format"}
    if "step" in info:
        info["step"] = int(info["step"])
    return config, tensors, info


def read_export(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``(config, state_dict, info)`` of an export folder, every tensor read."""
    config, tensors, info = _open_export(Path(path))
    return config, {name: tensors.get(name) for name in tensors.names()}, info


def write_config_yaml(out: Path, config: dict, info: dict) -> None:
    header = (f"# moetrain export ({EXPORT_FORMAT}) of {info.get('source', 'a model')}"
              + (f" at step {info['step']}" if "step" in info else "") + "\n")
    atomic_write_text(out / CONFIG, header + yaml.safe_dump(config, sort_keys=False), durable=True)


def export_metadata(info: dict | None) -> dict[str, str]:
    return {"format": EXPORT_FORMAT, **{k: str(v) for k, v in (info or {}).items()}}


def write_export(out_dir: str | os.PathLike, *, config: dict, state_dict: dict[str, torch.Tensor],
                 info: dict | None = None, max_shard_bytes: int | None = None) -> Path:
    """Write ``state_dict`` (full tensors) and ``config`` into ``out_dir``, each file atomically."""
    out = Path(out_dir)
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in state_dict.items()]
    with ShardedWriter(out, specs, metadata=export_metadata(info), max_shard_bytes=max_shard_bytes) as w:
        for k, v in state_dict.items():
            w.write(k, v)
        w.close()
    write_config_yaml(out, config, info or {})
    return out


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


def fresh_run_config(config: dict, source: str | os.PathLike, out: Path) -> dict:
    """``config`` as a new run's from the export ``out``: its weights through checkpoint.init_from,
    its own run folder ``<out>-run`` with its checkpoints, so that no checkpoint of the source's run
    (checkpoint.resume "auto" or a path) replaces the exported model."""
    run_dir = out.resolve().with_name(out.resolve().name + "-run")
    old_run = (config.get("log") or {}).get("run_dir")
    if run_dir in {Path(source).resolve(), *([Path(old_run).resolve()] if old_run else [])}:
        raise ValueError(f"--to {str(out)!r} would train in {str(run_dir)!r}, the source's run folder: pick another "
                         "--to")
    log = {**(config.get("log") or {}), "run_dir": str(run_dir)}
    checkpoint = {**(config.get("checkpoint") or {}), "dir": None, "resume": "auto", "init_from": str(out.resolve()),
                  "init_from_new_head": False}
    return {**config, "log": log, "checkpoint": checkpoint}


def copy_classes(folder: Path | None, out: Path) -> None:
    """A classifier's ``classes.json`` (its head's row i is class i) into the export beside its weights:
    a run started from the export with its head is held to those classes."""
    from moetrain.train.classification import CLASSES_FILE

    if folder is not None and (folder / CLASSES_FILE).is_file():
        atomic_write_text(out / CLASSES_FILE, (folder / CLASSES_FILE).read_text(), durable=True)


def export_model(source: str | os.PathLike, out_dir: str | os.PathLike, *,
                 max_shard_bytes: int | None = None) -> Path:
    """``moetrain export``: the model of ``source`` (a run folder, a checkpoint, ...) as full
    tensors in ``out_dir``, streamed one tensor at a time."""
    config, tensors, info = open_source(source)
    check_output_folder(source, out_dir, "--to")
    names = tensors.names()
    specs = [TensorSpec(n, tensors.shape(n), tensors.dtype(n)) for n in names]
    out = Path(out_dir)
    with ShardedWriter(out, specs, metadata=export_metadata(info), max_shard_bytes=max_shard_bytes) as w:
        for n in names:
            w.write(n, tensors.get(n))
        w.close()
    folder = source_folder(source)
    save_tokenizer(load_saved_tokenizer(folder) if folder is not None else None, out, durable=True)
    copy_classes(folder, out)
    if "log" in config or "checkpoint" in config:  # a run's whole config: train --config starts a new run
        config = fresh_run_config(config, source, out)
    write_config_yaml(out, config, info)  # last: an export with a config.yaml is complete
    return out
