"""Tensor parallelism of the dense part, applied from outside with DTensor's ``parallelize_module``
styles (Megatron-LM's layout with sequence parallelism), and the MoE layers folded over the tp ranks.

Per transformer block, over the ``tp`` mesh axis (``x`` is ``[B, S, D]``; "local" is this rank's
``S/tp`` positions of every sequence):

    residual stream          local [B, S/tp, D] (sequence-parallel)
    attention_norm, ffn_norm SequenceParallel: weight replicated, input and output Shard(1)
    attention                input all-gathered along S; wq, wk, wv column-wise (H/tp and G/tp
                             heads per rank), wo row-wise with a reduce-scatter back to Shard(1)
    dense FFN                input all-gathered; w1, w3 column-wise, w2 row-wise, reduce-scatter
    MoE layer                its local S/tp positions as they are: router, dispatch (all-to-all
                             over ``ep``, which may be these very tp ranks), experts, shared experts

and for the model: the token embedding row-wise (vocabulary shards, reduce-scatter to Shard(1)),
the final norm sequence-parallel, the LM head column-wise with the logits all-gathered (every tp
rank computes the same loss).

The multi-token modules (``model.mtp_depth``) keep every depth at the S positions
(``MTPModule.keep_length``: the last k padded, unscored and not routed), so their sequence splits
like the trunk's: their three norms sequence-parallel, ``eh_proj`` kept whole on the local
positions (a plain parameter, as the router), their block split as a trunk block. The MoE layer's
token mask is cut to the rank's positions with its input; a rank then routes fewer tokens than its
peers, which the masked path's aux losses allow for and a capacity does not
(``tensor_parallel_errors``).

Why the MoE layer takes local tokens. Its input is sharded along the sequence already, so the
tp ranks hold different tokens, exactly like data-parallel ranks: routing, the all-to-all and
the experts need no tensor-parallel collective, and ``ep`` can borrow the tp ranks (parallel
folding). What it asks for:

* routing counts (load-balancing statistics, capacity drops) are summed over the stage's dp x tp
  ranks (``ParallelDims.group("dp_tp")``), so ``f_e`` is the global one;
* each tp rank's aux loss covers its S/tp positions: the layer's aux terms are averaged over tp in
  the forward (every tp rank then holds the value of its dp index's batch, as for the LM loss) and
  each rank's gradient is scaled by 1/tp (``_MeanOverTp``), which makes the summed router
  gradient that of one process holding the batch;
* the parameters the MoE layer keeps whole (router, shared experts, experts at ep = 1) see only
  local tokens: their gradient is a partial sum over tp, reduced over dp x tp with the 1/dp scale
  of data parallelism (``moetrain.distributed.data_parallel.tp_reduction``). So are the per-head q/k norm
  weights of attention (each rank holds other heads).

Not covered (rejected with the field named): multi-head latent attention (its latent projections
read the gathered input outside the column-wise layers), ``model.qk_norm="full"`` (a norm across
all heads), the classifier head (pools along the sharded sequence), LoRA adapters, a capacity
factor with multi-token modules (their padded positions leave the tp ranks unequal token counts,
over which a capacity cannot be shared out as one process would). The
sequence-wise balance loss sums each sequence's counts and scores over the tp ranks
(``MoELayer.sequence_group``).

Shape legend: B batch, S sequence, D model dim, H query heads, G key/value heads.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from moetrain.config.model import ModelConfig, tensor_parallel_errors
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.models.attention import Attention
from moetrain.models.feedforward import FeedForward
from moetrain.models.moe.layer import MoELayer
from moetrain.models.mtp import MTPModule
from moetrain.models.transformer import TransformerBlock


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise one ValueError listing every part of ``model`` (a Transformer or its pipeline stages)
    that cannot split over ``tp`` ranks: its config's shapes (``tensor_parallel_errors``) and
    LoRA adapters, which only the built model shows."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"tensor parallelism splits a Transformer or its pipeline stages, not {type(model).__name__}")
    errors = tensor_parallel_errors(config, tp, moe=getattr(model, "moe_config", None))
    if tp > 1 and any("lora_" in name.rsplit(".", 1)[-1] for name, _ in model.named_modules()):
        errors.append("LoRA adapters (finetune.lora_rank > 0) are not split by parallel.tp")
    if errors:
        raise ValueError("; ".join(errors))


class _MeanOverTp(torch.autograd.Function):
    """Forward: the mean over the tp group (every tp rank then holds the same value). Backward:
    this rank's gradient times 1/tp, no communication; the tp ranks' parameter gradients are summed
    afterwards, which gives the gradient of the mean."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.size = size
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out / size

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.size, None, None


def _mean_aux_over_tp(dims: ParallelDims):
    group, size = dims.group("tp"), dims.tp

    def hook(_module: nn.Module, _args, output):
        out, aux = output
        # One all-reduce for the three terms: the loss carries the gradient, the other two are
        # reported (the mean over tp is the dp index's batch value).
        terms = torch.stack([aux.loss.float(), aux.load_balancing.float(), aux.z_loss.float()])
        mean = _MeanOverTp.apply(terms, group, size)
        aux.loss, aux.load_balancing, aux.z_loss = mean[0], mean[1].detach(), mean[2].detach()
        return out, aux

    return hook


def _gather_sequence(mesh):
    """Forward pre-hook of attention and the dense FFN: their first input (the sequence-sharded
    stream) all-gathered along the sequence, left a Replicate DTensor. The column-wise layers
    reading it then add their partial input gradients as DTensors, and the backward of the
    gather reduce-scatters the sum once (an all-reduce per layer if they got a local tensor). The
    other inputs (rotary tables, mask, cache) pass as they are, however many there are."""

    def hook(_module: nn.Module, args):
        return (_as_sequence_shard(args[0], mesh).redistribute(mesh, [Replicate()]), *args[1:])

    return hook


def _local_sequence(mesh):
    """Forward pre-hook of the MoE layer: its first input as this rank's local sequence shard, and
    its token mask (``[B, S]``, the same on every tp rank), if any, cut to the same positions."""

    def hook(_module: nn.Module, args):
        x = _as_sequence_shard(args[0], mesh).to_local()
        if len(args) > 1 and args[1] is not None:
            token_mask_BS = args[1].chunk(mesh.size(), dim=1)[mesh.get_local_rank()]
            return (x, token_mask_BS, *args[2:])
        return (x, *args[1:])

    return hook


def _as_sequence_shard(x: torch.Tensor, mesh) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)


def _block_plan(block: TransformerBlock) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1))}
    ffn = block.feed_forward
    if not isinstance(ffn, MoELayer):
        assert isinstance(ffn, FeedForward), type(ffn)
        plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
        if ffn.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Split ``model`` (a ``Transformer`` built full-size with the same seed on every rank, or a
    rank's ``PipelineModel``, whose absent embedding or head is None) over ``dims.axis_mesh("tp")`` as the
    module docstring lays out. In place; returns ``model``. A no-op at tp = 1.

    Each rank keeps its slice of every split weight (no communication: every rank holds the same
    full tensors), so the global weights are those of the unsplit model.
    """
    if dims.tp == 1:
        return model
    tp = dims.tp
    check_tensor_parallel(model, tp)
    embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    mesh = dims.axis_mesh("tp")
    plan: dict[str, ParallelStyle] = {}
    if embedding is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if output is not None:
        # Logits gathered whole: the loss is computed alike on every tp rank.
        plan.update({"norm": SequenceParallel(),
                     "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                                               use_local_output=True)})
    if plan:
        parallelize_module(model, mesh, plan)
    if tied:
        # Both are Shard(0) over tp (vocabulary rows): one parameter again, as before the split.
        assert embedding is not None and output is not None
        output.weight = embedding.weight
    if embedding is not None:
        embedding.weight.register_hook(_vocab_rows_of_grad)
    for module in _mtp_modules(model):
        # hnorm and enorm hand eh_proj local tensors: it applies its whole weight to the rank's positions.
        parallelize_module(module, mesh, {"hnorm": SequenceParallel(use_local_output=True),
                                          "enorm": SequenceParallel(use_local_output=True),
                                          "norm": SequenceParallel()})
        module.keep_length = True
    for block in _blocks(model) + [cast(TransformerBlock, m.block) for m in _mtp_modules(model)]:
        parallelize_module(block, mesh, _block_plan(block))
        attention, ffn = block.attention, block.feed_forward
        assert isinstance(attention, Attention), type(attention)  # check_tensor_parallel rejects MLA
        # Attention and the dense FFN read the whole sequence (all-gathered); the MoE layer its shard.
        attention.register_forward_pre_hook(_gather_sequence(mesh))
        ffn.register_forward_pre_hook(_local_sequence(mesh) if isinstance(ffn, MoELayer) else _gather_sequence(mesh))
        # The attention forward views its projections with these counts: this rank's heads.
        attention.num_heads //= tp
        attention.num_kv_heads //= tp
        if isinstance(ffn, MoELayer):
            ffn.register_forward_hook(_mean_aux_over_tp(dims))
            # Each sequence's positions are spread over the tp ranks: the sequence-wise balance
            # loss sums its per-sequence counts and scores over them.
            ffn.sequence_group = dims.group("tp")
    # A pipeline's stages are called one by one, never the PipelineModel holding them.
    for target in getattr(model, "chunks", None) or [model]:
        target.register_forward_pre_hook(_check_sequence_length(tp, len(_mtp_modules(target))))
    return model


def _blocks(model: nn.Module) -> list[TransformerBlock]:
    """The blocks of a ``Transformer`` (a ModuleList) or of a ``PipelineModel`` (a ModuleDict of
    the blocks this rank holds), in order."""
    layers = model.get_submodule("layers")
    assert isinstance(layers, (nn.ModuleList, nn.ModuleDict)), type(layers)
    blocks: list[TransformerBlock] = []
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        assert isinstance(block, TransformerBlock), type(block)
        blocks.append(block)
    return blocks


def _mtp_modules(model: nn.Module) -> list[MTPModule]:
    """The multi-token modules of a ``Transformer`` or of the last pipeline stage (none elsewhere)."""
    mtp = getattr(model, "mtp", None)
    return [] if mtp is None else [cast(MTPModule, m) for m in mtp]


def _vocab_rows_of_grad(grad: torch.Tensor) -> torch.Tensor:
    """The row-wise embedding's backward yields the whole ``[V, D]`` weight gradient, replicated on
    every tp rank; the weight is this rank's vocabulary rows (Shard(0)), and so must its gradient
    be, or a ZeRO-1 slice and the optimizer would read other rows and the dp reduction would carry
    tp times the bytes. Replicate -> Shard(0) is a local slice, no communication."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != (Shard(0),):
        return grad.redistribute(grad.device_mesh, [Shard(0)])
    return grad


def _check_sequence_length(tp: int, mtp_depth: int):
    def hook(_module: nn.Module, args):
        # Token ids [B, S]; past a first pipeline stage, this rank's sequence shard [B, S / tp, D].
        x = args[0]
        S = x.shape[1] if x.dim() == 2 else x.shape[1] * tp
        if S % tp:
            raise ValueError(f"the sequence length ({S}, data.seq_len) must be a multiple of parallel.tp ({tp}): "
                             "sequence parallelism splits every sequence evenly over the tp ranks")
        if mtp_depth >= S // tp:
            raise ValueError(f"model.mtp_depth ({mtp_depth}) must be < the sequence length / parallel.tp ({S // tp}): "
                             "the last tp rank's positions of the deepest depth would all be padding")

    return hook

