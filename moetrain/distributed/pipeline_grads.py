"""Gradients of a model split into pipeline stages: the data-parallel reduction of one stage at
ZeRO stages 0/1 (after the schedule), and the global norm and clipping over every stage.
See ``moetrain.distributed.pipeline_parallel`` for why the stages are not wrapped in DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetrain.distributed.expert_parallel import is_expert_shard
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.utils import clip_to_norm_, global_grad_norm
from moetrain.utils.tensors import local_tensor


@torch.no_grad()
def reduce_stage_gradients(model: nn.Module, dims: ParallelDims) -> None:
    """The data-parallel gradient reduction of one stage at ZeRO stages 0/1, after the schedule's
    last backward: replicated gradients averaged over dp, expert shards scaled by 1 / dp and
    summed over edp (``moetrain.distributed.data_parallel``'s rule). One all-reduce per dtype and
    group, every rank of the group with the same parameters in the same order."""
    dense, expert = [], []
    for p in model.parameters():
        if p.grad is not None:
            (expert if is_expert_shard(p) else dense).append(local_tensor(p.grad))
    for grads in expert:
        grads.mul_(1.0 / dims.dp)
    if dims.dp > 1:
        _flat_all_reduce(dense, dims.dp_group, divide_by=dims.dp)
    if dims.edp > 1:
        _flat_all_reduce(expert, dims.edp_group, divide_by=1)


def _flat_all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup, *, divide_by: int) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def clip_pipeline_grad_norm_(params: list[torch.Tensor], max_norm: float,
                             pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``clip_global_grad_norm_`` of a model split over pipeline stages: each stage's squared norm
    (already summed over its dp/ep shards by ``global_grad_norm``) summed over the pp group, so
    every rank clips by the norm of the whole model. Returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    sq = global_grad_norm(params).pow(2)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    clip_to_norm_(params, norm, max_norm)
    return norm
