"""Config of the training run itself: length, batch, precision, device, memory savers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require, require_active, require_choice


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to train for."""

    global_batch_size: int = 16
    """Sequences per optimizer step, summed over all data-parallel ranks and accumulation steps:
    global_batch_size = micro_batch_size * grad_accum * data-parallel size."""

    micro_batch_size: int = 8
    """Sequences per rank per forward/backward."""

    grad_accum: int | None = None
    """Micro-batches accumulated per optimizer step. None = derived from the other two and the
    data-parallel size; when set it is checked against them."""

    seed: int = 0
    """Seed of the weight init, the data order and, with each rank's index, the random draws of
    training (dropout masks). The same seed gives the same global weights whatever the parallel
    layout, and the same run on the same layout."""

    dtype: str = "fp32"
    """Compute precision: "fp32", "bf16" (mixed precision, fp32 master weights) or "fp16" (mixed
    precision with loss scaling). bf16 is about 100x slower than fp32 on CPUs without bf16 kernels."""

    eval_every: int = 100
    """Evaluate on the validation split every n steps (and at the end); 0 = never. A classifier
    (model.head="classifier") evaluates every validation example, and at the end also every test
    example (the test_* metrics of the last record)."""

    eval_steps: int = 10
    """Global batches per evaluation of a language model (Megatron's eval_iters): the first
    eval_steps x global_batch_size validation windows (every window when the stream holds fewer),
    the same at every parallel layout; the loss is their mean per token. A
    classifier evaluates whole splits, exactly (its metrics are computed from confusion matrices
    summed over the ranks), so it does not read this."""

    device: str = "auto"
    """"auto" (CUDA if available, else CPU), "cpu" or "cuda". Never picks CUDA when it is not available."""

    deterministic: bool = False
    """Request deterministic kernels (torch.use_deterministic_algorithms) at some speed cost."""

    tf32: bool = False
    """Run fp32 matmuls and convolutions on CUDA in TF32 (Ampere and later: inputs rounded to a
    10-bit mantissa, products summed in fp32), several times the fp32 rate. Sets
    torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32 at startup; false keeps them off
    (full fp32). MFU of an fp32 run divides by the TF32 peak only when this is on. No effect on
    CPUs; under bf16/fp16 it reaches only the matmuls autocast keeps in fp32 (the router's)."""

    activation_checkpointing: str = "none"
    """Recompute activations in backward: "none", "full" (every block), "moe" (only the MoE FFNs)
    or "every_n" (every activation_checkpointing_every-th block)."""

    activation_checkpointing_every: int = 2
    """n of activation_checkpointing="every_n"."""

    compile: bool = False
    """torch.compile each transformer block."""

    max_consecutive_skips: int = 10
    """A step whose loss or gradient is NaN/Inf is skipped on every rank (counted in the metrics as
    skipped_steps). After this many skipped steps in a row the run stops with an error and a
    checkpoint of the last good state. 0 = never stop."""

    collective_timeout_s: float = 600.0
    """Seconds a collective (all-to-all, all-reduce, barrier, ...) may wait for the other ranks once
    training starts; past it the waiting ranks fail with an error naming the phase and operation
    instead of hanging (under torchrun --max-restarts the job then restarts from the latest
    checkpoint). Data preparation before training keeps torch's default (30 min with gloo)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size"):
            require_int(f"train.{name}", getattr(self, name), min_value=1)
        require(self.global_batch_size % self.micro_batch_size == 0, "train.global_batch_size",
                self.global_batch_size,
                f"must be divisible by train.micro_batch_size ({self.micro_batch_size})")
        if self.grad_accum is not None:
            require_int("train.grad_accum", self.grad_accum, min_value=1, note=" (or None = derived)")
            require(self.global_batch_size % (self.micro_batch_size * self.grad_accum) == 0,
                    "train.global_batch_size", self.global_batch_size,
                    f"must be divisible by train.micro_batch_size * train.grad_accum "
                    f"({self.micro_batch_size} * {self.grad_accum})")
        require_int("train.seed", self.seed)
        require_choice("train.dtype", self.dtype, ("fp32", "bf16", "fp16"))
        require_int("train.eval_every", self.eval_every, note=" (0 = never)")
        require_int("train.eval_steps", self.eval_steps, min_value=1)
        require_choice("train.device", self.device, ("auto", "cpu", "cuda"))
        require_bool("train.deterministic", self.deterministic)
        require_bool("train.tf32", self.tf32)
        require_choice("train.activation_checkpointing", self.activation_checkpointing,
                       ("none", "full", "moe", "every_n"))
        require_int("train.activation_checkpointing_every", self.activation_checkpointing_every, min_value=1)
        every, default = self.activation_checkpointing_every, TrainConfig.activation_checkpointing_every
        require_active(every == default or self.activation_checkpointing == "every_n",
                       "train.activation_checkpointing_every", every, f'acts only with train.activation_checkpointing '
                       f'"every_n" (it is {self.activation_checkpointing!r}): leave it at {default}')
        require_bool("train.compile", self.compile)
        require_int("train.max_consecutive_skips", self.max_consecutive_skips, note=" (0 = never stop)")
        timeout = self.collective_timeout_s
        require(isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout)
                and timeout > 0, "train.collective_timeout_s", timeout, "must be a number of seconds > 0")

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step on each of ``dp`` data-parallel ranks; checks
        global_batch_size = micro_batch_size * grad_accum * dp."""
        per_step = self.micro_batch_size * dp
        require(self.global_batch_size % per_step == 0, "train.global_batch_size", self.global_batch_size,
                f"must be divisible by train.micro_batch_size * data-parallel size "
                f"({self.micro_batch_size} * {dp} = {per_step})")
        accum = self.global_batch_size // per_step
        require(self.grad_accum is None or self.grad_accum == accum, "train.grad_accum", self.grad_accum,
                f"must equal train.global_batch_size / (train.micro_batch_size * data-parallel size) = "
                f"{self.global_batch_size} / ({self.micro_batch_size} * {dp}) = {accum}")
        return accum


def resolve_device(name: str):
    """``torch.device`` for train.device: "auto" is CUDA only when CUDA is available."""
    import torch  # lazy: configs load without torch

    require_choice("train.device", name, ("auto", "cpu", "cuda"))
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    require(name != "cuda" or torch.cuda.is_available(), "train.device", name,
            'needs CUDA, which is not available here; use "auto" or "cpu"')
    return torch.device(name)

