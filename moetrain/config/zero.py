"""Config of ZeRO/FSDP sharding details: offload and bucket sizes.

The stage itself is ``parallel.zero_stage``. These are the settings of a DeepSpeed
``zero_optimization`` block that FSDP2/DDP and the ZeRO-1 optimizer honour (see
``moetrain.config.deepspeed`` for the ones they have no equivalent for). Bucket sizes count
elements, as in DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require, require_active, require_choice

DEFAULT_BUCKET_SIZE = 500_000_000
"""DeepSpeed's default of both bucket sizes (elements)."""


def check_offload(zero_stage: int, *, offload_optimizer: bool, offload_param: bool, pp: int = 1) -> None:
    """Offload moves this rank's shard of what it names to the host, so it needs that sharded:
    the parameters at stage 3 only, the optimizer states from stage 1; pipeline stages (``pp`` >
    1) offload only through FSDP2 (stages 2/3). ``ValueError`` naming the field otherwise."""
    require(not offload_param or zero_stage == 3, "zero.offload_param", "cpu",
            f"needs parallel.zero_stage = 3 (is {zero_stage})")
    require(not offload_optimizer or zero_stage >= 1, "zero.offload_optimizer", "cpu",
            f"needs parallel.zero_stage >= 1 (is {zero_stage})")
    if pp > 1:
        for field, offload in (("zero.offload_optimizer", offload_optimizer), ("zero.offload_param", offload_param)):
            require(not offload or zero_stage >= 2, field, "cpu",
                    f"needs parallel.zero_stage >= 2 with parallel.pp ({pp}) > 1 (is {zero_stage}): pipeline "
                    "stages offload through FSDP2")


def reduce_bucket_acts(zero_stage: int, *, tp: int, pp: int) -> bool:
    """``zero.reduce_bucket_size`` sizes DDP's buckets, which only stages 0/1 without pipeline or
    tensor parallelism have (FSDP2 reduce-scatters per unit, the pipeline stages and the tp
    reduction reduce one flat buffer)."""
    return zero_stage <= 1 and tp == 1 and pp == 1


def check_bucket_sizes(reduce_bucket_size: int, allgather_bucket_size: int, *, zero_stage: int, tp: int,
                       pp: int) -> None:
    """A bucket size changed from its default where the layout has no such bucket: an
    ``InactiveFieldError`` naming the field, its value and the layouts it acts in."""
    require_active(reduce_bucket_size == DEFAULT_BUCKET_SIZE or reduce_bucket_acts(zero_stage, tp=tp, pp=pp),
                   "zero.reduce_bucket_size", reduce_bucket_size,
                   f"acts only with parallel.zero_stage <= 1, parallel.tp = 1 and parallel.pp = 1 (got "
                   f"zero_stage={zero_stage}, tp={tp}, pp={pp}): it sizes DDP's gradient buckets, which the "
                   "other layouts do not use")
    require_active(allgather_bucket_size == DEFAULT_BUCKET_SIZE or zero_stage == 1, "zero.allgather_bucket_size",
                   allgather_bucket_size, f"acts only with parallel.zero_stage = 1 (is {zero_stage}): it sizes the "
                   "ZeRO-1 optimizer's parameter all-gathers (FSDP2 gathers per unit at stages 2/3)")


@dataclass
class ZeroConfig:
    offload_optimizer: str = "none"
    """"cpu": keep optimizer states (and run the optimizer step) in host memory; "none": on the device.
    Needs parallel.zero_stage >= 1."""

    offload_param: str = "none"
    """"cpu": keep the sharded parameters in host memory between uses; "none": on the device.
    Needs parallel.zero_stage == 3."""

    pin_memory: bool = True
    """Page-lock the offloaded host buffers for faster copies to and from the device, as
    DeepSpeed's offload_optimizer/offload_param.pin_memory: at stage 1 the optimizer slices and
    their gradients' host copies, at stages 2/3 FSDP2's ``CPUOffloadPolicy(pin_memory=...)``.
    Pinned memory needs CUDA: without it (a CPU-only run, where the host copy is the only copy)
    nothing is pinned, as DeepSpeed's accelerators without pinning do, and the run goes on."""

    reduce_bucket_size: int = DEFAULT_BUCKET_SIZE
    """Elements per gradient all-reduce bucket of DDP (stages 0/1 with tp = pp = 1; refused when
    changed in any other layout, which has no DDP buckets). At this default DDP keeps its own
    25 MB buckets: one 2 GB bucket would leave nothing to overlap with the backward."""

    allgather_bucket_size: int = DEFAULT_BUCKET_SIZE
    """Elements per parameter all-gather bucket (ZeRO-1 parameter broadcast after the step; refused
    when changed at another stage)."""

    def __post_init__(self) -> None:
        require_choice("zero.offload_optimizer", self.offload_optimizer, ("none", "cpu"))
        require_choice("zero.offload_param", self.offload_param, ("none", "cpu"))
        require_bool("zero.pin_memory", self.pin_memory)
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            require_int(f"zero.{name}", getattr(self, name), min_value=1)
