"""Small distributed helpers the trainer needs around a parallelised model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetrain.distributed.expert_parallel import is_expert_shard


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def grad_norm(model: nn.Module, dims) -> torch.Tensor:
    """Global L2 norm of all gradients, the one the single-process model would have.

    Replicated gradients (after the DDP reduction) are counted once; expert shards are summed over
    the ``ep`` group, which together holds every expert once (the edp copies are identical).
    """
    replicated_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    for p in unwrap(model).parameters():
        if p.grad is None:
            continue
        if is_expert_shard(p):
            expert_sq += p.grad.to_local().double().square().sum().cpu()
        else:
            replicated_sq += p.grad.double().square().sum().cpu()
    if dims.ep > 1:
        expert_sq = expert_sq.to(_comm_device(dims))
        dist.all_reduce(expert_sq, group=dims.ep_group)
    return (replicated_sq + expert_sq.cpu()).sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float, dims, *, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients so that the global norm is at most ``max_norm``; returns the norm before.
    Unlike ``torch.nn.utils.clip_grad_norm_`` it accepts a mix of plain and DTensor gradients."""
    total = grad_norm(model, dims)
    scale = min(1.0, max_norm / (total.item() + eps))  # host sync: one scalar per step
    if scale < 1.0:
        with torch.no_grad():
            for p in unwrap(model).parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if is_expert_shard(p) else p.grad
                    g.mul_(scale)
    return total.float()


def mean_over_dp(value: torch.Tensor, dims) -> torch.Tensor:
    """Mean of a per-rank scalar (e.g. the loss) over the data-parallel ranks: with equal local
    batches, the single-process value of the global batch."""
    out = value.detach().clone().to(_comm_device(dims))
    if dims.dp > 1:
        dist.all_reduce(out, group=dims.dp_group)
        out /= dims.dp
    return out


def _comm_device(dims) -> torch.device:
    return torch.device(dims.mesh.device_type) if dims.mesh is not None else torch.device("cpu")
