"""Exact bytes of parameters, gradients and optimizer states on each rank, for a ZeRO stage and an
expert-parallel degree, without building the model's weights.

The parameter list comes from the model code itself, built on the meta device (shapes only, no
memory; the large presets cost nothing), so the planner cannot drift from what ``Transformer``
instantiates. The sharding rules are those of the code that trains:

* stage 0/1: DDP keeps every dense parameter whole; its gradients are views into DDP's flat
  buckets (``gradient_as_bucket_view``), which hold exactly the dense numel. Expert parameters
  and gradients are this rank's E/ep experts.
* stage 1: ``ZeroShardedOptimizer`` gives rank r elements ``[r*c, (r+1)*c)``, ``c = ceil(n/G)``,
  of each flattened parameter (G = dp for dense, edp for experts); the optimizer states are that
  slice; with offload also an fp32 host copy of it.
* stage 2/3: FSDP2 splits dim 0 into ``torch.chunk`` pieces of ``c = ceil(rows/G)`` rows: rank r
  keeps ``min(c, rows - r*c)`` of them (maybe 0) but allocates the padded ``c`` rows, for the
  parameter and for its gradient. Optimizer states are created from the unpadded local shard.
  Dense units shard over dp (or the shard axis of HSDP); at ep > 1 the experts' own unit shards
  their ep-local ``E/ep`` rows over edp; at ep = 1 they stay in their block's unit (over dp).
* AdamW: ``exp_avg`` and ``exp_avg_sq`` like the (local) parameter, plus a 4-byte fp32 ``step``
  per parameter tensor, also for an empty shard.

Everything is fp32 at rest (mixed precision computes in bf16 from fp32 master parameters), so
the bytes per parameter are 4 (param) + 4 (grad) + 8 (AdamW) = 16 -- the seeds' 2 + 2 + 12 of
DeepSpeed's fp16 weights/gradients plus fp32 master/momentum/variance, distributed differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig

PARAM_BYTES = 4
"""fp32 parameters (the master weights; bf16/fp16 copies exist only while computing)."""
GRAD_BYTES = 4
"""fp32 gradients (reduced in fp32 at every precision)."""
ADAM_STATE_BYTES = 8
"""AdamW exp_avg + exp_avg_sq, fp32."""
ADAM_STEP_BYTES = 4
"""AdamW's per-tensor ``step`` counter (a 0-dim fp32 tensor)."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    expert: bool
    """A routed-expert weight ``[E, ...]`` (GroupedExperts), sharded over ep (and edp)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row (FSDP2 shards dim 0)."""
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: ``rank = edp_index * ep + ep_index`` (see ``ParallelDims``)."""

    world: int
    ep: int
    zero_stage: int
    hsdp_replicate: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def edp(self) -> int:
        return self.world // self.ep

    @property
    def dense_shard_size(self) -> int:
        """Ranks a dense FSDP unit shards over: dp, or one HSDP shard group."""
        return self.world // self.hsdp_replicate


@dataclass
class StateBytes:
    param: int = 0
    grad: int = 0
    optim: int = 0

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim

    def as_dict(self) -> dict[str, int]:
        return {"param_bytes": self.param, "grad_bytes": self.grad, "optim_bytes": self.optim}


def param_specs(model: ModelConfig, moe: MoEConfig) -> list[ParamSpec]:
    """The parameters ``Transformer(model, moe)`` creates, a tied embedding once, in model order."""
    if model.vocab_size is None:
        raise ValueError("model.vocab_size (None) must be set to plan (it comes from the tokenizer: "
                         "data.vocab_size)")
    import torch

    from moetrain.models.moe.experts import GroupedExperts
    from moetrain.models.transformer import Transformer

    with torch.device("meta"):
        net = Transformer(model, moe=moe if model.is_moe else None)
    expert_ids = {id(p) for m in net.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    return [ParamSpec(name, tuple(p.shape), id(p) in expert_ids) for name, p in net.named_parameters()]


def _chunk(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(local rows, padded rows) of ``torch.chunk``-style sharding of ``rows`` over ``world``."""
    c = math.ceil(rows / world) if rows else 0
    return max(0, min(c, rows - rank * c)), c


def _slice(numel: int, world: int, rank: int) -> int:
    c = math.ceil(numel / world)
    lo = min(rank * c, numel)
    return min(lo + c, numel) - lo


def rank_state_bytes(specs: list[ParamSpec], layout: Layout, rank: int) -> StateBytes:
    """Parameter, gradient (after a backward) and AdamW-state (after a step) bytes on ``rank``."""
    ep, edp, stage = layout.ep, layout.edp, layout.zero_stage
    edp_rank = rank // ep
    out = StateBytes()
    for s in specs:
        # The tensor this rank holds before any ZeRO sharding: experts are ep-sharded on dim 0
        # (which experts depends on the ep index; how many does not).
        rows = s.shape[0] // ep if s.expert else s.shape[0]
        if stage in (0, 1):
            local = rows * s.row_numel
            out.param += local * PARAM_BYTES
            out.grad += local * GRAD_BYTES
            if stage == 0:
                held = local
            else:
                world, r = (edp, edp_rank) if s.expert else (layout.world, rank)
                held = _slice(local, world, r)
                if layout.offload_optimizer:
                    out.optim += held * PARAM_BYTES  # the host master copy of the slice
            out.optim += held * ADAM_STATE_BYTES + ADAM_STEP_BYTES
            continue
        # FSDP2: dense units over dp (or the HSDP shard group), experts over edp at ep > 1.
        if s.expert and ep > 1:
            world, r = edp, edp_rank
        else:
            world = layout.dense_shard_size
            r = rank % world
        local_rows, padded_rows = _chunk(rows, world, r)
        out.param += padded_rows * s.row_numel * PARAM_BYTES
        out.grad += padded_rows * s.row_numel * GRAD_BYTES
        out.optim += local_rows * s.row_numel * ADAM_STATE_BYTES + ADAM_STEP_BYTES
    return out


def state_bytes_per_rank(specs: list[ParamSpec], layout: Layout) -> list[StateBytes]:
    return [rank_state_bytes(specs, layout, r) for r in range(layout.world)]


def unsharded_param_peak_bytes(specs: list[ParamSpec], layout: Layout, *, compute_bytes: int,
                               num_blocks: int) -> int:
    """Extra bytes of gathered (unsharded) parameters at the height of a step, on top of the
    sharded ones: stage 2 keeps every unit gathered from its forward to its backward (the whole
    model at the end of the forward); stage 3 holds the root plus about two blocks (the one
    computing and the one prefetched). 0 at stages 0/1 (nothing is gathered). Mixed precision
    gathers in the compute dtype, so those copies exist at every precision but fp32, where they
    replace the shard's role only while gathered."""
    if layout.zero_stage < 2:
        return 0
    local = sum((s.numel // layout.ep if s.expert else s.numel) for s in specs)
    if layout.zero_stage == 2:
        return local * compute_bytes
    root = sum(s.numel for s in specs if not s.name.startswith("layers."))
    per_block = (local - root) / max(num_blocks, 1)
    return int(root + 2 * per_block) * compute_bytes
