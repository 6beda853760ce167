"""Config of the parallel layout. Degrees only; ``moetrain.distributed.ParallelDims`` turns them into a
DeviceMesh and does every check that needs the world size."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_bool
from moetrain.config.base import require, require_choice, require_positive


@dataclass
class ParallelConfig:
    dp: int = -1
    """Data-parallel degree of the non-expert parameters. -1 = the whole world (world / tp / pp)."""

    ep: int = 1
    """Expert-parallel degree: each EP group of `ep` consecutive ranks splits the experts among
    itself. Must divide the world size and moe.num_experts (checked by ``ParallelDims``, with the
    world size: `moetrain train`, `moetrain config show --nproc N`)."""

    ep_hierarchical: bool = False
    """Node-aware expert all-to-all for ep groups that span nodes (DeepEP's layout): a token crosses
    the inter-node link at most once per destination node, to the rank with the same local index
    there, which forwards it inside the node to the ranks holding its experts (once per rank,
    whatever moe.dispatch_dedup says); the combine sums a node's partial outputs before the one row
    per token and node goes home. Cuts inter-node bytes whenever a token has several experts on
    one node (see ``moetrain plan``); adds intra-node hops. Needs each spanning ep group to be
    whole nodes (parallel.ep a multiple of the processes per node, checked by ``ParallelDims``).
    Where the ep group lies inside one node there is no inter-node traffic to save: the flat
    exchange runs, and the log says so."""

    tp: int = 1
    """Tensor-parallel degree (reserved; only 1 is supported)."""

    pp: int = 1
    """Pipeline-parallel degree (reserved; only 1 is supported)."""

    zero_stage: int = 0
    """0 = replicated (DDP); 1 = optimizer states sharded over the data-parallel ranks (experts'
    over edp); 2 = gradients too (FSDP2, parameters kept gathered from forward to backward);
    3 = parameters too (FSDP2 ``fully_shard``). Check the cost first with ``moetrain plan``; do not
    use 3 when a lower stage fits (it gathers every block twice per step)."""

    hsdp_replicate: int = 1
    """Hybrid sharding at zero_stage 2/3: the dense parameters shard over groups of world /
    hsdp_replicate consecutive ranks (a node) and are replicated across the hsdp_replicate groups
    (an all-reduce of the shards crosses nodes instead of every all-gather). 1 = plain FSDP."""

    backend: str = "auto"
    """torch.distributed backend: "auto" (nccl with CUDA, else gloo), "gloo" or "nccl"."""

    def __post_init__(self) -> None:
        require(self.dp == -1 or (isinstance(self.dp, int) and self.dp >= 1), "parallel.dp", self.dp,
                "must be -1 (auto) or >= 1")
        require_positive("parallel.ep", self.ep)
        require_bool("parallel.ep_hierarchical", self.ep_hierarchical)
        require(not self.ep_hierarchical or self.ep > 1, "parallel.ep_hierarchical", self.ep_hierarchical,
                f"needs parallel.ep > 1 (is {self.ep}): without expert parallelism nothing is exchanged")
        require(self.tp == 1, "parallel.tp", self.tp, "must be 1 (tensor parallelism is not supported yet)")
        require(self.pp == 1, "parallel.pp", self.pp, "must be 1 (pipeline parallelism is not supported yet)")
        require_choice("parallel.zero_stage", self.zero_stage, (0, 1, 2, 3))
        require(isinstance(self.hsdp_replicate, int) and not isinstance(self.hsdp_replicate, bool)
                and self.hsdp_replicate >= 1, "parallel.hsdp_replicate", self.hsdp_replicate, "must be an int >= 1")
        require(self.hsdp_replicate == 1 or self.zero_stage >= 2, "parallel.hsdp_replicate", self.hsdp_replicate,
                f"needs parallel.zero_stage >= 2 (is {self.zero_stage}): stages 0/1 replicate the parameters anyway")
        require_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
