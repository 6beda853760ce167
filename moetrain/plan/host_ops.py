"""The tensor operations one training step dispatches, counted on the config's model at small widths.

A small model's step is not bound by its FLOPs or bytes but by the host work per operation: the
Python of each module, autograd's bookkeeping and the dispatcher (on a GPU, also the kernel launch,
which then overlaps the device's queue). The step-time model charges ``DeviceProfile.op_overhead_s``
per operation; this module counts the operations.

The count does not depend on the widths (dim, heads' size, hidden sizes, vocabulary) but on the
structure: layers, which of them are MoE, attention kind, norms, shared experts, the head, dropout,
and the parameter tensors the optimizer loops over. So the config's model is built for real at
widths of 8-16 (``small_widths``), with every structural field kept, and one micro-batch's forward,
loss and backward, then gradient clipping and an AdamW step as ``train.optim`` builds it, run under a
``TorchDispatchMode`` that counts each ATen call. What it does not see: the all-to-all dispatcher's
index work at ep > 1 (counted with the local dispatcher of one process) and the trainer's own
per-step bookkeeping (metrics, logging).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig

SMALL_HEAD_DIM, SMALL_HIDDEN, SMALL_VOCAB, SMALL_SEQ = 8, 16, 64, 16


@dataclass(frozen=True)
class HostOps:
    micro_batch: int
    """Operations of one micro-batch's forward, loss and backward."""
    optimizer: int
    """Operations of one optimizer step: global-norm clipping, AdamW, zeroing the gradients."""

    def per_step(self, grad_accum: int) -> int:
        return self.micro_batch * grad_accum + self.optimizer


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it, at the top level (an operation on a
    DTensor or another tensor subclass counts once, before the subclass turns it into others)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def small_widths(model: ModelConfig, moe: MoEConfig) -> tuple[ModelConfig, MoEConfig]:
    """``model`` and ``moe`` with every width small and every structural field kept."""
    mla = {"q_lora_rank": None if model.q_lora_rank is None else SMALL_HIDDEN, "kv_lora_rank": SMALL_HIDDEN,
           "qk_nope_head_dim": SMALL_HEAD_DIM, "qk_rope_head_dim": SMALL_HEAD_DIM // 2,
           "v_head_dim": SMALL_HEAD_DIM}
    # An explicit head_dim frees dim from num_heads x head_dim without another operation; the
    # latent attention has its own head dims.
    heads = mla if model.attention == "mla" else {"head_dim": SMALL_HEAD_DIM}
    small = replace(model, preset=None, vocab_size=SMALL_VOCAB, dim=SMALL_HIDDEN, **heads,
                    dense_hidden_dim=None if model.dense_hidden_dim is None else SMALL_HIDDEN,
                    document_separator=None if model.document_separator is None else 1,
                    ngram_buckets=min(model.ngram_buckets, SMALL_VOCAB))
    small_moe = replace(moe, expert_hidden_dim=SMALL_HIDDEN, force_skew="none", routing_replay=None,
                        shared_hidden_dim=None if moe.shared_hidden_dim is None else SMALL_HIDDEN)
    return small, small_moe


def _batch(model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    seq = min(SMALL_SEQ, model.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(2, SMALL_VOCAB, (1, seq), generator=gen)
    if model.head == "classifier":
        return ids_BS, torch.zeros(1, dtype=torch.long)
    return ids_BS, torch.randint(2, SMALL_VOCAB, (1, seq), generator=gen)


def _small_model(model: ModelConfig, moe: MoEConfig) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The config's model at small widths (seeded, in training mode) and one batch for it."""
    from moetrain.models.transformer import Transformer

    small, small_moe = small_widths(model, moe)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = Transformer(small, moe=small_moe).train()
    return net, _batch(small)


def _optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW as ``train.optim`` builds it (over DTensor experts once ``net`` is parallelized)."""
    from moetrain.train.optim import build_optimizer

    return build_optimizer(net, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def small_step(model: ModelConfig, moe: MoEConfig):
    """(micro-batch function, optimizer-step function) of the config's model at small widths."""
    from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_

    net, (ids_BS, labels) = _small_model(model, moe)
    optimizer = _optimizer(net)

    def micro_batch() -> None:
        net(ids_BS, labels).loss.backward()

    def optimizer_step() -> None:
        clip_global_grad_norm_(list(net.parameters()), 1.0)  # as the trainer clips
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return micro_batch, optimizer_step


def parallel_small_step(model: ModelConfig, moe: MoEConfig, *, ep: int):
    """``small_step`` as the trainer runs it on every rank of the process group already initialised
    (dp = world, ``ep``, ZeRO-0): the model parallelized, DDP's gradient reduction, the global
    norm over every rank's gradients, AdamW over the ep-sharded (DTensor) experts. Collective."""
    import torch.distributed as dist

    from moetrain.distributed.data_parallel.finalize import finalize_grads
    from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
    from moetrain.distributed.parallel_dims import ParallelDims
    from moetrain.distributed.parallelize import parallelize

    dims = ParallelDims(world_size=dist.get_world_size(), ep=ep, num_experts=moe.num_experts)
    dims.build_mesh("cpu")
    net, (ids_BS, labels) = _small_model(model, moe)
    wrapped = parallelize(net, dims)
    params: list[torch.Tensor] = [p for p in net.parameters() if p.requires_grad]
    optimizer = _optimizer(net)

    def micro_batch() -> None:
        wrapped(ids_BS, labels).loss.backward()
        finalize_grads(wrapped, dims)

    def optimizer_step(zero_grad: bool = True) -> None:
        """``zero_grad=False`` keeps the gradients, so that calls can repeat and be timed."""
        clip_global_grad_norm_(params, 1.0)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)

    return micro_batch, optimizer_step


_COUNTS: dict[tuple[str, str], HostOps] = {}
"""Counts by the configs' reprs: the planner estimates many layouts of one config."""


def count_host_ops(model: ModelConfig, moe: MoEConfig) -> HostOps:
    """The operations of one micro-batch and of one optimizer step of ``model`` (cached per config)."""
    key = (repr(model), repr(moe))
    if key not in _COUNTS:
        micro_batch, optimizer_step = small_step(model, moe)
        micro_batch()
        optimizer_step()  # AdamW creates its state in the first step: count a later one
        counts = []
        for fn in (micro_batch, optimizer_step):
            with OpCounter() as counter:
                fn()
            counts.append(counter.count)
        _COUNTS[key] = HostOps(micro_batch=counts[0], optimizer=counts[1])
    return _COUNTS[key]
