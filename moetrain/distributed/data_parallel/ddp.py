"""Data parallelism with expert-aware gradient scaling, at every ZeRO stage.

    stage 0: replicated parameters, DDP (this module)
    stage 1: DDP here, plus the optimizer-state sharding of ``moetrain.distributed.data_parallel.zero1``
    stage 2/3: FSDP2, ``moetrain.distributed.data_parallel.fsdp``

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
  ``ep`` times too large: the classic silent EP bug. (With ``etp`` the ep x etp block's ranks all
  feed each slice: the same rule, edp = W / (ep * etp).)

DDP handles the non-expert parameters; the expert shards (DTensors) are hidden from it and
reduced by hooks here, with the same ``no_sync`` switch. Every gradient reduction overlaps the
backward, at every stage and in every compression mode: each DDP bucket and each expert gradient
is reduced asynchronously as soon as it is ready (FSDP2 reduce-scatters each unit in its
post-backward), proven by ``tests/distributed/test_grad_overlap.py``.

Gradient compression (``dp.grad_compression``). "bf16" (stages 0/1) swaps both reductions for a
bf16 all-reduce: a DDP communication hook for the replicated parameters, the same reduction over
edp for the expert shards. "onebit" (stage 0 only) is 1-bit Adam
(``moetrain.distributed.data_parallel.onebit_adam``): during its warmup both reductions are the fp32 ones above;
afterwards the optimizer sets *local-gradient mode* and the backward reduces nothing. Each rank
then holds its own estimate of the global gradient, which the optimizer folds into its momentum
before the momenta are averaged (``onebit_average_``, 1-bit compressed, over dp and edp):

* a replicated parameter's local gradient, as it is: the global loss is the mean of the W
  per-rank losses, so the mean over dp of the local gradients is the global gradient;
* an expert shard's local gradient times edp / W (= 1 / (ep * etp)): the mean over its edp copies of
  those is (sum over edp) / W, the rule above. Reducing the momenta with a mean over edp
  is what asks for the edp factor.

The error-feedback residuals of that average live here, per rank; ``compression_state_dict``
hands them to the checkpoint.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from moetrain.config.base import require
from moetrain.config.dp import check_grad_compression
from moetrain.config.job import JobConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.config.zero import check_offload
from moetrain.distributed.comm.timer import CommTimer
from moetrain.distributed.data_parallel.compression import Bf16AllReduce, OneBitReducer, fp32_bytes
from moetrain.distributed.data_parallel.compression_state import CompressionStateMixin
from moetrain.distributed.data_parallel.finalize import grad_reduction
from moetrain.distributed.expert_parallel.apply import is_expert_shard
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.utils.tensors import local_tensor

log = logging.getLogger("moetrain")

_DDP_HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters


class _BufferSync(TypedDict, total=False):
    """DDP's switch for the buffer broadcast before every forward, under either of its names."""

    forward_sync_buffers: bool
    broadcast_buffers: bool


class MoEDataParallel(CompressionStateMixin, DistributedDataParallel):
    """DDP over the ``dp`` group for the replicated parameters, plus the expert-shard reduction
    over ``edp`` with the 1/W scale (see the module docstring).

    ``no_sync()`` (from DDP) skips both reductions, for the non-final micro-steps of gradient
    accumulation; the gradients keep accumulating locally and the next synced backward reduces
    the sum.
    """

    def __init__(self, module: nn.Module, dims: ParallelDims, *, bucket_cap_mb: float = 25.0,
                 grad_compression: str = "none") -> None:
        expert_names = [n for n, p in module.named_parameters() if is_expert_shard(p)]
        # DDP cannot all-reduce DTensor shards and must not average them over all ranks anyway.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, expert_names)
        # No buffer broadcast before every forward: the model's buffers are deterministic or
        # per-rank statistics (tokens_per_expert), so it would only cost time. (The flag was
        # renamed in torch 2.13; older releases only know broadcast_buffers.)
        no_buffer_sync: _BufferSync = ({"forward_sync_buffers": False} if _DDP_HAS_FORWARD_SYNC_BUFFERS
                                       else {"broadcast_buffers": False})
        # The replicated parameters' rule is DDP's own mean over its group: at tp = 1 their copies
        # are the dp ranks. gradient_as_bucket_view: the gradients are views into DDP's flat
        # buckets instead of a second full-size copy next to them, so they cost 1x, not 2x, memory.
        dense = grad_reduction(dims, "dp_tp")
        assert dims.tp == 1 and dense.size == dense.divisor, "MoEDataParallel reduces over dp only"
        self._dense_divisor = dense.divisor
        super().__init__(module, process_group=dims.group("dp"), bucket_cap_mb=bucket_cap_mb,
                         gradient_as_bucket_view=True, **no_buffer_sync)
        params = dict(module.named_parameters())
        expert_names = [n for n in expert_names if params[n].requires_grad]  # frozen shards (LoRA) get no gradient
        self._expert_params = [params[n] for n in expert_names]
        experts = grad_reduction(dims, "edp")
        self._edp_group = experts.group
        self._expert_grad_scale = experts.scale
        # Local-gradient mode (module docstring): this rank's gradient stands for the sum over its
        # edp copies of the rule's 1/dp-scaled gradients.
        self._expert_local_scale = experts.size / experts.divisor
        self._local_gradients = self._sync_experts = self._callback_queued = False
        # Each expert shard's place in the launch order of the reductions, the same on every rank:
        # reverse parameter order, the order in which the backward reaches them.
        self._launch_position = {id(p): i for i, p in enumerate(reversed(self._expert_params))}
        self._ready: dict[int, torch.Tensor] = {}  # launch position -> gradient, not launched yet
        self._pending: list[dist.Work | Bf16AllReduce] = []
        self._num_reduced = self._num_launched = 0
        self.timer = CommTimer()
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
        self._setup_compression(module, dims, grad_compression, expert_names)

    # --- gradient compression ---------------------------------------------------------------------

    def _setup_compression(self, module: nn.Module, dims: ParallelDims, mode: str, expert_names: list[str]) -> None:
        self.grad_compression = mode
        self._layout = torch.tensor([dims.world_size, dims.ep, dims.dp, dims.edp, dist.get_rank()])
        self._expert_names = expert_names
        expert_set = set(expert_names)
        dense = {n: p.numel() for n, p in module.named_parameters() if n not in expert_set and p.requires_grad}
        experts = {n: local_tensor(p).numel() for n, p in zip(expert_names, self._expert_params, strict=True)}
        # Bytes per synced step, counted as ring all-reduces (2 x payload) for fp32 and bf16.
        self._fp32_bytes_per_step = sum(map(fp32_bytes, dense.values()))
        if self._edp_group is not None:
            self._fp32_bytes_per_step += sum(map(fp32_bytes, experts.values()))
        self._bytes_sent, self._bytes_fp32, self._num_synced = 0, 0, 0
        self._onebit_bytes, self._num_onebit = 0, 0
        self._dense_reducer = self._expert_reducer = None
        if mode == "none":
            return
        if mode == "onebit":
            device = next(module.parameters()).device
            self._dense_params = [(n, p) for n, p in module.named_parameters() if n in dense]
            self._dense_reducer = OneBitReducer(dims.group("dp"), dense, device=device)
            if self._edp_group is not None:
                self._expert_reducer = OneBitReducer(self._edp_group, experts, device=device)
        self._register_reduce_hook()

    def _register_reduce_hook(self) -> None:
        this = weakref.ref(self)

        def hook(_state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            wrapper = this()
            assert wrapper is not None, "DDP ran a comm hook of a collected wrapper"
            return wrapper._reduce_bucket(bucket)

        # DDP checks the annotations as objects; this module's are strings (postponed evaluation).
        hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        self.register_comm_hook(None, hook)

    def enable_comm_timing(self, device: torch.device) -> None:
        """Time every gradient reduction (``log.comm_timing``), each waited for where it is
        issued; before the first forward. Uncompressed buckets then go through this module's
        hook (the same division and fp32 all-reduce as DDP's own)."""
        self.timer = CommTimer(enabled=True, device=device)
        if self.grad_compression == "none":
            self._register_reduce_hook()

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP comm hook: the bucket's mean over dp, launched asynchronously (bf16 for "bf16", cast
        back when it arrives; fp32 for "onebit" and a timed "none"), waited for where it is issued
        when timed; in 1-bit Adam's local-gradient mode, no reduction."""
        buffer = bucket.buffer()
        if self._local_gradients:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        buffer.div_(self._dense_divisor)  # as DDP without a hook: divide, then sum
        with self.timer.span("grad_reduce"):
            if self.grad_compression == "bf16":
                reduction = Bf16AllReduce([buffer], self.process_group)
                self._bytes_sent += reduction.num_bytes
                fut: torch.futures.Future[list[torch.Tensor]] = reduction.future()
            else:
                fut = dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future()
            if self.timer.enabled:
                fut.wait()  # timed where it is issued (log.comm_timing)
        return fut.then(lambda f: f.value()[0])

    # --- 1-bit Adam (moetrain.distributed.data_parallel.onebit_adam) -----------------------------------------------

    @property
    def local_gradients(self) -> bool:
        """Whether the backward leaves each rank its local gradient (1-bit Adam's compression stage)."""
        return self._local_gradients

    def set_local_gradients(self, on: bool) -> None:
        """Switch local-gradient mode (only "onebit" has one; its optimizer drives it). Takes
        effect from the next forward; every rank must be in the same mode."""
        assert not on or self.grad_compression == "onebit", f"local gradients under {self.grad_compression!r}"
        self._local_gradients = on

    def forward(self, *args, **kwargs):
        # Decided at forward time, like DDP itself: a backward belongs to the forward before it.
        self._sync_experts = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._sync_experts:
            self._bytes_fp32 += self._fp32_bytes_per_step
            self._num_synced += 1
            if self.grad_compression == "onebit" and not self._local_gradients:
                self._bytes_sent += self._fp32_bytes_per_step  # the warmup's fp32 all-reduces
        return super().forward(*args, **kwargs)

    def _expert_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync_experts:
            return
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish_expert_sync)
            self._callback_queued = True
        with torch.no_grad():
            assert isinstance(p.grad, DTensor), "an expert shard's gradient is a DTensor"
            grad = p.grad.to_local()  # under no_grad, the DTensor's own local storage
            if self._local_gradients:
                grad.mul_(self._expert_local_scale)  # this rank's estimate; nothing to reduce
            else:
                # Divide before the sum: keeps low-precision gradients in range.
                grad.mul_(self._expert_grad_scale)
                if self._edp_group is not None:
                    self._ready[self._launch_position[id(p)]] = grad
                    self._launch_expert_reductions()
        self._num_reduced += 1

    def _launch_expert_reductions(self) -> None:
        """Launch the ready expert gradients' edp reductions (async) in launch order, up to the first
        not ready. Collectives pair up by issue order, and hook order is only as deterministic as
        the autograd engine's threads: DDP too launches its buckets in a fixed order."""
        while self._num_launched in self._ready:
            grad = self._ready.pop(self._num_launched)
            self._num_launched += 1
            with self.timer.span("grad_reduce"):
                if self.grad_compression == "bf16":
                    reduction = Bf16AllReduce([grad], self._edp_group)
                    self._bytes_sent += reduction.num_bytes
                else:
                    reduction = dist.all_reduce(grad, group=self._edp_group, async_op=True)
                if self.timer.enabled:
                    reduction.wait()  # timed where it is issued (log.comm_timing)
            self._pending.append(reduction)

    def _finish_expert_sync(self) -> None:
        for reduction in self._pending:
            reduction.wait()  # a bf16 reduction casts its sum back into the gradient here
        # Internal invariant: all were launched only if every expert weight took part in the
        # forward (GroupedExperts uses its weights even with no tokens).
        assert self._num_reduced == len(self._expert_params), \
            f"{self._num_reduced} of {len(self._expert_params)} expert gradients were reduced"
        self._pending, self._num_reduced, self._num_launched, self._callback_queued = [], 0, 0, False


def apply_data_parallel(model: nn.Module, dims: ParallelDims, *, bucket_cap_mb: float = 25.0, zero_stage: int = 0,
                        blocks: list[nn.Module] | None = None, mixed_precision: str = "fp32",
                        offload_params: bool = False, offload_optimizer: bool = False, pin_memory: bool = True,
                        hsdp_replicate: int = 1, grad_compression: str = "none") -> nn.Module:
    """Wrap ``model`` for data parallelism at ZeRO stage ``zero_stage``.

    Stages 0 and 1: ``MoEDataParallel`` (DDP) when ``dims.dp > 1``, else ``model`` unchanged; with
    tensor parallelism (``dims.tp > 1``) a ``TensorParallelDataParallel`` instead;
    stage 1 also needs its optimizer passed through ``wrap_optimizer``. Stages 2 and 3: FSDP2
    units over ``blocks`` and the root (see ``moetrain.distributed.data_parallel.fsdp``), returning ``model``
    itself, now an ``FSDPModule``. ``mixed_precision`` ("fp32", "bf16", "fp16") is FSDP's
    parameter/compute dtype at stages 2/3; at stages 0/1 the trainer's autocast does that job.
    ``grad_compression`` ("none", "bf16", "onebit") compresses the gradient reductions at stages 0/1.
    """
    # The config's rules, for callers that pass the settings directly.
    ParallelConfig(zero_stage=zero_stage, hsdp_replicate=hsdp_replicate)
    check_offload(zero_stage, offload_optimizer=offload_optimizer, offload_param=offload_params, pp=dims.pp)
    check_grad_compression(grad_compression, zero_stage=zero_stage, tp=dims.tp)
    if zero_stage >= 2:
        from moetrain.distributed.data_parallel.fsdp import apply_fsdp

        if blocks is None:
            raise ValueError("apply_data_parallel at zero_stage >= 2 needs blocks (the FSDP units)")
        return apply_fsdp(model, dims, zero_stage=zero_stage, blocks=blocks, mixed_precision=mixed_precision,
                          offload_params=offload_params, offload_optimizer=offload_optimizer,
                          pin_memory=pin_memory, hsdp_replicate=hsdp_replicate)
    if dims.tp > 1:
        from moetrain.distributed.data_parallel.tp_reduction import TensorParallelDataParallel

        return TensorParallelDataParallel(model, dims)
    if dims.dp == 1:
        return model
    if not any(p.requires_grad and not is_expert_shard(p) for p in model.parameters()):
        # Only expert shards train (LoRA on the routed experts alone): DDP refuses a module with no
        # trainable parameter of its own, and finalize_grads reduces the shards after the backward.
        # JobConfig refuses compression here; this is for models built outside it.
        require(grad_compression == "none", "dp.grad_compression", grad_compression,
                'must be "none" when only expert shards train (LoRA on the routed experts only at ep > 1): '
                "no replicated gradient is left to compress")
        return model
    return MoEDataParallel(model, dims, bucket_cap_mb=bucket_cap_mb, grad_compression=grad_compression)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def grad_comm_metrics(model: nn.Module) -> dict[str, float]:
    """``grad_bytes`` (per synced step, this rank) and ``grad_bytes_ratio_vs_fp32`` of a
    ``MoEDataParallel`` since the last call (and, for 1-bit Adam's compressed steps,
    ``grad_bytes_compressed_step`` and ``grad_bytes_ratio_vs_fp32_compressed_step``); empty for any
    other model."""
    return model.grad_comm_stats() if isinstance(model, MoEDataParallel) else {}


def onebit_data_parallel(model: nn.Module) -> MoEDataParallel | None:
    """The ``MoEDataParallel`` that runs 1-bit Adam's communication, when ``model`` is one with
    dp.grad_compression "onebit"; else None (at dp = 1 there is nothing to exchange: plain AdamW)."""
    return model if isinstance(model, MoEDataParallel) and model.grad_compression == "onebit" else None


def grad_compression_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's 1-bit residuals for the checkpoint; empty when there are none."""
    return model.compression_state_dict() if isinstance(model, MoEDataParallel) else {}


def load_grad_compression_state(model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Restore what ``grad_compression_state`` saved (reset, with a warning, at another layout)."""
    if isinstance(model, MoEDataParallel):
        model.load_compression_state_dict(state)


def wrap_optimizer(optimizer: torch.optim.Optimizer, dims: ParallelDims, *, zero_stage: int,
                   offload_optimizer: bool = False, pin_memory: bool = True,
                   bucket_numel: int = 500_000_000) -> torch.optim.Optimizer:
    """The optimizer to step for ZeRO stage ``zero_stage``: at stage 1 a ``ZeroShardedOptimizer``
    (states sharded over dp, experts' over edp; ``offload_optimizer`` keeps them on the host,
    page-locked as ``pin_memory`` says); otherwise ``optimizer`` itself (at stages 2/3 it was built
    over FSDP's sharded parameters, so its states are sharded already)."""
    if zero_stage != 1:
        return optimizer
    from moetrain.distributed.data_parallel.zero1 import ZeroShardedOptimizer

    return ZeroShardedOptimizer(optimizer, dims, offload=offload_optimizer, pin_memory=pin_memory,
                                bucket_numel=bucket_numel)


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
    from moetrain.distributed.data_parallel.tp_reduction import TensorParallelDataParallel

    if isinstance(model, (DistributedDataParallel, TensorParallelDataParallel)):
        return model.no_sync()
    from moetrain.distributed.data_parallel.fsdp import fsdp_no_sync, is_fsdp

    if is_fsdp(model):
        return fsdp_no_sync(model)
    return contextlib.nullcontext()
