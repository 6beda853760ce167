"""Config of ZeRO/FSDP sharding details: offload and bucket sizes.

The stage itself is ``parallel.zero_stage``. These are the settings of a DeepSpeed
``zero_optimization`` block that FSDP2/DDP and the ZeRO-1 optimizer honour (see
``moetrain.config.deepspeed`` for the ones they have no equivalent for). Bucket sizes count
elements, as in DeepSpeed.
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

    reduce_bucket_size: int = 500_000_000
    """Elements per gradient all-reduce bucket of DDP (stages 0/1). At this default DDP keeps its
    own 25 MB buckets: one 2 GB bucket would leave nothing to overlap with the backward."""

    allgather_bucket_size: int = 500_000_000
    """Elements per parameter all-gather bucket (ZeRO-1 parameter broadcast after the step)."""

    def __post_init__(self) -> None:
        require_choice("zero.offload_optimizer", self.offload_optimizer, ("none", "cpu"))
        require_choice("zero.offload_param", self.offload_param, ("none", "cpu"))
        require_bool("zero.pin_memory", self.pin_memory)
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            require_int(f"zero.{name}", getattr(self, name), min_value=1)
