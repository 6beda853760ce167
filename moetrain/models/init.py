"""Drawing a model's parameters by name: each from its own generator seeded with ``(seed,
parameter name)``, so the draws do not depend on the global RNG, the device, the parallel layout
or which modules a rank keeps."""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.config.model import ModelConfig
from moetrain.models.attention import Attention, RMSNorm
from moetrain.models.feedforward import FeedForward
from moetrain.models.mla import MultiHeadLatentAttention
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.router import TopKRouter
from moetrain.models.ngram import NgramEmbedding
from moetrain.utils.seeds import seeded_generator


def _generator(seed: int, name: str) -> torch.Generator:
    return seeded_generator(f"{seed}/{name}")


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full-size CPU tensor into ``param``; a DTensor gets only its own shard
    (every rank drew the same full tensor, so no communication: ``src_data_rank=None``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                 src_data_rank=None)
    param.copy_(full)


@torch.no_grad()
def init_parameters(root: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Draw every parameter of ``root`` (a Transformer, or the stages a pipeline rank keeps of
    one) from ``seed``, independent of the global RNG, the device and the parallel layout.

    Each parameter gets its own CPU generator seeded from ``(seed, parameter name)`` and is
    drawn whole, then copied (or, for a DTensor, sharded) into place: a module that keeps the
    whole model's parameter names gets the whole model's draws. Stacked expert weights
    ``[E, ...]`` are drawn in global expert order, so expert e is the same whatever expert-
    parallel layout later holds it. Weights are normal(init_std), the residual output
    projections (attention out, FFN/expert down) normal(init_std / sqrt(2 * num_layers)) as
    GPT-2/Megatron, routers normal(moe.router_init_std), norm scales (q/k and latent norms too)
    1, q/k/v biases, the attention-pooling query and the hashed n-gram table 0.
    """
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    std_of: dict[int, float | str] = {}  # id(param) -> std, or "ones" / "zeros"
    for module in root.modules():
        if isinstance(module, RMSNorm):
            std_of[id(module.weight)] = "ones"
        elif isinstance(module, TopKRouter):
            std_of[id(module.gate.weight)] = module.init_std
        elif isinstance(module, Attention):
            std_of[id(module.wo.weight)] = out_std
            for bias in (module.wq.bias, module.wk.bias, module.wv.bias):
                if bias is not None:
                    std_of[id(bias)] = "zeros"
        elif isinstance(module, MultiHeadLatentAttention):
            std_of[id(module.wo.weight)] = out_std
        elif isinstance(module, FeedForward):
            std_of[id(module.w2.weight)] = out_std
        elif isinstance(module, GroupedExperts):
            std_of[id(module.w2)] = out_std
        elif isinstance(module, NgramEmbedding):
            # Zero: the model starts as the one without n-gram features (every other parameter is
            # drawn by its name, so the same draws), and the table grows only where its gradient
            # points; a normal draw would add the noise of max_order - 1 random rows to every token.
            std_of[id(module.weight)] = "zeros"
    pool_query = getattr(root, "pool_query", None)
    if pool_query is not None:
        std_of[id(pool_query)] = "zeros"  # uniform weights: training starts from mean pooling
    for name, param in root.named_parameters():
        p_std = std_of.get(id(param), std)
        if isinstance(p_std, str):
            full = torch.ones(param.shape) if p_std == "ones" else torch.zeros(param.shape)
        else:
            full = torch.empty(param.shape).normal_(0.0, p_std, generator=_generator(seed, name))
        _copy_full(param, full)
