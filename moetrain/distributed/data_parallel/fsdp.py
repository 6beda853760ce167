"""ZeRO stages 2 and 3 with FSDP2 (``fully_shard``), expert-aware.

    stage 2: gradients and optimizer states sharded; parameters gathered once per forward and
             kept until their backward is done (``reshard_after_forward=False``)
    stage 3: parameters too: gathered for forward, freed, gathered again for backward
             (``reshard_after_forward=True``)

The units, torchtitan's: every transformer block, then the root (embedding, final norm, head).
Dense parameters shard over the ``dp`` mesh axis (all ranks; with tensor parallelism the dp axis
of the (dp, tp) mesh, FSDP sharding the tp DTensors again: 2-D). Under expert parallelism the expert
weights are already DTensors ``Shard(0)`` over ``ep``; their ``GroupedExperts`` module is its own
unit, sharded again over ``edp`` (the ranks that hold copies of the same experts), so EP and
ZeRO-3 stack: each rank keeps 1/edp of 1/ep of the experts. Under bf16/fp16 each router is a
unit of its own that gathers its gate weight in fp32: routing is fp32 on the same weights as at
stages 0/1.

Gradient scale: ``moetrain.distributed.data_parallel.finalize``'s rule, scale by 1/dp and sum over
the copies. An expert unit shards over its copies (edp) and divides by dp, not by its mesh size
(FSDP's default average would leave expert gradients ep times too large), and so does a unit of
modules whose tp ranks hold partial gradients (over dp x tp). On gloo a factor that differs from
the mesh size would need ``ReduceOp.PREMUL_SUM``, which gloo lacks, so those units also force
plain-sum collectives (FSDP then divides by hand). Not when edp = 1: torch 2.13 divides twice on
a one-rank unit with forced sums (see /work/shared/notes/torch-cpu-distributed-facts.md, row 4).

HSDP (``hsdp_replicate = R > 1``): the dense units shard over groups of W/R consecutive ranks
and replicate across the R groups (reduce-scatter inside a group, then all-reduce of the shard
across groups). Consecutive ranks share a node, so the frequent all-gathers stay inside it.
The expert units keep sharding over the whole ``edp`` axis.
"""

from __future__ import annotations

import contextlib
from typing import TypeGuard

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from moetrain.distributed.data_parallel.finalize import grad_reduction
from moetrain.distributed.data_parallel.zero1 import use_pinned_memory
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.models.attention import Attention
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.layer import MoELayer
from moetrain.models.moe.router import TopKRouter

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """fp32: no casts. bf16/fp16: parameters gathered and computed in the low dtype, while the
    sharded fp32 parameters stay the master weights and gradients are reduced in fp32 (a
    bf16 sum over many ranks loses the small contributions)."""
    if mixed_precision not in _DTYPES:
        raise ValueError(f"train.dtype ({mixed_precision!r}) must be one of {', '.join(map(repr, _DTYPES))}")
    low = _DTYPES[mixed_precision]
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)


def offload_policy(offload: bool, *, pin_memory: bool = True) -> OffloadPolicy:
    """FSDP2's CPU offload keeps sharded parameters, gradients and optimizer states in host
    memory and runs the optimizer step there, page-locked as zero.pin_memory says where CUDA
    exists (``use_pinned_memory``)."""
    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=use_pinned_memory(pin_memory))


def dense_fsdp_mesh(dims: ParallelDims, *, hsdp_replicate: int = 1) -> DeviceMesh:
    """The mesh the dense units shard over: ``dp`` (1-D), or (replicate, shard) for HSDP."""
    if hsdp_replicate == 1:
        return dims.axis_mesh("dp")
    return dims.hsdp_mesh(hsdp_replicate)


def apply_fsdp(model: nn.Module, dims: ParallelDims, *, zero_stage: int, blocks: list[nn.Module],
               mixed_precision: str = "fp32", offload_params: bool = False, offload_optimizer: bool = False,
               pin_memory: bool = True, hsdp_replicate: int = 1) -> nn.Module:
    """Shard ``model`` in place with FSDP2 for ZeRO stage 2 or 3; returns it (now an FSDPModule).

    ``blocks``: the transformer blocks, each its own unit (children first, then the root).
    ``offload_params`` (stage 3) or ``offload_optimizer`` (stage 2 or 3) turn on FSDP2's
    ``CPUOffloadPolicy``, which always moves sharded parameters, gradients and optimizer states
    together: FSDP2 has no optimizer-only offload. Expert parallelism must already be applied.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"parallel.zero_stage ({zero_stage!r}) must be 2 or 3 for FSDP")
    reshard = zero_stage == 3
    mp_policy = mixed_precision_policy(mixed_precision)
    offload = offload_policy(offload_params or offload_optimizer, pin_memory=pin_memory)
    dense_mesh = dense_fsdp_mesh(dims, hsdp_replicate=hsdp_replicate)

    # 1. Experts, over their copies (edp), divided by dp (see the module docstring). At ep = 1
    #    the experts are plain tensors replicated on every rank like the dense weights: they stay
    #    in their block's unit and shard over dp.
    if dims.ep > 1:
        experts = grad_reduction(dims, "edp")
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                unit = fully_shard(
                    module, mesh=dims.axis_mesh("edp"), reshard_after_forward=reshard,
                    shard_placement_fn=lambda p: expert_shard_placement(p.shape, dims.ep, dims.edp),
                    mp_policy=mp_policy, offload_policy=offload)
                unit.set_gradient_divide_factor(float(experts.divisor))
                if experts.size > 1:
                    unit.set_force_sum_reduction_for_comms(True)
    # 2. Routers under bf16/fp16: their own units with fp32 parameters. The router computes in
    #    fp32, and in the block's unit it would get FSDP's bf16-rounded gate weight, unlike at
    #    stages 0/1 where it reads the fp32 master: the same tokens would route differently by
    #    ZeRO stage. The gate is E x D, so the extra gather is small.
    if mixed_precision != "fp32":
        router_mp_policy = mixed_precision_policy("fp32")
        for module in model.modules():
            if isinstance(module, TopKRouter):
                _shard_unit(module, dims, dense_mesh, reshard=reshard, mp_policy=router_mp_policy,
                            offload=offload)
    # 3. With tensor parallelism: the modules whose plain parameters see only this tp rank's
    #    tokens or heads (MoE layers, per-head q/k norms), over dp x tp (tp_data_parallel's table).
    if dims.tp > 1:
        for module in tp_partial_modules(model):
            _shard_unit(module, dims, dense_mesh, reshard=reshard, mp_policy=mp_policy, offload=offload)
    # 4. Transformer blocks.
    for block in blocks:
        fully_shard(block, mesh=dense_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                    offload_policy=offload)
    # 5. Root: embedding, final norm, head (and a tied head). FSDP keeps the root gathered after
    #    forward at any stage, since backward needs it at once.
    fully_shard(model, mesh=dense_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                offload_policy=offload)
    return model


def _shard_unit(module: nn.Module, dims: ParallelDims, dense_mesh: DeviceMesh, *, reshard: bool,
                mp_policy: MixedPrecisionPolicy, offload: OffloadPolicy) -> None:
    """A unit over the dense mesh, or at tp > 1 over its copies, the stage's dp x tp ranks, divided
    by dp: its tp ranks hold partial gradients (different tokens or heads) to be summed. Plain
    sums on the wire (gloo has no PREMUL_SUM for a factor other than the mesh size)."""
    if dims.tp == 1:
        fully_shard(module, mesh=dense_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                    offload_policy=offload)
        return
    copies = grad_reduction(dims, "dp_tp")
    unit = fully_shard(module, mesh=dims.axis_mesh("dp_tp"), reshard_after_forward=reshard, mp_policy=mp_policy,
                       offload_policy=offload)
    unit.set_gradient_divide_factor(float(copies.divisor))
    unit.set_force_sum_reduction_for_comms(True)


def tp_partial_modules(model: nn.Module) -> list[nn.Module]:
    """Under tensor parallelism, the modules whose plain parameters get a partial gradient on each
    tp rank: every MoE layer (router, shared experts, experts at ep = 1; experts at ep > 1 are
    units of their own already) and the per-head q/k norms of attention."""
    out: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, MoELayer):
            out.append(module)
        elif isinstance(module, Attention) and module.qk_norm == "head":
            out += [module.q_norm, module.k_norm]
    return out


def expert_shard_dim(shape: tuple[int, ...], ep: int, edp: int) -> int:
    """The dim FSDP shards a stacked ``[E, ...]`` expert weight on over ``edp``.

    Dim 0 (experts) normally. But with fewer local experts than edp ranks (E/ep < edp), dim-0
    chunks pad every rank up to a whole expert: Mixtral's 8 experts at ep = 8, edp = 8 would keep
    one full expert per rank and save nothing. Then dim 1 (the model or hidden dim) is split
    instead, as torchtitan does, when edp divides it (FSDP2 needs even splits off dim 0).
    """
    local = shape[0] // ep
    if local < edp and len(shape) > 1 and shape[1] % edp == 0:
        return 1
    return 0


def expert_shard_placement(shape, ep: int, edp: int) -> Shard | None:
    dim = expert_shard_dim(tuple(shape), ep, edp)
    return Shard(dim) if dim else None


def is_fsdp(model: nn.Module) -> TypeGuard[FSDPModule]:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def fsdp_no_sync(model: FSDPModule):
    """Skip the reduce-scatter on non-final micro-steps: FSDP accumulates the unsharded
    gradients locally (full size: gradient accumulation costs the memory ZeRO-2/3 saved) and
    the next synced backward reduces their sum."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
