"""Parallel layouts on one DeviceMesh, applied to a single-device model from outside.

    parallel_dims.py    degrees, the mesh, every layout rule, the rank order
    parallelize.py      the one call that applies everything, in a fixed order
    tensor_parallel.py  the dense part over tp (sequence parallel), MoE layers folded over tp
    runtime.py          process group, device, timeouts, launcher nodes, shutdown
    expert_parallel/    experts over ep: the all-to-all dispatcher, its exchanges and wire formats,
                        hierarchical (node-aware) exchange, expert tensor parallelism
    data_parallel/      DDP-style reduction (and its tp variant), ZeRO-1, FSDP2, gradient
                        compression and 1-bit Adam, the gradient norm
    pipeline/           stages on torch.distributed.pipelining and their gradients
    comm/               shared collectives, byte counters, timers
"""

from moetrain.distributed.comm.collectives import mean_over_dp
from moetrain.distributed.comm.stats import CommStats
from moetrain.distributed.data_parallel.ddp import (
    MoEDataParallel,
    apply_data_parallel,
    no_sync,
    unwrap,
    wrap_optimizer,
)
from moetrain.distributed.data_parallel.grads import (
    clip_global_grad_norm_,
    clip_model_grad_norm_,
    global_grad_norm,
    grad_norm,
)
from moetrain.distributed.expert_parallel.apply import (
    apply_expert_parallel,
    build_dispatcher,
    collect_comm_stats,
    is_expert_shard,
    shard_experts,
)
from moetrain.distributed.expert_parallel.dispatcher import AllToAllDispatcher
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import apply_activation_checkpointing, checkpoint_blocks, parallelize

__all__ = [
    "AllToAllDispatcher",
    "CommStats",
    "MoEDataParallel",
    "ParallelDims",
    "apply_activation_checkpointing",
    "apply_data_parallel",
    "apply_expert_parallel",
    "build_dispatcher",
    "checkpoint_blocks",
    "clip_global_grad_norm_",
    "clip_model_grad_norm_",
    "collect_comm_stats",
    "global_grad_norm",
    "grad_norm",
    "is_expert_shard",
    "mean_over_dp",
    "no_sync",
    "parallelize",
    "shard_experts",
    "unwrap",
    "wrap_optimizer",
]
