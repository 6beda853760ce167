"""Config of the parallel layout. Degrees only; ``moetrain.distributed.ParallelDims`` turns them into a
DeviceMesh and does every check that needs the world size."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.base import require, require_choice, require_positive


@dataclass
class ParallelConfig:
    dp: int = -1
    """Data-parallel degree of the non-expert parameters. -1 = the whole world (world / tp / pp)."""

    ep: int = 1
    """Expert-parallel degree: each EP group of `ep` consecutive ranks splits the experts among
    itself. Must divide the world size and moe.num_experts."""

    tp: int = 1
    """Tensor-parallel degree (reserved; only 1 is supported)."""

    pp: int = 1
    """Pipeline-parallel degree (reserved; only 1 is supported)."""

    zero_stage: int = 0
    """0 = replicated (DDP); 1/2/3 = ZeRO optimizer / +gradient / +parameter sharding."""

    backend: str = "auto"
    """torch.distributed backend: "auto" (nccl with CUDA, else gloo), "gloo" or "nccl"."""

    def __post_init__(self) -> None:
        require(self.dp == -1 or (isinstance(self.dp, int) and self.dp >= 1), "parallel.dp", self.dp,
                "must be -1 (auto) or >= 1")
        require_positive("parallel.ep", self.ep)
        require(self.tp == 1, "parallel.tp", self.tp, "must be 1 (tensor parallelism is not supported yet)")
        require(self.pp == 1, "parallel.pp", self.pp, "must be 1 (pipeline parallelism is not supported yet)")
        require_choice("parallel.zero_stage", self.zero_stage, (0, 1, 2, 3))
        require_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
