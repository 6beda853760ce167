"""Config of ZeRO/FSDP sharding details: offload, communication overlap and bucket sizes.

The stage itself is ``parallel.zero_stage``. These fields are what a DeepSpeed
``zero_optimization`` block carries besides the stage (see ``moetrain.config.deepspeed``); the
data-parallel wrapper maps them onto FSDP2/DDP where an equivalent exists and warns about the
ones it cannot honour. Bucket sizes count elements, as in DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require_choice


@dataclass
class ZeroConfig:
    offload_optimizer: str = "none"
    """"cpu": keep optimizer states (and run the optimizer step) in host memory; "none": on the device.
    Needs parallel.zero_stage >= 1."""

    offload_param: str = "none"
    """"cpu": keep the sharded parameters in host memory between uses; "none": on the device.
    Needs parallel.zero_stage == 3."""

    pin_memory: bool = True
    """Page-lock the offloaded host buffers (faster copies). Ignored without CUDA."""

    overlap_comm: bool = True
    """Overlap gradient reduction / parameter gathering with compute (FSDP prefetching, DDP
    bucketed all-reduce during backward)."""

    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""

    reduce_bucket_size: int = 500_000_000
    """Elements per gradient reduce (all-reduce / reduce-scatter) bucket."""

    allgather_bucket_size: int = 500_000_000
    """Elements per parameter all-gather bucket (ZeRO-1/2 parameter broadcast after the step)."""

    prefetch_bucket_size: int = 50_000_000
    """ZeRO-3: elements of parameters gathered ahead of their use (DeepSpeed stage3_prefetch_bucket_size)."""

    param_persistence_threshold: int = 100_000
    """ZeRO-3: parameters with fewer elements stay unsharded (DeepSpeed
    stage3_param_persistence_threshold)."""

    max_live_parameters: int = 1_000_000_000
    """ZeRO-3: most gathered parameter elements held at once (DeepSpeed stage3_max_live_parameters)."""

    max_reuse_distance: int = 1_000_000_000
    """ZeRO-3: keep a gathered parameter if it is used again within this many elements of other
    parameters (DeepSpeed stage3_max_reuse_distance)."""

    def __post_init__(self) -> None:
        require_choice("zero.offload_optimizer", self.offload_optimizer, ("none", "cpu"))
        require_choice("zero.offload_param", self.offload_param, ("none", "cpu"))
        for name in ("pin_memory", "overlap_comm", "contiguous_gradients"):
            require_bool(f"zero.{name}", getattr(self, name))
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            require_int(f"zero.{name}", getattr(self, name), min_value=1)
        for name in ("param_persistence_threshold", "max_live_parameters", "max_reuse_distance"):
            require_int(f"zero.{name}", getattr(self, name))
