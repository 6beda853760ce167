"""Typed job configuration: one dataclass per concern, composed by ``JobConfig``.

    cfg = load_config("tiny", ["--train.steps=100"])   # a shipped config by name, or a YAML path
    save_config(cfg, run_dir / "config.yaml")          # loads back to an equal config
"""

from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.classify import ClassifyConfig
from moetrain.config.convert import SECTIONS, build_section, config_from_dict, config_to_dict
from moetrain.config.data import DataConfig
from moetrain.config.deepspeed import apply_deepspeed_config, load_deepspeed_config
from moetrain.config.dp import DataParallelConfig
from moetrain.config.job import JobConfig
from moetrain.config.loader import (
    format_config,
    load_config,
    parse_overrides,
    resolve_config_path,
    save_config,
    shipped_config_names,
)
from moetrain.config.log import LogConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.optim import OptimConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.config.presets import PRESETS, Preset, get_preset
from moetrain.config.train import TrainConfig, resolve_device
from moetrain.config.zero import ZeroConfig

__all__ = [
    "PRESETS",
    "SECTIONS",
    "CheckpointConfig",
    "ClassifyConfig",
    "DataConfig",
    "DataParallelConfig",
    "JobConfig",
    "LogConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Preset",
    "TrainConfig",
    "ZeroConfig",
    "apply_deepspeed_config",
    "build_section",
    "config_from_dict",
    "config_to_dict",
    "format_config",
    "get_preset",
    "load_config",
    "load_deepspeed_config",
    "parse_overrides",
    "resolve_config_path",
    "resolve_device",
    "save_config",
    "shipped_config_names",
]
