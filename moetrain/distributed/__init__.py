"""Parallel layouts: expert parallelism (all-to-all) x data parallelism, on one DeviceMesh."""

from moetrain.distributed.all_to_all import AllToAllDispatcher
from moetrain.distributed.comm_stats import CommStats
from moetrain.distributed.data_parallel import MoEDataParallel, apply_data_parallel, no_sync, wrap_optimizer
from moetrain.distributed.expert_parallel import (
    apply_expert_parallel,
    build_dispatcher,
    collect_comm_stats,
    is_expert_shard,
    shard_experts,
)
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import apply_activation_checkpointing, checkpoint_blocks, parallelize
from moetrain.distributed.utils import (
    clip_global_grad_norm_,
    clip_model_grad_norm_,
    global_grad_norm,
    grad_norm,
    mean_over_dp,
    unwrap,
)

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
