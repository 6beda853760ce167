"""Config of the data-parallel gradient reduction: how the gradients travel between replicas.

The data-parallel degree itself is ``parallel.dp``; this section says what goes on the wire when
the replicas average their gradients (``moetrain.distributed.grad_compression``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.base import require_choice

GRAD_COMPRESSIONS = ("none", "bf16", "onebit")


@dataclass
class DataParallelConfig:
    grad_compression: str = "none"
    """What the gradient all-reduce over the data-parallel replicas moves, for the replicated
    parameters (over dp) and the expert shards (over edp):
    "none": fp32 gradients (exact);
    "bf16": gradients rounded to bf16 for the all-reduce, cast back to fp32 (half the bytes);
    "onebit": the sign of each element plus one fp32 scale (mean |g|) per tensor chunk, with
    error feedback on every rank and on the rank that sums each chunk (the two-phase compressed
    all-reduce of 1-bit Adam): about 1/32 of the fp32 bytes. Its residuals are checkpointed.
    Needs parallel.zero_stage <= 1: at stages 2/3 FSDP2 reduce-scatters its own buckets."""

    def __post_init__(self) -> None:
        require_choice("dp.grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
