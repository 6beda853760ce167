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
  their ep-local ``E/ep`` rows over edp -- or, with fewer local experts than edp ranks, dim 1
  evenly (``expert_shard_dim``); at ep = 1 they stay in their block's unit (over dp).
* parallel.etp (stages 0/1 only): each expert weight also splits its hidden dim over etp, so a rank
  holds 1/(ep * etp) of the experts' elements, and ZeRO-1 slices them over edp = world / (ep * etp).
* AdamW: ``exp_avg`` and ``exp_avg_sq`` like the (local) parameter, plus a 4-byte fp32 ``step``
  per parameter tensor, also for an empty shard.
* optim.name "muon": the hidden and expert matrices (``ParamSpec.matrix``) keep one fp32
  ``momentum_buffer`` like the (local) parameter and no step counter; the rest keep AdamW's. The
  whole matrix each Muon step forms (gathered at stages 1-3) is transient (``transient_state_bytes``).
* optim.ema_decay (``WeightAverage``): one more copy of each parameter as this rank holds it, whole
  at stages 0/1 (ZeRO-1 slices only the optimizer states), the unpadded local shard at stages 2/3.
* finetune.lora_rank > 0: the model the trainer builds (``apply_lora``: adapters added, every base
  weight frozen); a frozen parameter (``ParamSpec.trainable`` False) has no gradient, no optimizer
  state and no average.
* dp.grad_compression "onebit" (stage 0): 1-bit Adam's error-feedback residuals
  (``onebit_residual_bytes``).
* parallel.expert_slots_per_rank with moe.rebalance_every > 0: the spare slots' replica bank
  (``replica_slot_bytes`` per spare slot).

Everything is fp32 at rest (mixed precision computes in bf16 from fp32 master parameters), so
the bytes per parameter are 4 (param) + 4 (grad) + 8 (AdamW) = 16 -- the ZeRO paper's (Rajbhandari et
al., 2020) 2 + 2 + 12 of fp16 weights/gradients plus fp32 master/momentum/variance, distributed differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.config.finetune import FinetuneConfig
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.distributed.data_parallel.fsdp import expert_shard_dim
from moetrain.distributed.data_parallel.onebit_packing import chunk_len

PARAM_BYTES = 4
"""fp32 parameters (the master weights; bf16/fp16 copies exist only while computing)."""
GRAD_BYTES = 4
"""fp32 gradients (reduced in fp32 at every precision)."""
ADAM_STATE_BYTES = 8
"""AdamW exp_avg + exp_avg_sq, fp32."""
ADAM_STEP_BYTES = 4
"""AdamW's per-tensor ``step`` counter (a 0-dim fp32 tensor)."""
MUON_STATE_BYTES = 4
"""Muon's momentum buffer, fp32 (no second moment, no step counter)."""
RESIDUAL_BYTES = 4
"""1-bit Adam's worker and server residuals, fp32."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    expert: bool
    """A routed-expert weight ``[E, ...]`` (GroupedExperts), sharded over ep (and edp)."""
    matrix: bool = False
    """A hidden or expert matrix: Muon's under optim.name "muon" (``muon_param_ids``)."""
    trainable: bool = True
    """False for a base weight LoRA freezes: no gradient, optimizer state or average."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row (FSDP2 shards dim 0)."""
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: ``rank = (edp_index * ep + ep_index) * etp + etp_index`` (see ``ParallelDims``)."""

    world: int
    ep: int
    zero_stage: int
    hsdp_replicate: int = 1
    etp: int = 1
    """parallel.etp: each expert's hidden dim split over etp consecutive ranks (stages 0/1 only)."""
    offload_optimizer: bool = False
    offload_params: bool = False
    weight_average: bool = False
    """optim.ema_decay > 0: the rank keeps a moving average of the parameters it holds."""
    optimizer: str = "adamw"
    """optim.name: "muon" keeps one momentum buffer for each ``ParamSpec.matrix`` instead of two moments."""
    grad_compression: str = "none"
    """dp.grad_compression: "onebit" keeps 1-bit Adam's residuals at stage 0 (``onebit_residual_bytes``)."""
    expert_slots_per_rank: int = 0
    """parallel.expert_slots_per_rank when moe.rebalance_every > 0, else 0: the slots beyond a rank's
    E/ep home experts hold a replica bank (at ep > 1, stages 0/1, where rebalancing runs)."""

    def __post_init__(self) -> None:
        if self.etp > 1 and self.zero_stage > 1:
            raise ValueError(f"parallel.etp ({self.etp}) > 1 needs parallel.zero_stage 0 or 1 (is {self.zero_stage})")

    @classmethod
    def of_config(cls, cfg: JobConfig, world: int) -> Layout:
        """The layout of the job ``cfg`` run on ``world`` processes."""
        p, z = cfg.parallel, cfg.zero
        return cls(world=world, ep=p.ep, zero_stage=p.zero_stage, hsdp_replicate=p.hsdp_replicate, etp=p.etp,
                   offload_optimizer=z.offload_optimizer != "none", offload_params=z.offload_param != "none",
                   weight_average=cfg.optim.ema_decay > 0, optimizer=cfg.optim.name,
                   grad_compression=cfg.dp.grad_compression,
                   expert_slots_per_rank=p.expert_slots_per_rank if cfg.moe.rebalance_every > 0 else 0)

    @property
    def edp(self) -> int:
        return self.world // (self.ep * self.etp)

    @property
    def dense_shard_size(self) -> int:
        """Ranks a dense FSDP unit shards over: dp, or one HSDP shard group."""
        return self.world // self.hsdp_replicate


@dataclass
class StateBytes:
    param: int = 0
    grad: int = 0
    optim: int = 0
    average: int = 0
    """The weight average of optim.ema_decay (0 without one)."""
    replica: int = 0
    """The spare expert slots' replica bank: weights, and gradients of the trainable ones (0 without)."""
    residual: int = 0
    """1-bit Adam's error-feedback residuals (0 without dp.grad_compression "onebit")."""

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim + self.average + self.replica + self.residual

    def as_dict(self) -> dict[str, int]:
        return {"param_bytes": self.param, "grad_bytes": self.grad, "optim_bytes": self.optim,
                "average_bytes": self.average, "replica_bytes": self.replica, "residual_bytes": self.residual}


def _meta_model(model: ModelConfig, moe: MoEConfig, finetune: FinetuneConfig | None = None):
    """``Transformer(model, moe)`` on the meta device, with ``finetune``'s LoRA adapters as the
    trainer adds them (``apply_lora``): shapes and dtypes, no storage."""
    if model.vocab_size is None:
        raise ValueError("model.vocab_size (None) must be set to plan (it comes from the tokenizer: "
                         "data.vocab_size)")
    import torch

    from moetrain.models.lora import apply_lora
    from moetrain.models.transformer import Transformer

    with torch.device("meta"):
        net = Transformer(model, moe=moe if model.is_moe else None)
        if finetune is not None:
            apply_lora(net, finetune)
    return net


def param_specs(model: ModelConfig, moe: MoEConfig, *, finetune: FinetuneConfig | None = None) -> list[ParamSpec]:
    """The parameters ``Transformer(model, moe)`` creates (with ``finetune``'s LoRA adapters, its
    base weights frozen), a tied embedding once, in model order."""
    from moetrain.distributed.muon import muon_param_ids
    from moetrain.models.moe.experts import GroupedExperts

    net = _meta_model(model, moe, finetune)
    expert_ids = {id(p) for m in net.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    matrices = muon_param_ids(net)
    return [ParamSpec(name, tuple(p.shape), id(p) in expert_ids, id(p) in matrices, p.requires_grad)
            for name, p in net.named_parameters()]


def buffer_bytes(model: ModelConfig, moe: MoEConfig) -> int:
    """Bytes of the model's buffers (rotary tables, routing counters, the selection bias) on every
    rank: neither DDP nor FSDP2 shards a buffer, and expert parallelism shards none."""
    return sum(b.numel() * b.element_size() for b in _meta_model(model, moe).buffers())


def _chunk(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(local rows, padded rows) of ``torch.chunk``-style sharding of ``rows`` over ``world``."""
    c = math.ceil(rows / world) if rows else 0
    return max(0, min(c, rows - rank * c)), c


def _slice(numel: int, world: int, rank: int) -> int:
    c = math.ceil(numel / world)
    lo = min(rank * c, numel)
    return min(lo + c, numel) - lo


def _collapse(specs: list[ParamSpec]) -> list[tuple[ParamSpec, int]]:
    """Identical (shape, expert) parameters once, with their count: a model's blocks repeat."""
    counts: dict[tuple, list] = {}
    for s in specs:
        key = (s.shape, s.expert, s.matrix, s.trainable)
        if key in counts:
            counts[key][1] += 1
        else:
            counts[key] = [s, 1]
    return [(s, n) for s, n in counts.values()]


def rank_state_bytes(specs: list[ParamSpec], layout: Layout, rank: int) -> StateBytes:
    """Parameter, gradient (after a backward), optimizer-state (after a step) and weight-average bytes on
    ``rank``."""
    return _rank_state_bytes(_collapse(specs), layout, rank)


def _rank_state_bytes(collapsed: list[tuple[ParamSpec, int]], layout: Layout, rank: int) -> StateBytes:
    ep, edp, stage, etp = layout.ep, layout.edp, layout.zero_stage, layout.etp
    edp_rank = rank // (ep * etp)
    total = StateBytes(replica=replica_bank_bytes(collapsed, layout), residual=onebit_residual_bytes(collapsed, layout))
    for s, count in collapsed:
        out = StateBytes()
        muon = layout.optimizer == "muon" and s.matrix
        state_bytes, step_bytes = (MUON_STATE_BYTES, 0) if muon else (ADAM_STATE_BYTES, ADAM_STEP_BYTES)
        # A frozen (LoRA base) weight: no gradient, outside the optimizer and the average.
        grad_bytes = GRAD_BYTES if s.trainable else 0
        avg_bytes = PARAM_BYTES if layout.weight_average and s.trainable else 0
        if not s.trainable:
            state_bytes = step_bytes = 0
        # The tensor this rank holds before any ZeRO sharding: experts are ep-sharded on dim 0
        # (which experts depends on the ep index; how many does not), and split over etp along
        # their hidden dim.
        rows = s.shape[0] // ep if s.expert else s.shape[0]
        if stage in (0, 1):
            local = rows * s.row_numel // (etp if s.expert else 1)
            out.param += local * PARAM_BYTES
            out.grad += local * grad_bytes
            out.average += local * avg_bytes
            if stage == 0:
                held = local
            else:
                world, r = (edp, edp_rank) if s.expert else (layout.world, rank)
                held = _slice(local, world, r)
                if layout.offload_optimizer and s.trainable:
                    out.optim += held * PARAM_BYTES  # the host master copy of the slice
            out.optim += held * state_bytes + step_bytes
            _add(total, out, count)
            continue
        # FSDP2: dense units over dp (or the HSDP shard group), experts over edp at ep > 1.
        if s.expert and ep > 1:
            world, r = edp, edp_rank
            if expert_shard_dim(s.shape, ep, edp) == 1:
                # Fewer local experts than edp ranks: split dim 1 evenly instead (no padding).
                local = rows * s.row_numel // edp
                out.param += local * PARAM_BYTES
                out.grad += local * grad_bytes
                out.optim += local * state_bytes + step_bytes
                out.average += local * avg_bytes
                _add(total, out, count)
                continue
        else:
            world = layout.dense_shard_size
            r = rank % world
        local_rows, padded_rows = _chunk(rows, world, r)
        out.param += padded_rows * s.row_numel * PARAM_BYTES
        out.grad += padded_rows * s.row_numel * grad_bytes
        out.optim += local_rows * s.row_numel * state_bytes + step_bytes
        out.average += local_rows * s.row_numel * avg_bytes
        _add(total, out, count)
    return total


def replica_slot_bytes(specs: list[ParamSpec]) -> int:
    """Bytes of one spare expert slot's replica (``ReplicatedDispatcher.attach``): one expert of every
    routed-expert tensor (LoRA adapters included), fp32, and a gradient for the trainable ones
    (alive from the backward until ``Rebalancer.sum_replica_grads`` sends it home). No optimizer
    state or average: a replica follows its home's weights."""
    return sum(s.row_numel * (PARAM_BYTES + (GRAD_BYTES if s.trainable else 0)) for s in specs if s.expert)


def replica_bank_bytes(collapsed: list[tuple[ParamSpec, int]], layout: Layout) -> int:
    """The replica bank of every MoE layer on one rank: ``expert_slots_per_rank - E/ep`` spare slots
    (the same on every rank), where rebalancing runs (ep > 1, stages 0/1: the config's rules)."""
    slots = layout.expert_slots_per_rank
    if not slots or layout.ep == 1 or layout.zero_stage > 1:
        return 0
    return sum(count * max(0, slots - s.shape[0] // layout.ep) * replica_slot_bytes([s]) for s, count in collapsed
               if s.expert)


def onebit_residual_bytes(collapsed: list[tuple[ParamSpec, int]], layout: Layout) -> int:
    """1-bit Adam's error-feedback residuals on one rank, as ``OneBitReducer`` allocates them
    (dp.grad_compression "onebit", stage 0, more than one rank): per trainable tensor of N elements
    reduced over W ranks, a worker residual of the tensor zero-padded to W chunks of L =
    ``chunk_len(N, W)`` elements and a server residual of this rank's chunk, (W + 1) * L fp32 in
    all. Replicated tensors reduce over dp (the world, at tp = 1); expert shards (ep * etp > 1)
    over edp, with no reducer at edp = 1."""
    if layout.grad_compression != "onebit" or layout.zero_stage != 0 or layout.world == 1:
        return 0
    split = layout.ep * layout.etp
    out = 0
    for s, count in collapsed:
        if not s.trainable:
            continue
        world, numel = (layout.edp, s.numel // split) if s.expert and split > 1 else (layout.world, s.numel)
        if world > 1:
            out += count * (world + 1) * chunk_len(numel, world) * RESIDUAL_BYTES
    return out


def _add(total: StateBytes, part: StateBytes, count: int) -> None:
    total.param += part.param * count
    total.grad += part.grad * count
    total.optim += part.optim * count
    total.average += part.average * count


def state_bytes_per_rank(specs: list[ParamSpec], layout: Layout) -> list[StateBytes]:
    collapsed = _collapse(specs)
    return [_rank_state_bytes(collapsed, layout, r) for r in range(layout.world)]


def _units(specs: list[ParamSpec], layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
    """FSDP2 units -> local (ep-sharded, not yet ZeRO-sharded) numel, and the group each shards over."""
    ep, edp = layout.ep, layout.edp
    units: dict[str, int] = {}
    unit_group: dict[str, int] = {}
    for s in specs:
        if not s.name.startswith("layers."):
            unit, group = "root", layout.dense_shard_size
        elif s.expert and ep > 1:
            unit, group = s.name.rsplit(".", 1)[0], edp
        else:
            unit, group = ".".join(s.name.split(".")[:2]), layout.dense_shard_size
        units[unit] = units.get(unit, 0) + (s.numel // ep if s.expert else s.numel)
        unit_group[unit] = group
    return units, unit_group


def transient_state_bytes(specs: list[ParamSpec], layout: Layout, *, bucket_numel: int = 500_000_000) -> int:
    """Short-lived model-state buffers on top of the at-rest bytes (an estimate):

    * stages 0/1: the backward's gradient of the largest parameter, alive until DDP copies it
      into its bucket; stage 1 adds the all-gather buffers of the step (a bucket of
      ``min(bucket_numel, parameters)`` elements gathered, plus this rank's 1/G of it sent);
    * stages 2/3: a unit's unsharded gradients and FSDP2's reduce-scatter input, both unit-sized
      in fp32, for the largest unit;
    * optim.name "muon", on top: ``muon_step_bytes``.
    """
    ep = layout.ep
    muon = muon_step_bytes(specs, layout)
    if layout.zero_stage in (0, 1):
        trainable = [s for s in specs if s.trainable]
        out = max(((s.numel // (ep * layout.etp) if s.expert else s.numel) for s in trainable), default=0) * GRAD_BYTES
        if layout.zero_stage == 1:
            dense = sum(s.numel for s in trainable if not (s.expert and ep * layout.etp > 1))
            gathered = min(bucket_numel, dense)
            out += (gathered + gathered // layout.world) * PARAM_BYTES
        return out + muon
    units, _ = _units(specs, layout)
    return 2 * max(units.values()) * GRAD_BYTES + muon


def muon_step_bytes(specs: list[ParamSpec], layout: Layout) -> int:
    """fp32 bytes Muon's step allocates for its largest matrix (an estimate; 0 under AdamW): the
    whole ep-local matrix ``u`` (at stages 1-3 the all-gather of its shards: ZeRO-1's slices or
    FSDP2's dim-0 shards), and the Newton-Schulz working set, about three matrix-sized
    temporaries and three ``min(A, B)``-square Gram products per expert. One matrix at a time:
    each is freed before the next is gathered."""
    if layout.optimizer != "muon":
        return 0
    out = 0
    for s in specs:
        if not s.matrix:
            continue
        *batch, rows, cols = s.shape
        num_matrices = math.prod(batch) // (layout.ep if s.expert else 1)
        n = num_matrices * rows * cols
        out = max(out, (4 * n + 3 * num_matrices * min(rows, cols) ** 2) * MUON_STATE_BYTES)
    return out


def unsharded_param_peak_bytes(specs: list[ParamSpec], layout: Layout, *, compute_bytes: int) -> int:
    """Bytes of gathered (unsharded) parameters at the height of a step, on top of the shards
    (an estimate; 0 at stages 0/1, where nothing is gathered).

    The units are FSDP2's: the root (everything outside ``layers``), each block, and at ep > 1
    each block's experts on their own. Stage 2 keeps every unit gathered from its forward until
    its backward: the whole local model at the end of the forward. Stage 3 holds the root (never
    resharded after forward) and about two blocks (the one computing and the next one). On top,
    FSDP2's flat all-gather buffers: in forward it frees a unit's buffer only after the next
    unit's copy-out, so two block-unit-sized buffers can be alive at the end of the forward (one
    in stage 3, whose backward frees each at once). A unit on a one-rank group gathers without a
    buffer.
    """
    if layout.zero_stage < 2:
        return 0
    units, unit_group = _units(specs, layout)
    blocks: dict[str, int] = {}
    for unit, n in units.items():
        if unit != "root":
            block = ".".join(unit.split(".")[:2])
            blocks[block] = blocks.get(block, 0) + n
    # The root's buffer is freed by the first block's copy-out, long before the peak.
    buffer = max((n for u, n in units.items() if u != "root" and unit_group[u] > 1), default=0)
    if layout.zero_stage == 2:
        gathered = sum(units.values()) + 2 * buffer
    else:
        gathered = units.get("root", 0) + 2 * max(blocks.values(), default=0) + buffer
    return gathered * compute_bytes
