"""Gradients of a model split into pipeline stages: the data-parallel reduction of one stage at
ZeRO stages 0/1 (after the schedule), and the global norm and clipping over every stage.
See ``moetrain.distributed.pipeline.stages`` for why the stages are not wrapped in DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetrain.distributed.data_parallel.grads import clip_to_norm_, global_grad_norm
from moetrain.distributed.data_parallel.tp_reduction import copies_group, is_partial_grad, mark_summed
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.utils.tensors import local_tensor


@torch.no_grad()
def reduce_stage_gradients(model: nn.Module, dims: ParallelDims) -> None:
    """The data-parallel gradient reduction of one stage at ZeRO stages 0/1, after the schedule's
    last backward, by ``moetrain.distributed.data_parallel.tp_reduction``'s rule: every gradient scaled by
    1 / dp and summed over the ranks holding a copy of its parameter (dense: dp, or dp x tp for
    what the tp ranks keep whole; tp-split weights: dp; expert shards: edp). A Partial gradient
    (a sequence-parallel norm weight) is whole once summed and becomes Replicate. One all-reduce
    per group and dtype, every rank of a group with the same parameters in the same order."""
    buckets: dict[tuple[int, torch.dtype], tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        grad = local_tensor(p.grad)
        grad.mul_(1.0 / dims.dp)  # before the sum: keeps low-precision gradients in range
        group, _ = copies_group(p, dims)
        if group is not None:
            buckets.setdefault((id(group), grad.dtype), (group, []))[1].append(grad)
        if is_partial_grad(p):
            mark_summed(p)  # the local tensor is reduced in place below
    for group, grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
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
