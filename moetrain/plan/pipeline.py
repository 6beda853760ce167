"""Pipeline-parallel planning: the bubble, the activations each stage holds under its schedule, the
point-to-point bytes, and each pp rank's parameters.

With p stages per pipeline, v stages per rank (interleaved 1F1B) and m micro-batches per step,
each of equal time t (a rank's forward plus backward of one micro-batch over all its layers):

    bubble fraction = (p - 1) / (v * m + p - 1)

of the step: ``(p - 1) * t / v`` idle at the warm-up and drain, around ``m * t`` of work
(GPipe and 1F1B share it; 1F1B only holds fewer activations). Activations held at the peak, in
micro-batches of the rank's whole share of layers, on pp rank r:

    gpipe              m                                  (every forward before any backward)
    1f1b               min(p - r, m)                      (rank r's warm-up forwards, then 1:1)
    interleaved_1f1b   min(v m, 2 (p - r - 1) + (v - 1) p + 1) / v
                                                          (Megatron's warm-up count, in chunks
                                                           of 1/v of the rank's layers)

A stage's activations per micro-batch are taken as its share of the blocks' saved bytes
(``moetrain.plan.activations``: block terms split evenly over the blocks, the head's and the
multi-token modules' on the last stage), so a stage of dense blocks next to MoE blocks is approximated.

Point-to-point bytes per step, per rank: every stage but the last sends its output ``[B, S, D]``
forward once per micro-batch, every stage but the first sends the gradient of its input back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moetrain.config.pipeline import PP_SCHEDULES, check_microbatches, shares_embedding
from moetrain.distributed.pipeline.stages import layer_costs, rank_stage_ids, split_stages


def bubble_fraction(*, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a step: ``(p - 1) / (v m + p - 1)``; 0 without pipelining."""
    return (pp - 1) / (virtual_stages * num_microbatches + pp - 1)


def microbatches_in_flight(schedule: str, *, pp: int, pp_rank: int, num_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """Micro-batches of activations (of the rank's whole share of layers) pp rank ``pp_rank``
    holds at its peak under ``schedule`` (see the module docstring)."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule ({schedule!r}) must be one of {', '.join(map(repr, PP_SCHEDULES))}")
    m, p, v, r = num_microbatches, pp, virtual_stages, pp_rank
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - r, m))
    return min(v * m, 2 * (p - r - 1) + (v - 1) * p + 1) / v


def p2p_bytes_per_step(*, stage_ids: list[int], num_stages: int, num_microbatches: int, micro_batch_size: int,
                       seq_len: int, dim: int, dtype_bytes: int) -> int:
    """Bytes a rank holding ``stage_ids`` sends per step: activations forward from every stage
    but the last, input gradients back from every stage but the first."""
    one = micro_batch_size * seq_len * dim * dtype_bytes
    sends = sum((s < num_stages - 1) + (s > 0) for s in stage_ids)
    return sends * num_microbatches * one


@dataclass
class PipelineRankPlan:
    pp_rank: int
    stage_ids: list[int]
    layers: list[int]
    """Block indices this rank holds."""
    params: int
    """Parameters of its stages (embedding, head, multi-token modules and every expert counted,
    before any sharding; the last stage's copy of a shared embedding included)."""
    microbatches_in_flight: float
    activation_bytes: int
    """Activations held at the schedule's peak (``microbatches_in_flight`` x the stages' saved
    bytes per micro-batch)."""
    p2p_bytes: int


@dataclass
class PipelinePlan:
    schedule: str
    bubble_fraction: float
    ranks: list[PipelineRankPlan]


def plan_pipeline(model, *, pp: int, schedule: str, num_microbatches: int, virtual_stages: int = 1,
                  split: str = "layers", micro_batch_size: int, seq_len: int, saved_bytes_per_microbatch: int,
                  head_bytes_per_microbatch: int, dtype_bytes: int = 4) -> PipelinePlan:
    """Per pp rank of ``model`` (a ``Transformer``, on the meta device for large configs): its
    stages as ``parallel.pp_split`` cuts them, parameters, activations at the peak and p2p bytes.
    ``saved_bytes_per_microbatch`` and ``head_bytes_per_microbatch`` are one micro-batch's saved
    activations of the whole model and of its head with the multi-token modules
    (``estimate_activations``'s ``saved_bytes`` and ``terms["head"]``)."""
    num_stages = pp * virtual_stages
    costs, first, last = layer_costs(model, split, seq_len=seq_len)
    stages = split_stages(costs, num_stages, first_extra=first, last_extra=last)
    L = len(model.layers)
    per_block = (saved_bytes_per_microbatch - head_bytes_per_microbatch) / L
    ranks = []
    for r in range(pp):
        ids = rank_stage_ids(r, pp, virtual_stages)
        layers = [i for s in ids for i in stages[s]]
        holds_last = num_stages - 1 in ids
        params = _rank_params(model, layers, first=0 in ids, last=holds_last)
        in_flight = microbatches_in_flight(schedule, pp=pp, pp_rank=r, num_microbatches=num_microbatches,
                                           virtual_stages=virtual_stages)
        one = per_block * len(layers) + (head_bytes_per_microbatch if holds_last else 0)
        ranks.append(PipelineRankPlan(
            pp_rank=r, stage_ids=ids, layers=layers, params=params, microbatches_in_flight=in_flight,
            activation_bytes=int(in_flight * one),
            p2p_bytes=p2p_bytes_per_step(stage_ids=ids, num_stages=num_stages, num_microbatches=num_microbatches,
                                         micro_batch_size=micro_batch_size, seq_len=seq_len, dim=model.config.dim,
                                         dtype_bytes=dtype_bytes)))
    return PipelinePlan(schedule=schedule, bubble_fraction=bubble_fraction(
        pp=pp, num_microbatches=num_microbatches, virtual_stages=virtual_stages), ranks=ranks)


def _rank_params(model, layers: list[int], *, first: bool, last: bool) -> int:
    """Parameters of the modules a rank's stages hold (``PipelineChunk``): its blocks; the
    embedding on the first stage; on the last the final norm, the head and the multi-token
    modules, with the embedding too where they read it or the head is tied to it (the last
    stage's copy, ``shares_embedding``). A tensor two of them share counts once."""
    modules = [model.layers[i] for i in layers]
    if first or (last and shares_embedding(model.config)):
        modules.append(model.tok_embeddings)
    if last:
        modules += [model.norm, model.output, model.mtp]
    unique = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() for p in unique.values())


def format_pipeline_plan(plan: PipelinePlan) -> str:
    """A small table: one line per pp rank."""
    lines = [f"pipeline: schedule {plan.schedule}, bubble fraction {plan.bubble_fraction:.3f}",
             "  pp rank  stages   blocks        params      activations   p2p bytes/step"]
    for r in plan.ranks:
        blocks = f"{r.layers[0]}-{r.layers[-1]}" if r.layers == list(range(r.layers[0], r.layers[-1] + 1)) \
            else ",".join(map(str, r.layers))
        lines.append(f"  {r.pp_rank:>7}  {','.join(map(str, r.stage_ids)):<7}  {blocks:<12}  {r.params:>10,}  "
                     f"{r.activation_bytes / 2**20:>10.1f} MiB  {r.p2p_bytes / 2**20:>10.2f} MiB")
    return "\n".join(lines)


@dataclass
class PipelineChoice:
    """One pipeline layout of ``moetrain plan``: pp stages (with v per rank), its schedule and the
    largest rank's share."""

    pp: int
    schedule: str
    virtual_stages: int
    num_microbatches: int
    bubble_fraction: float
    max_params: int
    """Parameters of the largest pp rank (every expert counted: an upper bound before ep/ZeRO)."""
    state_bytes: int
    """Its parameters, gradients and AdamW states, replicated (no ZeRO, no ep): the upper bound."""
    activation_bytes: int
    """The largest rank's activations at its schedule's peak."""
    p2p_bytes: int
    """The most any rank sends per step."""
    fits: bool | None = None
    reason: str | None = None
    """Why this choice cannot run (None when it can)."""


def pipeline_choices(model, *, world: int, micro_batch_size: int, seq_len: int, split: str,
                     microbatches_of: Callable[[int], int | None], saved_bytes_per_microbatch: int,
                     head_bytes_per_microbatch: int, compute_bytes: int,
                     device_memory: int | None) -> list[PipelineChoice]:
    """Every pp > 1 dividing ``world`` with at least one block per stage, under each schedule
    (interleaved with 2 stages per rank where the blocks allow). ``microbatches_of(pp)`` is the
    micro-batch count per step at data-parallel size world / pp (the accumulation steps); None
    skips a pp whose data-parallel size does not split the global batch."""
    num_layers = len(model.layers)
    out = []
    for pp in (p for p in range(2, world + 1) if world % p == 0 and p <= num_layers):
        m = microbatches_of(pp)
        if m is None:
            continue
        for schedule in PP_SCHEDULES:
            v = 2 if schedule == "interleaved_1f1b" else 1
            if pp * v > num_layers:
                continue
            try:
                check_microbatches(schedule, num_microbatches=m, pp=pp)
                reason = None
            except ValueError as e:
                reason = str(e)
            plan = plan_pipeline(model, pp=pp, schedule=schedule, num_microbatches=m, virtual_stages=v, split=split,
                                 micro_batch_size=micro_batch_size, seq_len=seq_len,
                                 saved_bytes_per_microbatch=saved_bytes_per_microbatch,
                                 head_bytes_per_microbatch=head_bytes_per_microbatch, dtype_bytes=compute_bytes)
            max_params = max(r.params for r in plan.ranks)
            # fp32 master weights and gradients plus AdamW's two moments.
            states = max_params * (4 + 4 + 8)
            activations = max(r.activation_bytes for r in plan.ranks)
            fits = None if device_memory is None else states + activations <= device_memory
            out.append(PipelineChoice(pp=pp, schedule=schedule, virtual_stages=v, num_microbatches=m,
                                      bubble_fraction=plan.bubble_fraction, max_params=max_params,
                                      state_bytes=states, activation_bytes=activations,
                                      p2p_bytes=max(r.p2p_bytes for r in plan.ranks), fits=fits, reason=reason))
    return out


def format_pipeline_choices(choices: list[PipelineChoice]) -> list[str]:
    """Lines of the plan's pipeline table."""
    lines = [("pipeline choices (largest pp rank; states = params + grads + AdamW, replicated: an upper bound "
             "before ep and ZeRO, which apply inside each stage):"),
             "   pp  schedule            v  micro  bubble   params/rank   states MiB  activ MiB  p2p MiB/step  fits"]
    for c in choices:
        fits = "-" if c.fits is None else ("yes" if c.fits else "NO")
        text = (f"  {c.pp:>3}  {c.schedule:<18} {c.virtual_stages:>2}  {c.num_microbatches:>5}"
                f"  {c.bubble_fraction:6.3f}  {c.max_params:>12,}  {c.state_bytes / 2**20:>11.1f}"
                f"  {c.activation_bytes / 2**20:>9.1f}  {c.p2p_bytes / 2**20:>12.2f}  {fits}")
        lines.append(text + (f"  [invalid: {c.reason}]" if c.reason else ""))
    return lines
