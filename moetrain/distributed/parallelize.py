"""One call that parallelises a model, always in the same order:

    1. tensor parallelism   (dense part split over ``tp``, sequence-parallel norms; the MoE layers
                             take their rank's sequence shard)
    2. expert parallelism   (dispatcher swap, experts sharded over ``ep``)
    3. activation checkpointing
    4. torch.compile
    5. data parallelism      (ZeRO stage 0/1: DDP over ``dp``, expert shards over ``edp``, or with
                              tp the per-parameter reductions of ``tp_data_parallel``;
                              stage 2/3: FSDP2 units, dense over ``dp``, experts over ``edp``)

The order matters: tensor parallelism replaces the weights by DTensors before anything holds
them, checkpointing must wrap the layers that already communicate (so a recompute repeats the
all-to-all on every rank alike), compile must see the checkpointed layers, and DDP or FSDP must
wrap the final modules so their hooks see every parameter in its final form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.distributed.comm.timer import CommTimer
from moetrain.distributed.data_parallel.ddp import MoEDataParallel, apply_data_parallel
from moetrain.distributed.data_parallel.finalize import GRAD_TIMER
from moetrain.distributed.data_parallel.zero1 import ZeroShardedOptimizer
from moetrain.distributed.expert_parallel.apply import apply_expert_parallel
from moetrain.distributed.expert_parallel.apply import collect_comm_times as collect_dispatch_times
from moetrain.distributed.expert_parallel.apply import enable_comm_timing as enable_dispatch_timing
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.tensor_parallel import apply_tensor_parallel
from moetrain.models.moe.dispatcher import LocalDispatcher
from moetrain.models.moe.layer import MoEAux, MoELayer
from moetrain.models.mtp import MTPModule


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The units checkpointed ("full", "every_n") and the FSDP units: the children of
    ``model.layers`` (a ModuleList or ModuleDict of transformer blocks, torchtitan's convention) if
    it exists, else every MoELayer. Not the multi-token modules' blocks (``model.mtp``): the
    activation planner (``moetrain.plan.activations``) counts them as not checkpointed but for
    their MoE layer under "moe"."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """The units compiled: ``default_blocks`` and then the block of each multi-token module
    (``model.mtp``), a transformer block like the others (it is no FSDP unit of its own: the
    multi-token modules' parameters stay in the root unit)."""
    mtp = getattr(model, "mtp", None)
    extra = [m.block for m in mtp if isinstance(m, MTPModule)] if isinstance(mtp, nn.ModuleList) else []
    return default_blocks(model) + extra


AC_MODES = ("none", "full", "moe", "every_n")


def checkpoint_blocks(model: nn.Module, mode: str, *, every: int = 2) -> list[nn.Module]:
    """The modules that activation checkpointing mode ``mode`` recomputes: "none" nothing,
    "full" every block, "moe" only the MoE feed-forward layers (the all-to-alls and the expert
    activations, which dominate an MoE block), "every_n" every ``every``-th block from the first.
    The blocks are ``default_blocks``: "full" and "every_n" leave the multi-token modules' blocks
    out, "moe" takes their MoE layers too."""
    if mode not in AC_MODES:
        raise ValueError(f"train.activation_checkpointing ({mode!r}) must be one of {', '.join(map(repr, AC_MODES))}")
    if mode == "none":
        return []
    if mode == "moe":
        return [m for m in model.modules() if isinstance(m, MoELayer)]
    blocks = default_blocks(model)
    if mode == "every_n":
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"train.activation_checkpointing_every ({every!r}) must be an int >= 1")
        return blocks[::every]
    return blocks


def apply_activation_checkpointing(blocks: list[nn.Module], *, compile: bool = False) -> None:
    """Recompute each block's activations in backward (``use_reentrant=False``, which works with
    the all-to-all and with DDP). Patches ``forward`` in place so parameter names, and therefore
    checkpoints and DDP's bookkeeping, stay as they were.

    ``compile``: the checkpointed function is the block's own forward compiled, so the checkpoint
    itself stays eager. Dynamo traces a checkpoint as one higher-order op, which may not contain a
    graph break; an expert-parallel MoE block breaks at its host syncs, and a compiled wrapper
    around its checkpoint then ran the whole block eagerly.

    The routing statistics of the MoE layer in a checkpointed module are recorded here, after the
    checkpoint, from the ``MoEAux`` the module returns (``(out, aux)``, as a block and an MoE layer
    do): the recompute in backward calls only the checkpointed function, so it is not counted
    again, and nothing in the compiled forward has to tell a recompute from a forward."""
    for block in blocks:
        layers = [m for m in block.modules() if isinstance(m, MoELayer)]
        if compile and len(layers) > 1:
            raise ValueError(f"a checkpointed module compiled with {len(layers)} MoE layers: its routing "
                             "statistics would be counted again by the recompute; checkpoint one block or "
                             "MoE layer per module")
        stats_layer = layers[0] if len(layers) == 1 else None  # several: each records itself (eager)
        if stats_layer is not None:
            stats_layer.stats_recorded_by_caller = True
        inner = torch.compile(block.forward, dynamic=compile_dynamic(block)) if compile else block.forward

        def forward(*args, _inner=inner, _layer=stats_layer, **kwargs):
            out = checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            if _layer is not None and _layer.track_routing_stats and _layer.training:
                _layer.record_step_stats(_returned_aux(out))
            return out

        block.forward = forward


def _returned_aux(out) -> MoEAux:
    """The ``MoEAux`` of a checkpointed module's ``(out, aux)``."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], MoEAux)):
        raise RuntimeError("a checkpointed module holding one MoE layer must return (output, MoEAux) for its "
                           f"routing statistics to be recorded; it returned {type(out).__name__}")
    return out[1]


def compile_blocks(blocks: list[nn.Module], *, checkpointed: list[nn.Module]) -> None:
    """``torch.compile`` each block, except those checkpointed whole (already compiled inside their
    checkpoint by ``apply_activation_checkpointing``)."""
    inside = {id(m) for m in checkpointed}
    for block in blocks:
        if id(block) not in inside:
            block.compile(dynamic=compile_dynamic(block))


def compile_dynamic(block: nn.Module) -> bool | None:
    """``torch.compile``'s ``dynamic`` for ``block``: True where an MoE layer in it exchanges tokens
    (the all-to-all dispatcher: expert parallelism, or data parallelism with a capacity), None
    (dynamo's default) elsewhere. The exchange reads its split sizes on the host, once per forward
    (the graph break), and the code after it gets them as Python ints, as do the byte counters
    (``CommStats``) they are added to; by default dynamo specialises the first step's values and
    recompiles at the next step, whose expert loads differ. Traced as symbols from the first step,
    one compiled graph serves every load.

    False for a block that sees shorter sequences than the others (``static_shapes``: a multi-token
    module's, S - k positions) and exchanges none: a static graph of its own. By default dynamo
    would answer its new length with a dynamic graph of the same code, which the other blocks
    would then run too, and which a checkpoint recompute of a block compiled from the same code
    could pick instead of the static graph its forward ran (torch refuses that recompute: "A
    different number of tensors was saved"; seen with the multi-token block checkpointed as well)."""
    exchanges = any(isinstance(m, MoELayer) and not isinstance(m.dispatcher, LocalDispatcher) for m in block.modules())
    if exchanges:
        return True
    return False if getattr(block, "static_shapes", False) else None


def parallelize(model: nn.Module, dims: ParallelDims, *, activation_checkpointing: bool | str = False,
                compile: bool = False, blocks: Callable[[nn.Module], list[nn.Module]] = default_blocks,
                bucket_cap_mb: float = 25.0, activation_checkpointing_every: int = 2, zero_stage: int = 0,
                mixed_precision: str = "fp32", offload_params: bool = False, offload_optimizer: bool = False,
                pin_memory: bool = True, hsdp_replicate: int = 1, grad_compression: str = "none") -> nn.Module:
    """Apply the parallel layout ``dims`` (a ``ParallelDims`` with its mesh built) to ``model``.

    ``activation_checkpointing``: True checkpoints ``blocks(model)``; a mode string ("none",
    "full", "moe", "every_n" with ``activation_checkpointing_every``) picks the modules through
    ``checkpoint_blocks`` instead. Compile always goes per block of ``compiled_blocks`` (so
    checkpointing only every n-th block does not change what compiles), the FSDP units per block
    of ``default_blocks`` (the same without the multi-token modules' blocks).

    ``zero_stage`` 0/1 returns a ``MoEDataParallel`` when ``dims.dp > 1`` (stage 1 also needs
    ``wrap_optimizer``), else ``model``; 2/3 returns ``model`` sharded by FSDP2. The remaining
    arguments are those of ``apply_data_parallel``. Use ``no_sync(model)`` on non-final
    micro-steps whatever the stage.

    ``model`` must have been built full-size with the same seed on every rank.
    """
    # 1. Tensor parallelism.
    apply_tensor_parallel(model, dims)
    # 2. Expert parallelism.
    apply_expert_parallel(model, dims)
    # 3. Activation checkpointing (a checkpointed module compiles inside its checkpoint).
    if isinstance(activation_checkpointing, str):
        checkpointed = checkpoint_blocks(model, activation_checkpointing, every=activation_checkpointing_every)
    else:
        checkpointed = blocks(model) if activation_checkpointing else []
    apply_activation_checkpointing(checkpointed, compile=compile)
    # 4. Compile, per block (the all-to-all's host sync would split a whole-model graph anyway).
    if compile:
        compile_blocks(compiled_blocks(model), checkpointed=checkpointed)
    # 5. Data parallelism.
    return apply_data_parallel(model, dims, bucket_cap_mb=bucket_cap_mb, zero_stage=zero_stage,
                               blocks=default_blocks(model), mixed_precision=mixed_precision,
                               offload_params=offload_params, offload_optimizer=offload_optimizer,
                               pin_memory=pin_memory, hsdp_replicate=hsdp_replicate,
                               grad_compression=grad_compression)


def enable_comm_timing(model: nn.Module, parallel_model: nn.Module, optimizer: torch.optim.Optimizer,
                       device: torch.device) -> None:
    """``log.comm_timing``: time the expert-parallel exchanges of ``model``'s MoE layers, the
    gradient reduction of a stage 0/1 wrapper and the ZeRO-1 parameter all-gather, each waited for
    where it is issued (``moetrain.distributed.comm.timer``). FSDP2's own all-gathers and
    reduce-scatters (stages 2/3) run on its streams and are not timed."""
    enable_dispatch_timing(model, device)
    if isinstance(parallel_model, MoEDataParallel):
        parallel_model.enable_comm_timing(device)
    else:  # a model finalize_grads reduces after the backward (pipeline stages)
        setattr(parallel_model, GRAD_TIMER, CommTimer(enabled=True, device=device))
    if isinstance(optimizer, ZeroShardedOptimizer):
        optimizer.timer = CommTimer(enabled=True, device=device)


def collect_comm_times(model: nn.Module, parallel_model: nn.Module,
                       optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Seconds (``comm_time/<kind>``) and spans (``comm_calls/<kind>``) of every timed collective on
    this rank since the last call (empty when nothing is timed), and at ZeRO-1 the bytes this rank
    sent in the parameter all-gathers (``param_gather_bytes``)."""
    out = collect_dispatch_times(model)
    if isinstance(parallel_model, MoEDataParallel):
        out.update(parallel_model.timer.read())
    elif getattr(parallel_model, GRAD_TIMER, None) is not None:
        out.update(getattr(parallel_model, GRAD_TIMER).read())
    if isinstance(optimizer, ZeroShardedOptimizer):
        out.update(optimizer.timer.read())
        out["param_gather_bytes"], optimizer.gather_bytes = float(optimizer.gather_bytes), 0
    return out
