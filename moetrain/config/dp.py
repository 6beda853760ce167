"""Config of the data-parallel gradient reduction: how the gradients travel between replicas.

The data-parallel degree itself is ``parallel.dp``; this section says what goes on the wire when
the replicas average their gradients (``moetrain.distributed.data_parallel.compression``), or, for
"onebit", their Adam momenta (``moetrain.distributed.data_parallel.onebit_adam``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_int
from moetrain.config.base import require, require_active, require_choice

GRAD_COMPRESSIONS = ("none", "bf16", "onebit")

ONEBIT_WARMUP_FRACTION = 0.2
"""Share of train.steps that 1-bit Adam runs uncompressed when dp.onebit_warmup_steps is None.
DeepSpeed's guidance for its freeze_step is 15-25% of the run; BENCHMARKS.md has the measurement
that picked 20% for the demo."""


def check_grad_compression(mode: str, *, zero_stage: int, tp: int) -> None:
    """dp.grad_compression against the layout (``ValueError`` naming the field): compressed
    reductions are the stage 0/1 wrapper's, 1-bit Adam's only at stage 0, and none under tensor
    parallelism."""
    require_choice("dp.grad_compression", mode, GRAD_COMPRESSIONS)
    require(mode == "none" or zero_stage <= 1, "dp.grad_compression", mode,
            f"needs parallel.zero_stage <= 1 (is {zero_stage}): at stages 2/3 FSDP2 reduce-scatters its own "
            "gradient buckets, which cannot be compressed")
    require(mode != "onebit" or zero_stage == 0, "dp.grad_compression", mode,
            f"needs parallel.zero_stage = 0 (is {zero_stage}): 1-bit Adam keeps the whole momentum and frozen "
            "variance on every replica (DeepSpeed's 1-bit Adam rejects ZeRO too)")
    require(mode == "none" or tp == 1, "dp.grad_compression", mode,
            f"needs parallel.tp = 1 (is {tp}): tensor-parallel gradients are reduced uncompressed")


@dataclass
class DataParallelConfig:
    grad_compression: str = "none"
    """What the data-parallel replicas exchange every step, for the replicated parameters (over dp)
    and the expert shards (over edp):
    "none": fp32 gradients, all-reduced (exact);
    "bf16": gradients rounded to bf16 for the all-reduce, cast back to fp32 (half the bytes);
    "onebit": 1-bit Adam (Tang et al. 2021, DeepSpeed's OnebitAdam). For dp.onebit_warmup_steps
    steps it is AdamW with fp32 gradient all-reduces; then Adam's variance is frozen, each rank
    folds its own local gradient into the momentum and the momenta are averaged with the two-phase
    1-bit compressed all-reduce (sign plus one fp32 scale per tensor chunk, error feedback on
    every rank and on the rank that sums each chunk): about 1/32 of the fp32 bytes. Its residuals
    are checkpointed. Needs parallel.zero_stage = 0 (the whole momentum and variance live on
    every replica, as in DeepSpeed, whose 1-bit Adam rejects ZeRO) and optim.name "adamw".
    From the freeze on, optim.grad_clip clips each rank's local gradient by its own norm, and the
    logged grad_norm is rank 0's local one: the global gradient is never assembled."""

    onebit_warmup_steps: int | None = None
    """Optimizer steps of "onebit" that run uncompressed (plain AdamW over fp32 all-reduces) before
    the variance freezes; None: 20% of train.steps. DeepSpeed's guidance for this (its
    freeze_step) is 15-25% of the run: the variance must have settled, since it is never updated
    again. Must be >= 1 (a variance frozen at zero would divide by eps). Set it explicitly for a
    run resumed with another train.steps, or the default moves the freeze with it."""

    def __post_init__(self) -> None:
        require_choice("dp.grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
        require_int("dp.onebit_warmup_steps", self.onebit_warmup_steps, min_value=1, none_ok=True)
        require_active(self.onebit_warmup_steps is None or self.grad_compression == "onebit", "dp.onebit_warmup_steps",
                       self.onebit_warmup_steps, f'acts only with dp.grad_compression "onebit" (it is '
                       f'{self.grad_compression!r}): leave it null')

    def onebit_warmup(self, total_steps: int) -> int:
        """dp.onebit_warmup_steps, or its default for a run of ``total_steps`` optimizer steps."""
        if self.onebit_warmup_steps is not None:
            return self.onebit_warmup_steps
        return max(1, round(ONEBIT_WARMUP_FRACTION * total_steps))
