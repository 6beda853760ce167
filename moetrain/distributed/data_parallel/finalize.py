"""Every data-parallel gradient reduction of a step, after its last backward, and the one rule they
all follow (Megatron-Core's ``finalize_model_grads`` is the model).

The rule. Each rank's loss is the mean over its dp index's batch (the tp ranks of one dp index
compute the same loss), so every gradient must be (1/dp) * the sum of the local gradients over
the ranks that hold a copy of the parameter, each rank's local gradient covering only its own
tokens or heads. Which ranks hold a copy, by kind of parameter (``copies_axis``):

    split over tp (column/row-wise weights, vocab shards)   its dp group          (dp ranks)
    replicated over tp, gradient Partial (sequence-parallel
        norm weights: each tp rank saw S/tp positions)      its dp_tp group       (dp * tp ranks)
    plain (router, shared experts, experts at ep = 1, per-
        head q/k norms: local tokens or heads)              its dp_tp group       (dp * tp ranks)
    experts sharded over ep (and etp)                        its edp group   (dp * tp / (ep * etp) ranks)

so one rule covers all: scale by 1/dp, sum over the copies (``grad_reduction``). At tp = 1 the
dp_tp group is the dp group and a replicated parameter's rule is DDP's mean; an expert shard's
is (sum over edp) / W, not the mean over edp, which would leave it ``ep`` times too large (see
``moetrain.distributed.data_parallel.ddp``). A Partial gradient, once summed, is the whole
gradient on every copy and is handed back as a Replicate DTensor, so the norm and the optimizer
see an ordinary replicated gradient.

Who applies it, and when (``finalize_grads``):

    MoEDataParallel, TensorParallelDataParallel   in backward hooks, as each gradient is ready
                                                  (overlapping the backward), waited for at its end
    FSDP2 units (ZeRO-2/3)                        reduce-scatter in their post-backward, with the
                                                  rule's divisor and the copies' mesh
    anything else (pipeline stages at ZeRO 0/1)   ``reduce_grads`` after the last backward
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from moetrain.distributed.expert_parallel.apply import is_expert_shard
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.utils.tensors import local_tensor

COPIES_AXES = ("dp_tp", "dp", "edp")


def copies_axis(p: torch.Tensor) -> str:
    """The mesh axis of the ranks holding a copy of parameter ``p``: "edp" for an expert shard,
    "dp" for a weight split over tp, "dp_tp" for everything else (the module docstring's table)."""
    if is_expert_shard(p):
        return "edp"
    if isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements):
        return "dp"
    return "dp_tp"


@dataclass(frozen=True)
class GradReduction:
    """How the gradients of the parameters copied over one mesh axis become the one-process
    gradient: multiplied by ``scale`` (= 1 / ``divisor``), then summed over ``group``."""

    axis: str
    """"dp", "dp_tp" or "edp": the ranks holding a copy."""
    divisor: int
    """The data-parallel degree: each rank's loss is a mean over its dp index's tokens."""
    size: int
    """Ranks in the group."""
    group: dist.ProcessGroup | None
    """The group to sum over; None when this rank holds the only copy."""

    @property
    def scale(self) -> float:
        return 1.0 / self.divisor


def grad_reduction(dims: ParallelDims, axis: str) -> GradReduction:
    """The data-parallel gradient rule for the parameters copied over ``axis`` (see
    ``copies_axis``): scale by 1/dp, sum over the copies. Every reduction applies this."""
    if axis not in COPIES_AXES:
        raise ValueError(f"copies axis {axis!r} must be one of {', '.join(map(repr, COPIES_AXES))}")
    size = dims.degree(axis)
    return GradReduction(axis=axis, divisor=dims.dp, size=size, group=dims.group(axis) if size > 1 else None)


def is_partial_grad(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient is a Partial DTensor (a sum over ranks still to be taken)."""
    return isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)


def mark_summed(p: torch.Tensor) -> None:
    """``p``'s Partial gradient, once all-reduced in place, as the Replicate DTensor it now is (no
    communication): the norm and the optimizer then see an ordinary replicated gradient."""
    g = p.grad
    assert isinstance(g, DTensor), "only a DTensor gradient can be Partial"
    p.grad = DTensor.from_local(g._local_tensor, g.device_mesh, [Replicate()] * g.device_mesh.ndim,
                                run_check=False, shape=g.shape, stride=g.stride())


GRAD_TIMER = "grad_timer"
"""The attribute of a model whose ``CommTimer`` times ``reduce_grads`` (``log.comm_timing``)."""


@torch.no_grad()
def reduce_grads(model: nn.Module, dims: ParallelDims) -> None:
    """Apply the rule to every gradient of ``model`` now: each scaled by 1/dp and summed over its
    copies; a Partial gradient (a sequence-parallel norm weight) becomes Replicate. One flat
    all-reduce per group and dtype; every rank of a group must hold the same parameters in the same
    order. Collective over the copies groups; timed as "grad_reduce" with log.comm_timing."""
    timer = getattr(model, GRAD_TIMER, None)
    with timer.span("grad_reduce") if timer is not None else contextlib.nullcontext():
        _reduce_grads(model, dims)


def _reduce_grads(model: nn.Module, dims: ParallelDims) -> None:
    rules = {axis: grad_reduction(dims, axis) for axis in COPIES_AXES}
    # Keyed by the group itself: at tp = 1 the dp and dp_tp groups are one, and one buffer.
    buckets: dict[tuple[int, torch.dtype], tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        rule = rules[copies_axis(p)]
        grad = local_tensor(p.grad)
        grad.mul_(rule.scale)  # before the sum: keeps low-precision gradients in range
        if rule.group is not None:
            buckets.setdefault((id(rule.group), grad.dtype), (rule.group, []))[1].append(grad)
        if is_partial_grad(p):
            mark_summed(p)  # the local tensor is reduced in place below
    for group, grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def finalize_grads(model: nn.Module, dims: ParallelDims) -> None:
    """Finish every data-parallel gradient reduction of a step; call once after its last backward
    (the model as the step ran it: a wrapper, an FSDP2 model or the stages of a pipeline). Then
    every gradient is this rank's part of the one-process gradient of the global batch.

    A wrapper reducing in backward hooks and FSDP2 units have done their part inside the backward,
    overlapping it, so nothing is left for them; any other model is reduced here
    (``reduce_grads``). Nothing to do when this rank holds the only copy of everything."""
    from moetrain.distributed.data_parallel.ddp import MoEDataParallel
    from moetrain.distributed.data_parallel.tp_reduction import TensorParallelDataParallel

    if isinstance(model, (MoEDataParallel, TensorParallelDataParallel)):
        return
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return
    if dims.dp_tp == 1:  # dp = tp = edp = 1: scale 1, nothing to sum
        return
    reduce_grads(model, dims)
