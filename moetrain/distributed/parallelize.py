"""One call that parallelises a model, always in the same order:

    1. expert parallelism   (dispatcher swap, experts sharded over ``ep``)
    2. activation checkpointing
    3. torch.compile
    4. data parallelism      (DDP over ``dp``, expert shards over ``edp``)

The order matters: checkpointing must wrap the layers that already communicate (so a recompute
repeats the all-to-all on every rank alike), compile must see the checkpointed layers, and DDP must
wrap the final module so its hooks see every parameter in its final form.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.distributed.data_parallel import apply_data_parallel
from moetrain.distributed.expert_parallel import apply_expert_parallel
from moetrain.models.moe.layer import MoELayer


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The units checkpointed and compiled: the children of ``model.layers`` (a ModuleList or
    ModuleDict of transformer blocks, torchtitan's convention) if it exists, else every MoELayer."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Recompute each block's activations in backward (``use_reentrant=False``, which works with
    the all-to-all and with DDP). Patches ``forward`` in place so parameter names, and therefore
    checkpoints and DDP's bookkeeping, stay as they were."""
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def parallelize(model: nn.Module, dims, *, activation_checkpointing: bool = False, compile: bool = False,
                blocks: Callable[[nn.Module], list[nn.Module]] = default_blocks,
                bucket_cap_mb: float = 25.0) -> nn.Module:
    """Apply the parallel layout ``dims`` (a ``ParallelDims`` with its mesh built) to ``model``.

    ``blocks(model)`` picks the modules to checkpoint; compile always goes per block of
    ``default_blocks`` (so checkpointing only every n-th block does not change what compiles).

    ``model`` must have been built full-size with the same seed on every rank. Returns the module
    to train: a ``MoEDataParallel`` when ``dims.dp > 1`` (use ``no_sync(model)`` on non-final
    micro-steps), else ``model`` itself.
    """
    # 1. Expert parallelism.
    apply_expert_parallel(model, dims)
    # 2. Activation checkpointing.
    if activation_checkpointing:
        apply_activation_checkpointing(blocks(model))
    # 3. Compile, per block (the all-to-all's host sync would split a whole-model graph anyway).
    #    Off by default: on CPU, fp32 torch._grouped_mm cannot be traced yet.
    if compile:
        for block in default_blocks(model):
            block.compile()
    # 4. Data parallelism.
    return apply_data_parallel(model, dims, bucket_cap_mb=bucket_cap_mb)
