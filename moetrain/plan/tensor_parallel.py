"""Tensor-parallel choices for ``moetrain plan``: what ``parallel.tp`` saves in the dense part's
model states and what it costs in collective bytes, per the layout of
``moetrain.distributed.tensor_parallel`` (Megatron's, with sequence parallelism).

Memory. tp splits the attention projections, the dense FFNs, the token embedding and the LM head
(the "dense part", where a layer's non-expert weights live); norms, routers, shared experts and
the routed experts are not split by tp (the experts split over ep, which folds over the tp ranks).
Model states at ZeRO stage 0: fp32 parameter, gradient and two AdamW moments, 16 bytes an element.

Communication per micro-batch, each rank's send volume as a ring moves it, with
``X = B * S * D * compute bytes`` (the residual stream of one micro-batch):

    forward   per block: attention input all-gather + output reduce-scatter; per dense-FFN block
              another pair; the embedding's reduce-scatter, the head input's all-gather, and the
              logits' all-gather (``B * S * V`` elements): each ``(tp - 1) / tp`` of its size
    backward  the same sequence collectives again (an all-gather's backward is a reduce-scatter
              and the other way round); the logits gather needs none
    recompute full activation checkpointing repeats every block's forward collectives

The gradient all-reduce of the tp-split weights shrinks by tp; that is counted by the ZeRO rows of
the plan at tp = 1 and not repeated here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moetrain.config.job import check_mtp_split, check_sequence_split
from moetrain.config.model import ModelConfig, tensor_parallel_errors
from moetrain.config.moe import MoEConfig
from moetrain.plan.job_rules import LayoutRules
from moetrain.plan.model_states import ParamSpec

STATE_BYTES_PER_ELEMENT = 16
"""fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq (ZeRO stage 0)."""

_SPLIT = re.compile(r"(^tok_embeddings\.weight$|^output\.weight$|\.attention\.w[qkvo]\.(weight|bias)$"
                    r"|^layers\.\d+\.feed_forward\.w[123]\.weight$)")
"""Parameters ``apply_tensor_parallel`` splits over tp (the dense part)."""


def is_tp_split(spec: ParamSpec) -> bool:
    return bool(_SPLIT.search(spec.name))


@dataclass(frozen=True)
class TpChoice:
    tp: int
    valid: bool
    reason: str | None
    dense_state_bytes: int
    """Model states of the dense part on one rank (its 1/tp share), stage 0."""
    other_state_bytes: int
    """Model states of everything tp does not split (norms, routers, shared experts), stage 0; the
    routed experts are left out (they shard over ep)."""
    all_gather_bytes: int
    reduce_scatter_bytes: int
    """Bytes this rank sends per optimizer step in tp's all-gathers and reduce-scatters."""
    per_layer_bytes: int
    """Of those, one transformer block's (attention and a dense FFN) per micro-batch, forward and
    backward."""
    fits: bool | None = None
    """Whether dense + other states fit the device memory (None without one)."""

    @property
    def total_bytes(self) -> int:
        return self.all_gather_bytes + self.reduce_scatter_bytes


def tp_invalid(model: ModelConfig, tp: int, *, per_node: int, seq_len: int,
               moe: MoEConfig | None = None) -> str | None:
    """Why ``tp`` cannot split ``model`` with its MoE settings ``moe`` (the job's and the model's
    rules, and the planner's own: tp within a node), or None."""
    if per_node % tp:
        return f"parallel.tp ({tp}) must divide the processes per node ({per_node}): tp collectives stay in a node"
    errors = tensor_parallel_errors(model, tp, moe=moe)
    for check, args in ((check_sequence_split, (seq_len,)), (check_mtp_split, (model.mtp_depth, seq_len))):
        try:
            check(*args, tp=tp)
        except ValueError as e:
            errors.append(str(e))
    return "; ".join(errors) or None


def tp_bytes_per_micro_batch(model: ModelConfig, *, tp: int, micro_batch_size: int, seq_len: int,
                             compute_bytes: int, recompute_blocks: int = 0) -> tuple[int, int, int]:
    """``(all_gather, reduce_scatter, per_layer)`` bytes one rank sends for one micro-batch (see the
    module docstring)."""
    if tp == 1:
        return 0, 0, 0
    X = micro_batch_size * seq_len * model.dim * compute_bytes
    frac = (tp - 1) / tp
    num_dense = model.num_layers - len(model.moe_layer_ids)
    pairs = model.num_layers + num_dense  # (all-gather, reduce-scatter) pairs per block forward
    # Forward: a pair per attention and per dense FFN, the embedding's reduce-scatter, the head
    # input's all-gather; backward swaps them; recomputed blocks repeat their forward pairs.
    gathers = pairs + 1 + pairs + 1 + recompute_blocks
    scatters = pairs + 1 + pairs + 1 + recompute_blocks
    logits = micro_batch_size * seq_len * model.num_outputs * compute_bytes
    all_gather = round(frac * (gathers * X + logits))
    per_layer = round(frac * X * 4 * 2)  # attention + dense FFN, forward and backward
    return all_gather, round(frac * scatters * X), per_layer


def tp_choices(specs: list[ParamSpec], model: ModelConfig, *, per_node: int, micro_batch_size: int, seq_len: int,
               grad_accum: int, compute_bytes: int, device_memory: int | None = None,
               full_recompute: bool = False, moe: MoEConfig | None = None,
               rules: LayoutRules | None = None) -> list[TpChoice]:
    """One ``TpChoice`` per tp dividing the processes per node, tp = 1 first (``moe``: the job's MoE
    settings, which some tp rules read; ``rules``: the job config's, which then decide the rest)."""
    split = sum(s.numel for s in specs if is_tp_split(s))
    other = sum(s.numel for s in specs if not s.expert and not is_tp_split(s))
    out = []
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        reason = tp_invalid(model, tp, per_node=per_node, seq_len=seq_len, moe=moe) or (
            rules.tp_row(tp) if rules is not None else None)
        dense = -(-split // tp) * STATE_BYTES_PER_ELEMENT
        rest = other * STATE_BYTES_PER_ELEMENT
        recompute = (model.num_layers + model.num_layers - len(model.moe_layer_ids)) if full_recompute else 0
        ag, rs, layer = tp_bytes_per_micro_batch(model, tp=tp, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                                 compute_bytes=compute_bytes, recompute_blocks=recompute)
        fits = None if device_memory is None else dense + rest <= device_memory
        out.append(TpChoice(tp, reason is None, reason, dense, rest, ag * grad_accum, rs * grad_accum, layer, fits))
    return out


def tp_advice(choices: list[TpChoice]) -> str | None:
    """Recommend the smallest valid tp whose dense-part states fit when tp = 1 does not; None when
    tp = 1 fits or no device memory was given."""
    if not choices or choices[0].fits is not False:
        return None
    fitting = [c for c in choices if c.valid and c.fits]
    if not fitting:
        return "the dense part does not fit at any tp within a node: add pipeline stages or shard with ZeRO-3"
    best = fitting[0]
    return (f"the dense part does not fit at tp=1: use parallel.tp={best.tp} "
            f"({best.dense_state_bytes / 2**30:.2f} GiB of dense states per rank, "
            f"{best.total_bytes / 2**30:.2f} GiB of tp collectives per step)")


def choice_table(title: str, columns: list[str], rows: list[tuple], advice: str | None) -> list[str]:
    """Lines of a plan section of parallel degrees: ``title``, a header (the degree's column first,
    "fits" last), a line per ``(degree, reason, cells, fits, note)`` (an invalid choice shows only
    its reason; ``cells`` are formatted, 8 characters wide), then the advice if there is one."""
    lines = [title, "  " + " ".join([f"{columns[0]:>3}"] + [f"{c:>8}" for c in columns[1:]]) + " fits"]
    for degree, reason, cells, fits, note in rows:
        if reason is not None:
            lines.append(f"  {degree:>3} invalid: {reason}")
            continue
        lines.append(f"  {degree:>3} " + " ".join(cells) + " " + ("-" if fits is None else ("yes" if fits else "NO"))
                     + note)
    return lines + (["advice: " + advice] if advice else [])


def format_tp(choices: list[TpChoice]) -> list[str]:
    """Lines of the plan's tensor-parallel section."""
    gib = 2**30
    rows = [(c.tp, c.reason, [f"{c.dense_state_bytes / gib:8.3f}", f"{c.other_state_bytes / gib:8.3f}",
                              f"{c.all_gather_bytes / gib:8.3f}", f"{c.reduce_scatter_bytes / gib:8.3f}",
                              f"{c.per_layer_bytes / gib:8.4f}"], c.fits, "") for c in choices]
    return choice_table("tensor parallelism (dense part split over tp, stage-0 states; tp collectives per step, GiB):",
                        ["tp", "dense", "other", "allgat", "redsc", "/layer"], rows, tp_advice(choices))
