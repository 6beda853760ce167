"""Gradient reduction at ZeRO stages 0/1 when tensor parallelism is on (``parallel.tp > 1``).

Every gradient follows ``moetrain.distributed.data_parallel.finalize``'s rule: scaled by 1/dp and
summed over the ranks that hold a copy of its parameter (dp for the tp-split weights, dp x tp for
what the tp ranks keep whole, edp for the expert shards). A Partial gradient (a sequence-parallel
norm weight), once summed, is handed back as a Replicate DTensor.

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
from torch.distributed.tensor import DTensor

from moetrain.distributed.data_parallel.finalize import (
    GradReduction,
    copies_axis,
    grad_reduction,
    is_partial_grad,
    mark_summed,
)
from moetrain.distributed.parallel_dims import ParallelDims


class TensorParallelDataParallel(nn.Module):
    """Wraps a tensor-parallel model (``apply_tensor_parallel`` and ``apply_expert_parallel``
    applied) and reduces every gradient as the module docstring says. ``module`` is the model."""

    def __init__(self, module: nn.Module, dims: ParallelDims) -> None:
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._rule = {id(p): grad_reduction(dims, copies_axis(p)) for p in trainable}
        self._position = {id(p): i for i, p in enumerate(reversed(trainable))}
        self._params = trainable
        self._sync = self._callback_queued = False
        self._ready: dict[int, tuple[torch.Tensor, GradReduction]] = {}
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
        assert p.grad is not None  # the hook runs once the gradient is accumulated
        grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        if is_partial_grad(p):
            self._partial.append(p)
        rule = self._rule[id(p)]
        grad.mul_(rule.scale)  # before the sum: keeps low-precision gradients in range
        self._ready[self._position[id(p)]] = (grad, rule)
        self._num_reduced += 1
        # Launch in the fixed order, up to the first gradient not ready yet: collectives on a
        # group pair up by issue order, and hook order follows the autograd engine's threads.
        while self._num_launched in self._ready:
            grad, rule = self._ready.pop(self._num_launched)
            self._num_launched += 1
            if rule.group is not None:
                self._pending.append(dist.all_reduce(grad, group=rule.group, async_op=True))

    def _finish(self) -> None:
        for work in self._pending:
            work.wait()
        assert self._num_reduced == len(self._params), (
            f"{self._num_reduced} of {len(self._params)} gradients were reduced: a parameter took no part in "
            "the forward")
        for p in self._partial:
            mark_summed(p)
        self._pending, self._partial, self._callback_queued = [], [], False
        self._num_reduced = self._num_launched = 0
