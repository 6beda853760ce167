"""Import of a DeepSpeed JSON config (``--deepspeed ds_config.json``) into a ``JobConfig``.

Mapped: the three batch sizes (checked as DeepSpeed does), fp16/bf16, gradient_clipping,
optimizer (Adam/AdamW params), scheduler (WarmupLR, WarmupCosineLR; a "log" warmup, DeepSpeed's
default warmup_type, is warned about: the warmup here is linear), steps_per_print,
zero_optimization (stage -> parallel.zero_stage; offload and bucket sizes -> the `zero` section, a
bucket size only in a layout that has that bucket, else it is an ignored key)
and a top-level ``"moe": {"ep_size", "num_experts", "k", "capacity_factor", "drop_tokens"}``.
Every other key is ignored with ONE warning naming them all: among them the ZeRO knobs FSDP2/DDP
have no equivalent for (contiguous_gradients, the stage3_* prefetch/persistence/live/reuse
limits; overlap_comm unless true, which is what DDP and FSDP2 do). ``"auto"`` (the Hugging Face
convention) counts as not set. ``moe.ep_size`` is checked against the world size and the experts
where the layout is built (``ParallelDims``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetrain.config.base import require
from moetrain.config.convert import config_from_dict, config_to_dict
from moetrain.config.job import JobConfig
from moetrain.config.zero import DEFAULT_BUCKET_SIZE, reduce_bucket_acts

# Keys accepted without a warning when they hold the value moetrain behaves as anyway.
_MATCHING = {
    "fp16.loss_scale": 0,  # 0 = dynamic loss scaling, what fp16 training here does
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.reduce_scatter": True,
    # DDP reduces gradient buckets during the backward and FSDP2 prefetches the next unit's
    # all-gather: both overlap communication with compute, always.
    "zero_optimization.overlap_comm": True,
    "moe.enabled": True,
}
_ZERO_FIELDS = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size"}
"""zero_optimization keys (DeepSpeed name -> field of the ``zero`` section) that act here, in the
layouts that have such buckets (``moetrain.config.zero.check_bucket_sizes``)."""


def load_deepspeed_config(path: str | Path) -> dict:
    try:
        ds = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from e
    except (OSError, UnicodeDecodeError) as e:  # missing, a folder, unreadable, not text
        raise ValueError(f"--deepspeed ({str(path)!r}) must be a readable JSON file: {e}") from e
    require(isinstance(ds, dict), f"DeepSpeed config {str(path)!r}", type(ds).__name__,
            "must hold a JSON object")
    return ds


def apply_deepspeed_config(cfg: JobConfig, ds: Mapping[str, Any], *, world_size: int) -> JobConfig:
    """``cfg`` with the settings of the DeepSpeed config ``ds`` for a job of ``world_size`` processes."""
    d = config_to_dict(cfg)
    ignored: list[str] = []
    ds = {k: v for k, v in ds.items() if not _auto(v)}

    _apply_batch(d, ds, cfg.data_parallel_size(world_size))
    _apply_precision(d, ds, ignored)
    if "gradient_clipping" in ds:
        d["optim"]["grad_clip"] = ds["gradient_clipping"]
    if "steps_per_print" in ds:
        d["log"]["every"] = ds["steps_per_print"]
    _apply_optimizer(d, ds.get("optimizer"), ignored)
    _apply_scheduler(d, ds.get("scheduler"), ignored)
    _apply_zero(d, ds.get("zero_optimization"), ignored)
    _apply_moe(d, ds.get("moe"), ignored)

    handled = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "fp16",
               "bf16", "bfloat16", "gradient_clipping", "steps_per_print", "optimizer", "scheduler",
               "zero_optimization", "moe"}
    ignored += [k for k in ds if k not in handled and not _matches(k, ds[k])]
    if ignored:
        warnings.warn(f"DeepSpeed config: ignoring keys moetrain does not support: {', '.join(ignored)}",
                      UserWarning, stacklevel=2)
    return config_from_dict(d)


def _apply_batch(d: dict, ds: Mapping, dp: int) -> None:
    """DeepSpeed's rule: train_batch_size = micro * gradient_accumulation_steps * data-parallel size;
    any two give the third, one alone means no accumulation."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for name in names:
        if name in ds and not (isinstance(ds[name], int) and not isinstance(ds[name], bool) and ds[name] > 0):
            raise ValueError(f"{name} ({ds[name]!r}) must be an int > 0")
    batch, micro, accum = (ds.get(n) for n in names)
    if batch is None and micro is None:
        if accum is not None:
            raise ValueError(f"gradient_accumulation_steps ({accum}) needs train_batch_size or "
                             "train_micro_batch_size_per_gpu as well")
        return
    if batch is not None and micro is not None and accum is not None:
        ok = batch == micro * accum * dp
    elif batch is not None and micro is not None:
        accum, ok = batch // (micro * dp), batch % (micro * dp) == 0
    elif batch is not None and accum is not None:
        micro, ok = batch // (accum * dp), batch % (accum * dp) == 0
    elif batch is not None:
        accum = 1
        micro, ok = batch // dp, batch % dp == 0
    else:
        assert micro is not None  # train_batch_size is not set here, so the micro-batch size is
        accum = 1 if accum is None else accum
        batch, ok = micro * accum * dp, True
    if not ok or micro == 0 or accum == 0:
        raise ValueError(
            f"DeepSpeed batch sizes are inconsistent: train_batch_size ({ds.get(names[0])}) must equal "
            f"train_micro_batch_size_per_gpu ({ds.get(names[1])}) * "
            f"gradient_accumulation_steps ({ds.get(names[2])}) * data-parallel size ({dp})")
    d["train"].update(global_batch_size=batch, micro_batch_size=micro, grad_accum=accum)


def _apply_precision(d: dict, ds: Mapping, ignored: list[str]) -> None:
    enabled, disabled = [], []
    for key in ("fp16", "bf16", "bfloat16"):
        block = ds.get(key)
        if block is None:
            continue
        require(isinstance(block, Mapping), key, block, 'must be an object like {"enabled": true}')
        flag = block.get("enabled", False)  # DeepSpeed's default
        if flag is True:
            enabled.append(key)
        elif flag is False:
            disabled.append(key)
        elif not _auto(flag):
            raise ValueError(f"{key}.enabled ({flag!r}) must be true, false or \"auto\"")
        ignored += [f"{key}.{k}" for k, v in block.items()
                    if k != "enabled" and not _matches(f"{key}.{k}", v)]
    require(len(enabled) <= 1, " and ".join(k + ".enabled" for k in enabled), True,
            "at most one precision may be enabled")
    if enabled:
        d["train"]["dtype"] = "fp16" if enabled[0] == "fp16" else "bf16"
    elif disabled:
        d["train"]["dtype"] = "fp32"


def _apply_optimizer(d: dict, block: Any, ignored: list[str]) -> None:
    if block is None:
        return
    require(isinstance(block, Mapping), "optimizer", block, 'must be an object like {"type": "AdamW"}')
    kind = str(block.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ValueError(f"optimizer.type ({block.get('type')!r}) must be 'Adam' or 'AdamW' "
                         "(moetrain trains with AdamW)")
    for key, value in (block.get("params") or {}).items():
        if _auto(value):
            continue
        if key in ("lr", "eps", "weight_decay", "betas"):
            d["optim"][key] = value
        else:
            ignored.append(f"optimizer.params.{key}")
    ignored += [f"optimizer.{k}" for k in block if k not in ("type", "params")]


def _apply_scheduler(d: dict, block: Any, ignored: list[str]) -> None:
    if block is None:
        return
    require(isinstance(block, Mapping), "scheduler", block, 'must be an object like {"type": "WarmupLR"}')
    kind = block.get("type")
    if kind not in ("WarmupLR", "WarmupCosineLR"):
        ignored.append(f"scheduler (type {kind!r})")
        return
    d["optim"]["schedule"] = "constant" if kind == "WarmupLR" else "cosine"
    if kind == "WarmupLR":
        d["optim"]["min_lr"] = None  # a constant schedule has no floor: the file's min_lr was for its cosine
    params = {k: v for k, v in (block.get("params") or {}).items() if not _auto(v)}
    if params.get("warmup_num_steps") != 0 and params.get("warmup_type", "log") == "log":
        # DeepSpeed's default warmup (WarmupLR and WarmupCosineLR alike) is "log", which the
        # linear warmup here cannot express: said out loud, not mapped silently.
        told = "is 'log'" if "warmup_type" in params else "is not set, and DeepSpeed's default is 'log'"
        warnings.warn(f"DeepSpeed config: scheduler.params.warmup_type {told} (the learning rate rising as "
                      "log(step + 1) / log(warmup_num_steps)); moetrain warms up linearly, from lr / "
                      "optim.warmup_steps to lr: set \"warmup_type\": \"linear\" to accept that", UserWarning,
                      stacklevel=3)
    min_ratio = None
    for key, value in params.items():
        if key == "warmup_num_steps":
            d["optim"]["warmup_steps"] = value
        elif key == "warmup_max_lr":
            d["optim"]["lr"] = value
        elif key == "total_num_steps" and kind == "WarmupCosineLR":
            d["train"]["steps"] = value
        elif key == "cos_min_ratio" and kind == "WarmupCosineLR":
            min_ratio = value
        elif not (key == "warmup_min_lr" and value == 0) and not (key == "warmup_type" and value in ("linear", "log")):
            # DeepSpeed's warmup starts at warmup_min_lr; ours starts at lr / optim.warmup_steps.
            ignored.append(f"scheduler.params.{key}")
    if min_ratio is not None:
        d["optim"]["min_lr"] = min_ratio * float(d["optim"]["lr"])


def _apply_zero(d: dict, block: Any, ignored: list[str]) -> None:
    if block is None:
        return
    require(isinstance(block, Mapping), "zero_optimization", block, 'must be an object like {"stage": 2}')
    buckets: dict[str, Any] = {}
    for key, value in block.items():
        if _auto(value):
            continue
        if key == "stage":
            d["parallel"]["zero_stage"] = value
        elif key in ("offload_optimizer", "offload_param"):
            _apply_offload(d, key, value, ignored)
        elif key in _ZERO_FIELDS:
            buckets[key] = value
        elif not _matches(f"zero_optimization.{key}", value):
            ignored.append(f"zero_optimization.{key}")
    # Once the stage is known (any key order): a bucket size this layout has no bucket for is
    # ignored with the other keys (the zero section refuses it, as it would from a user).
    par = d["parallel"]
    if not buckets or not isinstance(par["zero_stage"], int):  # a stage that is no int is refused by the config
        d["zero"].update({_ZERO_FIELDS[k]: v for k, v in buckets.items()})
        return
    acts = {"reduce_bucket_size": reduce_bucket_acts(par["zero_stage"], tp=par["tp"], pp=par["pp"]),
            "allgather_bucket_size": par["zero_stage"] == 1}
    for key, value in buckets.items():
        if acts[key] or value == DEFAULT_BUCKET_SIZE:
            d["zero"][_ZERO_FIELDS[key]] = value
        else:
            ignored.append(f"zero_optimization.{key} (no such bucket at zero stage {par['zero_stage']}, "
                           f"tp {par['tp']}, pp {par['pp']})")


def _apply_offload(d: dict, key: str, block: Any, ignored: list[str]) -> None:
    require(isinstance(block, Mapping), f"zero_optimization.{key}", block,
            'must be an object like {"device": "cpu"}')
    device = block.get("device", "none")
    if device not in ("cpu", "none"):
        raise ValueError(f"zero_optimization.{key}.device ({device!r}) must be 'cpu' or 'none' "
                         "(NVMe offload is not supported)")
    d["zero"][key] = device
    if "pin_memory" in block:
        d["zero"]["pin_memory"] = block["pin_memory"]
    ignored += [f"zero_optimization.{key}.{k}" for k in block if k not in ("device", "pin_memory")]


def _apply_moe(d: dict, block: Any, ignored: list[str]) -> None:
    if block is None:
        return
    require(isinstance(block, Mapping), "moe", block, 'must be an object like {"ep_size": 8}')
    block = {k: v for k, v in block.items() if not _auto(v)}
    for key, value in block.items():
        if key == "ep_size":
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0, "moe.ep_size", value,
                    "must be an int > 0")
            d["parallel"]["ep"] = value
        elif key == "num_experts":
            d["moe"]["num_experts"] = value
        elif key in ("k", "top_k"):
            d["moe"]["top_k"] = value
        elif key == "capacity_factor":
            d["moe"]["capacity_factor"] = value
        elif key != "drop_tokens" and not _matches(f"moe.{key}", value):
            ignored.append(f"moe.{key}")
    if block.get("drop_tokens") is False:
        d["moe"]["capacity_factor"] = None  # dropless
    elif block.get("drop_tokens") is True and d["moe"]["capacity_factor"] is None:
        d["moe"]["capacity_factor"] = 1.0  # DeepSpeed's default capacity factor


def _auto(value: Any) -> bool:
    return value == "auto"


def _matches(key: str, value: Any) -> bool:
    return key in _MATCHING and value == _MATCHING[key] and type(value) is type(_MATCHING[key])
