"""Gradients of a parallelised model after backward: the global norm (the one a single process
holding the whole model computes) and clipping to it, over one stage or every pipeline stage."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.distributed.data_parallel.ddp import unwrap
from moetrain.utils.tensors import local_tensor


def _sharded_axes(g: DTensor) -> tuple[int, ...]:
    """Mesh axes over which a DTensor gradient's squared norm must be summed: every axis whose
    placement is not Replicate. Not ``placement.is_shard()``: FSDP2 sharding an ep-sharded
    expert weight over edp uses ``_StridedShard``, whose ``is_shard()`` is False, and that sum
    would be silently skipped. A Partial gradient (pending sum) has no local norm to add."""
    axes = []
    for axis, placement in enumerate(g.placements):
        if placement.is_partial():
            raise ValueError(f"gradient placement {placement} on mesh axis {axis} is Partial: reduce "
                             "gradients before taking their norm")
        if not placement.is_replicate():
            axes.append(axis)
    return tuple(axes)


@torch.no_grad()
def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of the gradient of the *global* model.

    Plain (replicated) gradients are identical on every rank after the gradient sync, so their
    local norm is already global (not after 1-bit Adam's warmup, which syncs no gradient: each
    rank then gets the norm of its own local gradients, as DeepSpeed's 1-bit Adam clips). A
    DTensor gradient holds only this rank's shard (experts over ep, tensor-parallel weights over
    tp, ZeRO-2/3 shards over dp, expert shards over edp as well):
    its squared norm is summed over every mesh axis it is not replicated on, so a tp-replicated
    gradient (a sequence-parallel norm weight) counts once and an expert shard once per ep rank
    (HSDP's replicate axis is skipped).

    Collective over those axes: every rank must call it with the same parameters in the same order.
    """
    # Gradients summed alike (plain ones, or DTensors over the same mesh axes) share one
    # multi-tensor norm: a few kernel launches per group, not three per parameter.
    groups: dict[object, tuple] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            mesh, axes = g.device_mesh, _sharded_axes(g)
            key: object = (id(mesh), axes)
        else:
            mesh, axes, key = None, (), None
        groups.setdefault(key, (mesh, axes, []))[2].append(local_tensor(g))
    total_sq = torch.zeros((), dtype=torch.float32)
    for mesh, axes, grads in groups.values():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        sq = torch.linalg.vector_norm(torch.stack(norms)).square()
        for axis in axes:
            dist.all_reduce(sq, group=mesh.get_group(axis))
        total_sq = total_sq.to(sq.device) + sq
    return total_sq.sqrt()


def grad_norm(model: nn.Module) -> torch.Tensor:
    """Global L2 norm of all gradients of a (wrapped) model: the norm one process holding the
    whole model would compute (the mesh comes from the DTensor gradients themselves)."""
    return global_grad_norm(list(unwrap(model).parameters()))


@torch.no_grad()
def clip_global_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` so their global norm (:func:`global_grad_norm`) is at
    most ``max_norm``; returns the norm before clipping (a tensor: reading it is a host sync,
    which the trainer does once per log step). Collective, like the norm."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    clip_to_norm_(params, norm, max_norm)
    return norm


@torch.no_grad()
def clip_to_norm_(params: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients of ``params``, whose global norm is ``norm``, to at most ``max_norm``
    (no-op for ``max_norm <= 0``); on device, no host sync."""
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            assert p.grad is not None, "clip_to_norm_ takes parameters with gradients"
            grad = local_tensor(p.grad)
            by_device.setdefault(grad.device, []).append(grad)
        for device, grads in by_device.items():
            # One multi-tensor kernel per device, not one launch per parameter.
            torch._foreach_mul_(grads, scale.to(device))


def clip_model_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """:func:`clip_global_grad_norm_` over all parameters of a (wrapped) model."""
    return clip_global_grad_norm_(list(unwrap(model).parameters()), max_norm)
