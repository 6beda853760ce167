"""Gradient reduction at ZeRO stages 0/1 when tensor parallelism is on (``parallel.tp > 1``).

Each rank's loss is the mean over its dp index's batch (the tp ranks of one dp index compute the
same loss), so every gradient must be (1/dp) * the sum of the local gradients over the ranks that
hold a copy of the parameter, each rank's local gradient covering only its own tokens or heads.
Which ranks hold a copy, by kind of parameter (``moetrain.distributed.tensor_parallel``):

    split over tp (column/row-wise weights, vocab shards)   its dp group          (dp ranks)
    replicated over tp, gradient Partial (sequence-parallel
        norm weights: each tp rank saw S/tp positions)      its dp_tp group       (dp * tp ranks)
    plain (router, shared experts, experts at ep = 1, per-
        head q/k norms: local tokens or heads)              its dp_tp group       (dp * tp ranks)
    experts sharded over ep (and etp)                        its edp group   (dp * tp / (ep * etp) ranks)

so one rule covers all: scale by 1/dp, sum over the copies. (With tp = 1 the same rule is
``MoEDataParallel``'s: dense over dp with DDP's mean, experts over edp with 1/W.) A Partial
gradient, once summed, is the whole gradient on every copy and is handed back as a Replicate
DTensor, so the norm and the optimizer see an ordinary replicated gradient.

The reductions are launched asynchronously from each parameter's post-accumulate hook in one
order fixed for all ranks (reverse parameter order, the order the backward reaches them), and
waited for at the end of the backward: they overlap it as DDP's buckets do. ``no_sync()`` skips
them for the non-final micro-steps of gradient accumulation.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor, Replicate

from moetrain.distributed.expert_parallel.apply import is_expert_shard
from moetrain.distributed.parallel_dims import ParallelDims


def copies_group(p: torch.Tensor, dims: ParallelDims) -> tuple[dist.ProcessGroup | None, int]:
    """The process group over which parameter ``p``'s gradient is summed, and its size (None when
    this rank holds the only copy): see the module docstring's table."""
    if is_expert_shard(p):
        return (dims.edp_group if dims.edp > 1 else None), dims.edp
    if isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements):
        return (dims.dp_group if dims.dp > 1 else None), dims.dp
    return (dims.dp_tp_group if dims.dp_tp > 1 else None), dims.dp_tp


def is_partial_grad(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient is a Partial DTensor (a sum over ranks still to be taken)."""
    return isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)


def mark_summed(p: torch.Tensor) -> None:
    """``p``'s Partial gradient, once all-reduced in place, as the Replicate DTensor it now is (no
    communication): the norm and the optimizer then see an ordinary replicated gradient."""
    g = p.grad
    p.grad = DTensor.from_local(g._local_tensor, g.device_mesh, [Replicate()] * g.device_mesh.ndim,
                                run_check=False, shape=g.shape, stride=g.stride())


class TensorParallelDataParallel(nn.Module):
    """Wraps a tensor-parallel model (``apply_tensor_parallel`` and ``apply_expert_parallel``
    applied) and reduces every gradient as the module docstring says. ``module`` is the model."""

    def __init__(self, module: nn.Module, dims: ParallelDims) -> None:
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self._scale = 1.0 / dims.dp
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._group = {id(p): copies_group(p, dims)[0] for p in trainable}
        self._position = {id(p): i for i, p in enumerate(reversed(trainable))}
        self._params = trainable
        self._sync = self._callback_queued = False
        self._ready: dict[int, tuple[torch.Tensor, dist.ProcessGroup | None]] = {}
        self._pending: list[dist.Work] = []
        self._partial: list[torch.Tensor] = []
        self._num_reduced = self._num_launched = 0
        # A weak reference: the hooks live in C++, where they would keep this wrapper alive.
        this = weakref.ref(self)

        def grad_ready(p: torch.Tensor) -> None:
            wrapper = this()
            if wrapper is not None:
                wrapper._grad_ready(p)

        for p in trainable:
            p.register_post_accumulate_grad_hook(grad_ready)

    def forward(self, *args, **kwargs):
        # Decided at forward time, like DDP: a backward belongs to the forward before it.
        self._sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the reductions (non-final micro-steps); gradients keep accumulating locally."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @torch.no_grad()
    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        if is_partial_grad(p):
            self._partial.append(p)
        grad.mul_(self._scale)  # before the sum: keeps low-precision gradients in range
        self._ready[self._position[id(p)]] = (grad, self._group[id(p)])
        self._num_reduced += 1
        # Launch in the fixed order, up to the first gradient not ready yet: collectives on a
        # group pair up by issue order, and hook order follows the autograd engine's threads.
        while self._num_launched in self._ready:
            grad, group = self._ready.pop(self._num_launched)
            self._num_launched += 1
            if group is not None:
                self._pending.append(dist.all_reduce(grad, group=group, async_op=True))

    def _finish(self) -> None:
        for work in self._pending:
            work.wait()
        assert self._num_reduced == len(self._params), \
            f"{self._num_reduced} of {len(self._params)} gradients were reduced: a parameter took no part in the forward"
        for p in self._partial:
            mark_summed(p)
        self._pending, self._partial, self._callback_queued = [], [], False
        self._num_reduced = self._num_launched = 0
