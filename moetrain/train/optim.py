"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """AdamW groups: matrices (and stacked expert matrices) decay; norms, biases and other
    vectors do not (decaying a norm gain pulls it towards zero, not towards "simple")."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float) -> torch.optim.Optimizer:
    # foreach=False: the fused multi-tensor path does not accept a mix of DTensor expert
    # weights and plain tensors in one group.
    return torch.optim.AdamW(param_groups(model, weight_decay=weight_decay), lr=lr, betas=betas, eps=eps,
                             foreach=False)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          schedule: str) -> float:
    """Linear warmup from lr/warmup to lr, then cosine decay to min_lr at total_steps
    ("constant": stays at lr after warmup). ``step`` counts from 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, **kwargs) -> torch.optim.lr_scheduler.LambdaLR:
    base = kwargs["lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, **kwargs) / base)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded_axes(g: torch.Tensor) -> tuple[int, ...]:
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
    local norm is already global. A DTensor gradient holds only this rank's shard (experts over
    ep, ZeRO-2/3 shards over dp, expert shards over edp as well): its squared norm is summed over
    every mesh axis it is not replicated on (HSDP's replicate axis is skipped).

    Collective over those axes: every rank must call it with the same parameters in the same order.
    """
    replicated_sq = torch.zeros((), dtype=torch.float32)
    sharded_sq: dict[object, tuple] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        sq = _local(g).float().pow(2).sum()
        mesh = getattr(g, "device_mesh", None)
        if mesh is None:
            replicated_sq = replicated_sq.to(sq.device) + sq
            continue
        shard_axes = _sharded_axes(g)
        key = (id(mesh), shard_axes)
        if key not in sharded_sq:
            sharded_sq[key] = (mesh, shard_axes, torch.zeros((), dtype=torch.float32, device=sq.device))
        m, axes, acc = sharded_sq[key]
        sharded_sq[key] = (m, axes, acc + sq)
    total_sq = replicated_sq
    for mesh, axes, acc in sharded_sq.values():
        for axis in axes:
            dist.all_reduce(acc, group=mesh.get_group(axis))
        total_sq = total_sq.to(acc.device) + acc
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm``; returns the norm before
    clipping (a tensor: reading it is a host sync, which the trainer does once per log step)."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            _local(p.grad).mul_(scale.to(_local(p.grad).device))
    return norm
