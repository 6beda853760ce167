"""Expert parallelism applied to a model: each rank of an ep group holds E/ep experts, and token
copies travel to them by all-to-all (``moetrain.distributed.expert_parallel.dispatcher``) and come back.

``apply_expert_parallel`` swaps in the dispatcher the layout needs, shards the expert weights as
DTensors over the ``ep`` mesh axis, and points the load-balancing loss at the data-parallel group.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moetrain.config.moe import MoEConfig
from moetrain.distributed.comm.stats import CommStats
from moetrain.distributed.comm.timer import CommTimer
from moetrain.distributed.expert_parallel.dispatcher import AllToAllDispatcher
from moetrain.distributed.expert_parallel.exchange import EpExchanges
from moetrain.distributed.expert_parallel.hierarchical import hierarchical_dispatcher
from moetrain.distributed.expert_parallel.tensor_parallel import (
    ExpertTensorParallelDispatcher,
    shard_experts_2d,
)
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.models.moe.dispatcher import Dispatcher, LocalDispatcher
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.layer import MoELayer


def build_dispatcher(dims: ParallelDims, moe: MoEConfig) -> Dispatcher:
    """The dispatcher a layout needs: all-to-all when experts are split (ep > 1), or when data
    parallelism meets a capacity factor (drops are decided over the global batch); otherwise local.
    With ``parallel.ep_hierarchical`` and an ep group spanning nodes: the two-stage exchange of
    ``moetrain.distributed.expert_parallel.hierarchical`` (across nodes once per destination node, then inside
    the node). Needs the mesh."""
    if dims.hierarchical_ep:
        if moe.dispatch_chunks > 1:
            warnings.warn(f"moe.dispatch_chunks ({moe.dispatch_chunks}) is ignored by the hierarchical exchange "
                          f"(parallel.ep_hierarchical): its stages are not chunked", stacklevel=2)
        return hierarchical_dispatcher(dims, moe)
    if dims.ep == 1 and moe.dispatch_chunks > 1:
        warnings.warn(f"moe.dispatch_chunks ({moe.dispatch_chunks}) is ignored at parallel.ep = 1: no token "
                      f"all-to-all to pipeline", stacklevel=2)
    # Drops are decided over every rank of the stage holding other tokens: dp x tp (parallel
    # folding: the MoE layer takes each tp rank's sequence shard).
    if dims.ep > 1 or (dims.dp_tp > 1 and moe.capacity_factor is not None):
        return AllToAllDispatcher(moe.num_experts, ep_group=dims.group("ep") if dims.ep > 1 else None,
                                  dp_group=dims.group("dp_tp") if dims.dp_tp > 1 else None, dedup=moe.dispatch_dedup,
                                  dispatch_dtype=moe.dispatch_dtype, num_chunks=moe.dispatch_chunks,
                                  ep_nodes=dims.ep_rank_nodes() if dims.ep > 1 else None,
                                  dp_nodes=dims.dp_rank_nodes() if dims.dp_tp > 1 else None)
    return LocalDispatcher(moe.num_experts)


def shard_experts(experts: GroupedExperts, dims: ParallelDims) -> None:
    """Replace the full ``[E, ...]`` expert weights, and their LoRA adapters when fine-tuning
    (``lora_a_w1 [E, D, R]``, ...), by DTensors sharded ``Shard(0)`` over ``ep``: an expert's
    adapters live on the rank of its weights.

    The model was built full-size with the same seed on every rank (experts and adapters
    initialised by global index), so each rank slices its own experts out: no communication, and
    the global model is the same for any ep. As DTensors, the shards carry their global shape and
    offsets into checkpoints, which therefore reshard across ep degrees. Frozen weights stay
    frozen (``requires_grad`` is kept).
    """
    for name, w in list(experts.named_parameters(recurse=False)):
        if isinstance(w, DTensor):
            continue
        num_local = w.shape[0] // dims.ep
        lo = dims.ep_rank * num_local
        local = w.detach()[lo:lo + num_local].clone()
        shard = DTensor.from_local(local, dims.axis_mesh("ep"), [Shard(0)], run_check=False,
                                   shape=w.shape, stride=w.stride())
        setattr(experts, name, nn.Parameter(shard, requires_grad=w.requires_grad))


def is_expert_shard(p: torch.Tensor) -> bool:
    """True for expert weights sharded over the ``ep`` mesh axis by :func:`shard_experts` (or over
    (ep, etp) by ``shard_experts_2d``)."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """For each ``MoELayer``: swap in the dispatcher the layout needs, shard the experts over ``ep``,
    and sum the load-balancing counts over the ranks of the stage that hold other tokens (dp x tp,
    so the mean of the per-rank aux losses is the single-process aux loss). In place; returns
    ``model``."""
    # A language model routes B * S / tp tokens on every rank; a classifier its real tokens only,
    # and under tp the multi-token modules leave their last k positions (all on the last tp rank)
    # unrouted.
    lm = getattr(getattr(model, "config", None), "head", None) == "lm"
    for name, layer in model.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        dims.check_experts(layer.config.num_experts, layer=name)
        layer.dispatcher = build_dispatcher(dims, layer.config)
        if dims.etp > 1:
            equal_counts = lm and not (dims.tp > 1 and name.split(".")[0] == "mtp")
            layer.dispatcher = ExpertTensorParallelDispatcher(layer.dispatcher, num_experts=layer.config.num_experts,
                                                              group=dims.group("etp"), size=dims.etp,
                                                              equal_counts=equal_counts)
            shard_experts_2d(layer.experts, dims)
        elif dims.ep > 1:
            shard_experts(layer.experts, dims)
        if dims.dp_tp > 1:
            layer.balance_group = dims.group("dp_tp")
    return model


def _communicating_dispatchers(model: nn.Module) -> list[EpExchanges | ExpertTensorParallelDispatcher]:
    """The dispatchers that communicate: the all-to-all ones and the etp gathers around them."""
    out: list[EpExchanges | ExpertTensorParallelDispatcher] = []
    for layer in model.modules():
        if not isinstance(layer, MoELayer):
            continue
        dispatcher = layer.dispatcher
        if isinstance(dispatcher, ExpertTensorParallelDispatcher):
            out.append(dispatcher)
            dispatcher = dispatcher.inner
        if isinstance(dispatcher, EpExchanges):
            out.append(dispatcher)
    return out


def enable_comm_timing(model: nn.Module, device: torch.device) -> None:
    """Time every exchange of every MoE layer's dispatcher (``log.comm_timing``): each is then
    waited for at once, so the all-to-alls no longer overlap compute (see ``comm_timer``)."""
    for dispatcher in _communicating_dispatchers(model):
        dispatcher.timer = CommTimer(enabled=True, device=device)


def collect_comm_times(model: nn.Module, *, reset: bool = True) -> dict[str, float]:
    """Seconds (``comm_time/<kind>``) and spans (``comm_calls/<kind>``) of the exchanges of every MoE
    layer on this rank since the last read, summed over layers; empty when not timed."""
    total: dict[str, float] = {}
    for dispatcher in _communicating_dispatchers(model):
        for key, value in dispatcher.timer.read(reset=reset).items():
            total[key] = total.get(key, 0.0) + value
    return total


def collect_comm_stats(model: nn.Module, *, reset: bool = True) -> CommStats:
    """Sum of the byte counters of every MoE layer of ``model`` on this rank: its all-to-alls, and
    the etp gathers around them."""
    total = CommStats()
    for dispatcher in _communicating_dispatchers(model):
        total = total + dispatcher.read_comm_stats(reset=reset)
    return total
