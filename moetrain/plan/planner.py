"""The memory/communication planner behind ``moetrain plan``: for each (zero_stage, ep, offload,
activation checkpointing) choice, the per-rank bytes of parameters, gradients, optimizer states,
activations and all-to-all buffers, and the per-step bytes of each collective; invalid choices
with the rule they break; the valid ones that fit the device ranked (``Plan.ranked``).

Model states are exact (``model_states``), activations an estimate (``activations``, within a
few percent of the measured peak on the tested presets), communication the ring volumes of
``comm``. Nothing is allocated: the parameter shapes come from the model built on the meta device.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.train import TrainConfig
from moetrain.config.zero import check_offload
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.plan.activations import estimate_activations, moe_layers_recomputed
from moetrain.plan.comm import comm_per_step
from moetrain.plan.expert_tensor_parallel import EtpChoice, etp_advice, etp_choices
from moetrain.plan.job_rules import LayoutRules
from moetrain.plan.model_states import (
    Layout,
    _meta_model,
    param_specs,
    state_bytes_per_rank,
    transient_state_bytes,
    unsharded_param_peak_bytes,
)
from moetrain.plan.pipeline import PipelineChoice, pipeline_choices
from moetrain.plan.tensor_parallel import TpChoice, tp_advice, tp_choices

OFFLOADS = ("none", "optimizer", "params")
"""none; optimizer: optimizer states (and, through FSDP2 at stages 2/3, the sharded parameters
and gradients) in host memory; params: zero.offload_param at stage 3 (everything sharded on the host)."""
AC_CHOICES = ("none", "moe", "every_n", "full")


@dataclass(frozen=True)
class Choice:
    zero_stage: int
    ep: int
    offload: str = "none"
    ac: str = "none"
    hsdp_replicate: int = 1

    def label(self) -> str:
        hsdp = f" hsdp={self.hsdp_replicate}" if self.hsdp_replicate > 1 else ""
        return f"zero={self.zero_stage} ep={self.ep} offload={self.offload} ac={self.ac}{hsdp}"


@dataclass
class PlanRow:
    choice: Choice
    valid: bool
    reason: str | None = None
    """Why the choice is invalid (None when valid)."""
    notes: list[str] = field(default_factory=list)
    param_bytes: int = 0
    """Per rank, the largest over ranks: sharded/replicated parameters on the device."""
    grad_bytes: int = 0
    optim_bytes: int = 0
    average_bytes: int = 0
    """The weight average of optim.ema_decay, shown in the optimizer column."""
    gathered_param_bytes: int = 0
    """Parameters FSDP gathers on top of the shards at the height of a step (stages 2/3)."""
    transient_bytes: int = 0
    """Short-lived gradient and communication buffers (see ``transient_state_bytes``)."""
    activation_bytes: int = 0
    """Estimated activation peak of one micro-batch."""
    a2a_buffer_bytes: int = 0
    """One MoE layer's all-to-all send + receive buffers (transient, forward)."""
    host_bytes: int = 0
    """Offloaded model states in host memory."""
    device_bytes: int = 0
    """param + grad + optim (unless offloaded) + gathered params + transient buffers +
    activations: an upper bound, since the parts peak at different moments of the step."""
    comm: dict[str, int] = field(default_factory=dict)
    """Bytes this rank sends per step, per collective (and "total")."""
    per_rank_states: list[dict[str, int]] = field(default_factory=list)
    """Exact parameter/gradient/optimizer bytes of every rank (they differ when shards are uneven)."""
    fits: bool | None = None
    ep_spans_nodes: bool = False
    step: dict | None = None
    """The step-time estimate (``StepEstimate.as_dict()``: seconds and their breakdown, tokens/s,
    MFU) with a device profile; None without one, or for offload choices (not modelled)."""


@dataclass
class Plan:
    world: int
    nodes: int
    device_memory: int | None
    tokens_per_micro_batch: int
    grad_accum: int
    counts: dict[str, int]
    rows: list[PlanRow]
    micro_batch_size: int = 1
    """Sequences per micro-batch the plan assumes (see ``planned_micro_batch``)."""
    batch_note: str | None = None
    """Why the plan assumes another micro-batch than the config's (None when it does not)."""
    layout_note: str | None = None
    """The config's parallel.tp / pp / etp that the main table does not plan (None when all are 1)."""
    etp_rows: list[EtpChoice] = field(default_factory=list)
    """The expert tensor-parallel choices at the config's ep (``moetrain.plan.expert_tensor_parallel``)."""
    tp_rows: list[TpChoice] = field(default_factory=list)
    """The tensor-parallel choices (``moetrain.plan.tensor_parallel``), tp = 1 first."""
    pp_rows: list[PipelineChoice] = field(default_factory=list)
    """The pipeline-parallel choices (``moetrain.plan.pipeline``): pp > 1 under each schedule."""

    @property
    def ranked(self) -> list[PlanRow]:
        """Valid choices that fit (all valid ones when no device memory is given): stage 3 after
        every lighter choice (it re-gathers every block in backward, an all-gather per layer more);
        within that, the estimated step time with a device profile, then those whose expert-parallel
        groups stay inside a node (all-to-alls are the bulk of an MoE step's traffic and should not
        cross the slow link), then fewest communication bytes, then fewest inter-node bytes; ties go
        to the lower stage (fewer, larger collectives), no offload, less recomputation, then least
        device memory."""
        ok = [r for r in self.rows if r.valid and r.fits is not False]
        # Ties (offload and checkpointing move no collective bytes) go to the cheaper choice: no
        # offload before offload (host copies every step), less recomputation first.
        return sorted(ok, key=lambda r: (r.choice.zero_stage == 3,
                                         (r.step is None, r.step["step_s"]) if r.step else (True, 0.0),
                                         r.ep_spans_nodes, r.comm["total"], r.comm["inter_node"],
                                         r.choice.zero_stage, OFFLOADS.index(r.choice.offload),
                                         AC_CHOICES.index(r.choice.ac), r.device_bytes))

    def to_dict(self) -> dict:
        return {
            "world": self.world, "nodes": self.nodes, "device_memory": self.device_memory,
            "tokens_per_micro_batch": self.tokens_per_micro_batch, "grad_accum": self.grad_accum,
            "micro_batch_size": self.micro_batch_size, "batch_note": self.batch_note,
            "layout_note": self.layout_note,
            "params": self.counts,
            "ranked": [_row_dict(r) for r in self.ranked],
            "choices": [_row_dict(r) for r in self.rows],
            "tensor_parallel": [{**asdict(c), "total_bytes": c.total_bytes} for c in self.tp_rows],
            "tp_advice": tp_advice(self.tp_rows),
            "pipeline_parallel": [asdict(c) for c in self.pp_rows],
            "expert_tensor_parallel": [{**asdict(c), "total_bytes": c.total_bytes} for c in self.etp_rows],
            "etp_advice": etp_advice(self.etp_rows),
        }


def _row_dict(r: PlanRow) -> dict:
    d = asdict(r)
    d["choice"] = asdict(r.choice)
    return d


def resolve_vocab(cfg: JobConfig) -> ModelConfig:
    """The model config with vocab_size set: its own, else the tokenizer's (what training uses)."""
    if cfg.model.vocab_size is not None:
        return cfg.model
    vocab = 256 if cfg.data.tokenizer == "bytes" else cfg.data.vocab_size
    return cfg.model.with_vocab_size(vocab)


def planned_micro_batch(train: TrainConfig, dp: int) -> tuple[int, int, str | None]:
    """``(micro_batch_size, grad_accum, note)`` for ``dp`` data-parallel ranks: the config's
    micro-batch when the global batch splits into it, else the largest micro-batch up to it that
    divides each rank's share (``note`` says so). A global batch that does not split over the
    ranks at all cannot be planned."""
    share, rest = divmod(train.global_batch_size, dp)
    if rest:
        raise ValueError(f"train.global_batch_size ({train.global_batch_size}) must be divisible by the "
                         f"data-parallel size ({dp}) to plan for --nproc {dp}")
    micro = max(m for m in range(1, min(train.micro_batch_size, share) + 1) if share % m == 0)
    accum = share // micro
    per_rank = f"the {share} sequences per rank (train.global_batch_size ({train.global_batch_size}) / {dp} ranks)"
    if micro != train.micro_batch_size:
        why = f"train.micro_batch_size ({train.micro_batch_size}) does not divide {per_rank}"
    elif train.grad_accum not in (None, accum):
        why = f"train.grad_accum ({train.grad_accum}) micro-batches of {micro} do not make {per_rank}"
    else:
        return micro, accum, None
    return micro, accum, f"planned with micro-batch {micro} and {accum} accumulation step(s): {why}"


def make_plan(cfg: JobConfig, *, nproc: int, nodes: int = 1, device_memory: int | None = None,
              stages=(0, 1, 2, 3), eps=None, offloads=OFFLOADS, acs=AC_CHOICES, profile=None) -> Plan:
    """Evaluate every choice for ``nproc`` processes in all (over ``nodes`` nodes); with a device
    ``profile`` (``moetrain.plan.step_time``) also its step time, which then ranks the choices."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc ({nproc!r}) must be an int >= 1")
    if not isinstance(nodes, int) or nodes < 1 or nproc % nodes != 0:
        raise ValueError(f"--nodes ({nodes!r}) must be an int >= 1 that divides --nproc ({nproc})")
    model = resolve_vocab(cfg)
    moe = cfg.moe
    if cfg.parallel.dp not in (-1, nproc):
        raise ValueError(f"parallel.dp ({cfg.parallel.dp}) must be -1 or the world size ({nproc}) to plan")
    micro, grad_accum, batch_note = planned_micro_batch(cfg.train, nproc)
    T = micro * cfg.data.seq_len
    specs = param_specs(model, moe, finetune=cfg.finetune)
    compute_bytes = 4 if cfg.train.dtype == "fp32" else 2
    per_node = nproc // nodes
    if eps is None:
        eps = [d for d in range(1, nproc + 1) if nproc % d == 0]
    hsdps = [1] + ([nodes] if nodes > 1 else [])
    # Model states depend on the layout only (not on checkpointing): compute each once.
    state_cache: dict[Layout, list] = {}
    rules = LayoutRules(cfg, world=nproc, per_node=per_node, micro_batch_size=micro)

    def states(layout: Layout) -> list:
        if layout not in state_cache:
            state_cache[layout] = state_bytes_per_rank(specs, layout)
        return state_cache[layout]

    rows = []
    for stage, ep, offload, ac, hsdp in itertools.product(stages, eps, offloads, acs, hsdps):
        choice = Choice(stage, ep, offload, ac, hsdp)
        if hsdp > 1 and stage < 2:
            continue  # HSDP only exists for the FSDP stages; not worth a line per stage
        reason = (_invalid(choice, model, moe, nproc, per_node=per_node, hierarchical=cfg.parallel.ep_hierarchical)
                  or rules.main_row(zero_stage=stage, ep=ep, offload=offload, ac=ac, hsdp_replicate=hsdp))
        row = PlanRow(choice=choice, valid=reason is None, reason=reason)
        if reason is None:
            _fill(row, specs, model, cfg, nproc=nproc, micro=micro, grad_accum=grad_accum,
                  compute_bytes=compute_bytes, per_node=per_node, device_memory=device_memory, states=states)
            if profile is not None and offload == "none":
                row.step = _step_estimate(specs, model, cfg, choice, nproc=nproc, micro=micro,
                                          grad_accum=grad_accum, per_node=per_node, profile=profile)
        rows.append(row)
    counts = {"total": sum(s.numel for s in specs), "expert": sum(s.numel for s in specs if s.expert)}
    counts["non_expert"] = counts["total"] - counts["expert"]
    tp_rows = tp_choices(specs, model, per_node=per_node, micro_batch_size=micro, seq_len=cfg.data.seq_len,
                         grad_accum=grad_accum, compute_bytes=compute_bytes, device_memory=device_memory,
                         full_recompute=cfg.train.activation_checkpointing == "full", moe=cfg.moe, rules=rules)
    return Plan(world=nproc, nodes=nodes, device_memory=device_memory, tokens_per_micro_batch=T,
                grad_accum=grad_accum, counts=counts, rows=rows, micro_batch_size=micro, batch_note=batch_note,
                layout_note=_layout_note(cfg),
                etp_rows=etp_choices(specs, cfg, model, world=nproc, per_node=per_node, tokens_per_micro_batch=T,
                                     grad_accum=grad_accum, compute_bytes=compute_bytes, device_memory=device_memory,
                                     rules=rules),
                tp_rows=tp_rows, pp_rows=_pipeline_rows(cfg, model, nproc=nproc, micro=micro, rules=rules,
                                                         compute_bytes=compute_bytes, device_memory=device_memory))


def _layout(c: Choice, cfg: JobConfig, nproc: int) -> Layout:
    return Layout(world=nproc, ep=c.ep, zero_stage=c.zero_stage, hsdp_replicate=c.hsdp_replicate,
                  offload_optimizer=c.offload != "none", offload_params=c.offload == "params",
                  weight_average=cfg.optim.ema_decay > 0, optimizer=cfg.optim.name,
                  grad_compression=cfg.dp.grad_compression,
                  expert_slots_per_rank=cfg.parallel.expert_slots_per_rank if cfg.moe.rebalance_every > 0 else 0)


def _layout_note(cfg: JobConfig) -> str | None:
    p = cfg.parallel
    axes = [f"parallel.{n} ({getattr(p, n)})" for n in ("tp", "pp", "etp") if getattr(p, n) != 1]
    return (f"this config sets {', '.join(axes)}; the table plans every rank data-parallel (dp x ep, tp = pp "
            "= etp = 1); the tables below size tp, pp and etp (at the config's ep)"
            ) if axes else None


def _pipeline_rows(cfg: JobConfig, model: ModelConfig, *, nproc: int, micro: int, compute_bytes: int,
                   device_memory: int | None, rules: LayoutRules) -> list[PipelineChoice]:
    """The pipeline choices, each with the micro-batch count its data-parallel size gives, and
    the reason the job config refuses it (``rules``)."""
    act = estimate_activations(model, cfg.moe, micro_batch_size=micro, seq_len=cfg.data.seq_len,
                               ac=cfg.train.activation_checkpointing, ac_every=cfg.train.activation_checkpointing_every,
                               dtype=cfg.train.dtype)

    def microbatches_of(pp: int) -> int | None:
        dp = nproc // pp
        return cfg.train.global_batch_size // (dp * micro) if cfg.train.global_batch_size % (dp * micro) == 0 else None

    rows = pipeline_choices(_meta_model(model, cfg.moe), world=nproc, micro_batch_size=micro, seq_len=cfg.data.seq_len,
                            split=cfg.parallel.pp_split, microbatches_of=microbatches_of,
                            saved_bytes_per_microbatch=act.saved_bytes, head_bytes_per_microbatch=act.terms["head"],
                            compute_bytes=compute_bytes, device_memory=device_memory)
    return [c if c.reason else replace(c, reason=rules.pp_row(pp=c.pp, schedule=c.schedule,
                                                              virtual_stages=c.virtual_stages)) for c in rows]


def _invalid(c: Choice, model: ModelConfig, moe, world: int, *, per_node: int, hierarchical: bool) -> str | None:
    if not model.is_moe and c.ep > 1:
        return f"parallel.ep ({c.ep}) must be 1 for a dense model (model.moe_every = 0)"
    try:
        ParallelDims(world_size=world, ep=c.ep, dp=world, num_experts=moe.num_experts if model.is_moe else None,
                     ranks_per_node=per_node, ep_hierarchical=hierarchical)
    except ValueError as e:
        return str(e)
    if c.zero_stage > 0 and world == 1:
        return f"parallel.zero_stage ({c.zero_stage}) needs more than one data-parallel rank to shard over"
    try:
        check_offload(c.zero_stage, offload_optimizer=c.offload != "none", offload_param=c.offload == "params")
    except ValueError as e:
        return str(e)
    if c.ac == "moe" and not model.is_moe:
        return "train.activation_checkpointing ('moe') needs MoE blocks (model.moe_every > 0)"
    if c.ac == "every_n" and model.num_layers < 2:
        return "train.activation_checkpointing ('every_n') needs at least 2 blocks"
    return None


def _fill(row: PlanRow, specs, model: ModelConfig, cfg: JobConfig, *, nproc: int, micro: int, grad_accum: int,
          compute_bytes: int, per_node: int, device_memory: int | None, states) -> None:
    c = row.choice
    layout = _layout(c, cfg, nproc)
    per_rank = states(layout)
    row.per_rank_states = [s.as_dict() for s in per_rank]
    worst = max(per_rank, key=lambda s: s.total)
    row.param_bytes, row.grad_bytes, row.optim_bytes = worst.param, worst.grad, worst.optim
    row.average_bytes = worst.average
    row.gathered_param_bytes = unsharded_param_peak_bytes(specs, layout, compute_bytes=compute_bytes)
    T = micro * cfg.data.seq_len
    act = estimate_activations(model, cfg.moe, micro_batch_size=micro,
                               seq_len=cfg.data.seq_len, ep=c.ep, ac=c.ac,
                               ac_every=cfg.train.activation_checkpointing_every, dtype=cfg.train.dtype)
    row.activation_bytes, row.a2a_buffer_bytes = act.peak_bytes, act.a2a_buffer_bytes
    # What lives on the host: ZeRO-1 offload moves the optimizer slice and its master copy;
    # FSDP2's CPUOffloadPolicy (stages 2/3) moves sharded parameters, gradients and states.
    if c.offload == "none":
        host = 0
        device_states = worst.total
    elif c.zero_stage == 1:  # the weight average stays with the weights, on the device
        host, device_states = worst.optim, worst.total - worst.optim
    else:
        host, device_states = worst.total, 0
    row.host_bytes = host
    row.transient_bytes = transient_state_bytes(specs, layout, bucket_numel=cfg.zero.allgather_bucket_size)
    row.device_bytes = device_states + row.gathered_param_bytes + row.transient_bytes + row.activation_bytes
    recomputed = moe_layers_recomputed(model, c.ac, cfg.train.activation_checkpointing_every)
    row.comm = comm_per_step(specs, layout, model, cfg.moe, tokens_per_micro_batch=T, grad_accum=grad_accum,
                             compute_bytes=compute_bytes, ac_moe_layers_recomputed=recomputed,
                             procs_per_node=per_node, ep_hierarchical=cfg.parallel.ep_hierarchical,
                             grad_compression=_compression(cfg.dp.grad_compression, c.zero_stage),
                             seq_len=cfg.data.seq_len).as_dict()
    if c.ep > per_node or per_node % c.ep != 0:
        row.ep_spans_nodes = True
        row.notes.append(f"ep={c.ep} spans nodes ({per_node} processes per node): all-to-alls cross the "
                         "slower inter-node link")
        if cfg.parallel.ep_hierarchical:
            flat, hier = row.comm["all_to_all_inter_node_flat"], row.comm["all_to_all_inter_node_hierarchical"]
            row.notes.append(f"parallel.ep_hierarchical: {hier / 2**20:.1f} MiB of all-to-all per step cross "
                             f"nodes instead of {flat / 2**20:.1f} MiB (each token once per destination node)")
    if cfg.dp.grad_compression == "onebit" and c.zero_stage == 0:
        row.notes.append("dp.grad_compression onebit: all-reduce bytes of a compressed step; the first "
                         "dp.onebit_warmup_steps steps all-reduce fp32 gradients")
    if device_memory is not None:
        row.fits = row.device_bytes <= device_memory


def _step_estimate(specs, model: ModelConfig, cfg: JobConfig, c: Choice, *, nproc: int, micro: int, grad_accum: int,
                   per_node: int, profile) -> dict:
    from moetrain.plan.step_time import CalibratedProfiles, estimate_step_time

    if isinstance(profile, CalibratedProfiles):
        profile = profile.for_procs(per_node)
    return estimate_step_time(specs, _layout(c, cfg, nproc), model, cfg.moe, micro_batch_size=micro,
                              seq_len=cfg.data.seq_len, grad_accum=grad_accum, profile=profile,
                              dtype=cfg.train.dtype, tf32=cfg.train.tf32, ac=c.ac,
                              ac_every=cfg.train.activation_checkpointing_every, procs_per_node=per_node,
                              dispatch_chunks=cfg.moe.dispatch_chunks).as_dict()


def _compression(mode: str, zero_stage: int) -> str:
    """dp.grad_compression where the stage supports it (bf16 at 0/1, onebit at 0), else "none"."""
    return mode if (mode == "bf16" and zero_stage <= 1) or (mode == "onebit" and zero_stage == 0) else "none"
