"""Data parallelism with expert-aware gradient scaling, at every ZeRO stage.

    stage 0: replicated parameters, DDP (this module)
    stage 1: DDP here, plus the optimizer-state sharding of ``moetrain.distributed.zero``
    stage 2/3: FSDP2, ``moetrain.distributed.fsdp``

``apply_data_parallel`` picks the wrapper, ``wrap_optimizer`` the optimizer, and ``no_sync`` works
for all of them.

Why expert gradients need their own rule. Each rank's loss is the mean over its own T_local
tokens and the single-process loss of the global batch is the mean of the W per-rank losses, so
every gradient must equal (1/W) * sum over ranks of that rank's local gradient.

* Non-expert parameters are replicated on all W ranks and see only local tokens: DDP's average
  over the dp group (sum / W) is exactly right.
* An expert shard receives, through the all-to-all's backward, the gradient contributions of all
  ``ep`` ranks of its ep group. Its ``edp`` copies (one per ep group) together cover all W ranks,
  so the right gradient is (sum over edp) / W. Averaging over edp (sum / edp) instead leaves it
  ``ep`` times too large: the classic silent EP bug.

DDP handles the non-expert parameters (bucketed, overlapped with backward); the expert shards
(DTensors) are hidden from it and reduced by hooks here, with the same ``no_sync`` switch.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from moetrain.config.job import JobConfig
from moetrain.distributed.expert_parallel import is_expert_shard
from moetrain.distributed.parallel_dims import ParallelDims

_DDP_HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters


class MoEDataParallel(DistributedDataParallel):
    """DDP over the ``dp`` group for the replicated parameters, plus the expert-shard reduction
    over ``edp`` with the 1/W scale (see the module docstring).

    ``no_sync()`` (from DDP) skips both reductions, for the non-final micro-steps of gradient
    accumulation; the gradients keep accumulating locally and the next synced backward reduces
    the sum.
    """

    def __init__(self, module: nn.Module, dims: ParallelDims, *, bucket_cap_mb: float = 25.0) -> None:
        expert_names = [n for n, p in module.named_parameters() if is_expert_shard(p)]
        # DDP cannot all-reduce DTensor shards and must not average them over all ranks anyway.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, expert_names)
        # No buffer broadcast before every forward: the model's buffers are deterministic or
        # per-rank statistics (tokens_per_expert), so it would only cost time. (The flag was
        # renamed in torch 2.13; older releases only know broadcast_buffers.)
        no_buffer_sync = ({"forward_sync_buffers": False} if _DDP_HAS_FORWARD_SYNC_BUFFERS
                          else {"broadcast_buffers": False})
        # gradient_as_bucket_view: the gradients are views into DDP's flat buckets instead of a
        # second full-size copy next to them, so replicated gradients cost 1x, not 2x, memory.
        super().__init__(module, process_group=dims.dp_group, bucket_cap_mb=bucket_cap_mb,
                         gradient_as_bucket_view=True, **no_buffer_sync)
        params = dict(module.named_parameters())
        self._expert_params = [params[n] for n in expert_names]
        self._edp_group = dims.edp_group if dims.edp > 1 else None
        self._expert_grad_scale = 1.0 / dims.dp
        self._sync_experts = False
        self._callback_queued = False
        self._pending: list[dist.Work] = []
        self._num_reduced = 0
        # Tensor hooks live in C++, where the garbage collector cannot see them: a bound method
        # there would keep this wrapper (and its process groups) alive until interpreter
        # shutdown, when gloo's worker threads can no longer take the GIL and abort the process.
        this = weakref.ref(self)

        def expert_grad_ready(p: torch.Tensor) -> None:
            wrapper = this()
            if wrapper is not None:
                wrapper._expert_grad_ready(p)

        for p in self._expert_params:
            p.register_post_accumulate_grad_hook(expert_grad_ready)

    def forward(self, *args, **kwargs):
        # Decided at forward time, like DDP itself: a backward belongs to the forward before it.
        self._sync_experts = torch.is_grad_enabled() and self.require_backward_grad_sync
        return super().forward(*args, **kwargs)

    def _expert_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync_experts:
            return
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish_expert_sync)
            self._callback_queued = True
        with torch.no_grad():
            grad = p.grad.to_local()  # under no_grad, the DTensor's own local storage
            # Divide before the sum: keeps low-precision gradients in range.
            grad.mul_(self._expert_grad_scale)
            if self._edp_group is not None:
                self._pending.append(dist.all_reduce(grad, group=self._edp_group, async_op=True))
        self._num_reduced += 1

    def _finish_expert_sync(self) -> None:
        for work in self._pending:
            work.wait()
        # Internal invariant: the hooks fire in the same order on every rank only if every expert
        # weight took part in the forward (GroupedExperts uses its weights even with no tokens).
        assert self._num_reduced == len(self._expert_params), \
            f"{self._num_reduced} of {len(self._expert_params)} expert gradients were reduced"
        self._pending, self._num_reduced, self._callback_queued = [], 0, False


def apply_data_parallel(model: nn.Module, dims: ParallelDims, *, bucket_cap_mb: float = 25.0, zero_stage: int = 0,
                        blocks: list[nn.Module] | None = None, mixed_precision: str = "fp32",
                        offload_params: bool = False, offload_optimizer: bool = False, pin_memory: bool = True,
                        hsdp_replicate: int = 1) -> nn.Module:
    """Wrap ``model`` for data parallelism at ZeRO stage ``zero_stage``.

    Stages 0 and 1: ``MoEDataParallel`` (DDP) when ``dims.dp > 1``, else ``model`` unchanged;
    stage 1 also needs its optimizer passed through ``wrap_optimizer``. Stages 2 and 3: FSDP2
    units over ``blocks`` and the root (see ``moetrain.distributed.fsdp``), returning ``model``
    itself, now an ``FSDPModule``. ``mixed_precision`` ("fp32", "bf16", "fp16") is FSDP's
    parameter/compute dtype at stages 2/3; at stages 0/1 the trainer's autocast does that job.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero_stage ({zero_stage!r}) must be one of 0, 1, 2, 3")
    if hsdp_replicate != 1 and zero_stage < 2:
        raise ValueError(f"parallel.hsdp_replicate ({hsdp_replicate}) needs parallel.zero_stage >= 2 "
                         f"(is {zero_stage}): stages 0/1 replicate the parameters anyway")
    if offload_params and zero_stage != 3:
        raise ValueError(f"zero.offload_param ('cpu') needs parallel.zero_stage = 3 (is {zero_stage})")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("zero.offload_optimizer ('cpu') needs parallel.zero_stage >= 1 (is 0)")
    if zero_stage >= 2:
        from moetrain.distributed.fsdp import apply_fsdp

        if blocks is None:
            raise ValueError("apply_data_parallel at zero_stage >= 2 needs blocks (the FSDP units)")
        return apply_fsdp(model, dims, zero_stage=zero_stage, blocks=blocks, mixed_precision=mixed_precision,
                          offload_params=offload_params, offload_optimizer=offload_optimizer,
                          pin_memory=pin_memory, hsdp_replicate=hsdp_replicate)
    if dims.dp == 1:
        return model
    return MoEDataParallel(model, dims, bucket_cap_mb=bucket_cap_mb)


def wrap_optimizer(optimizer: torch.optim.Optimizer, dims: ParallelDims, *, zero_stage: int, offload_optimizer: bool = False,
                   bucket_numel: int = 500_000_000) -> torch.optim.Optimizer:
    """The optimizer to step for ZeRO stage ``zero_stage``: at stage 1 a ``ZeroShardedOptimizer``
    (states sharded over dp, experts' over edp); otherwise ``optimizer`` itself (at stages 2/3 it
    was built over FSDP's sharded parameters, so its states are sharded already)."""
    if zero_stage != 1:
        return optimizer
    from moetrain.distributed.zero import ZeroShardedOptimizer

    return ZeroShardedOptimizer(optimizer, dims, offload=offload_optimizer, bucket_numel=bucket_numel)


def zero_settings(cfg: JobConfig) -> dict:
    """The ``parallelize`` keyword arguments of a ``JobConfig``'s ZeRO settings (parallel.zero_stage,
    parallel.hsdp_replicate, the ``zero`` section, train.dtype).

    ``zero.reduce_bucket_size`` (elements), when changed from DeepSpeed's default, sizes DDP's
    buckets at stages 0/1 (4-byte gradients); at the default DDP keeps its own 25 MB, since one
    2 GB bucket would leave nothing to overlap with the backward. ``zero.allgather_bucket_size``
    sizes the ZeRO-1 all-gathers (pass it to ``wrap_optimizer``)."""
    z, par = cfg.zero, cfg.parallel
    return {"zero_stage": par.zero_stage, "hsdp_replicate": par.hsdp_replicate,
            "mixed_precision": cfg.train.dtype, "offload_params": z.offload_param == "cpu",
            "offload_optimizer": z.offload_optimizer == "cpu", "pin_memory": z.pin_memory,
            "bucket_cap_mb": 25.0 if z.reduce_bucket_size == 500_000_000 else z.reduce_bucket_size * 4 / 2**20}


def no_sync(model: nn.Module):
    """Context that skips the gradient reduction (non-final micro-steps of gradient accumulation),
    for DDP (stages 0/1) and FSDP2 (stages 2/3) alike. A no-op for a model that is not
    data-parallel, so the trainer calls it unconditionally."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    from moetrain.distributed.fsdp import fsdp_no_sync, is_fsdp

    if is_fsdp(model):
        return fsdp_no_sync(model)
    return contextlib.nullcontext()
