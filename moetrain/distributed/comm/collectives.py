"""Collectives the other modules share: names across torch versions, and the mean of a per-rank
scalar over the data-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetrain.distributed.parallel_dims import ParallelDims

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (same arguments) and
# deprecates the old names.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def mean_over_dp(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Mean of a per-rank scalar (e.g. the loss) over the data-parallel ranks: with equal local
    batches, the single-process value of the global batch."""
    out = value.detach().clone().to(comm_device(dims))
    if dims.dp > 1:
        dist.all_reduce(out, group=dims.group("dp"))
        out /= dims.dp
    return out


def comm_device(dims: ParallelDims) -> torch.device:
    """The device the process group's collectives take tensors on (cuda for nccl, else cpu)."""
    return torch.device(dims.mesh.device_type) if dims.mesh is not None else torch.device("cpu")
