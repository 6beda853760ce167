"""The dry run of a skew plan's routing (``moetrain plan --skew/--routing-trace --dry-run``): the
receive rows each plan row sized the hottest rank's buffers for, against the copies of micro-batches
routed as the trainer routes them (``moe.force_skew``'s own draw, or the trace's recorded loads).

Shape legend: E experts, K experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetrain.config.force_skew import parse_force_skew
from moetrain.config.job import JobConfig
from moetrain.models.moe.dispatcher import expert_capacity
from moetrain.models.moe.skew import SKEW_BLOCK, skew_seed, skew_weights, skewed_assignment
from moetrain.plan.skew import SkewPlan, rank_copies

DRAW_BUDGET = 1 << 26
"""Uniforms (tokens x E) the dry run draws at most for a spec, past its first micro-batch, which it
always draws whole: the micro-batches of the first steps in order until the budget is spent."""
DRAW_CHUNK = 64 * SKEW_BLOCK
"""Tokens drawn at once (a chunk's E uniforms per token is the dry run's only large buffer)."""


@dataclass(frozen=True)
class BufferCheck:
    setting: str
    planned_copies: int
    """The hottest rank's receive rows the plan sized its buffers for (``SkewRow.bound_copies``)."""
    drawn_copies: int
    """The most rows any rank received in any drawn micro-batch and MoE layer."""
    micro_batches: int = 0
    """Micro-batches x MoE layers drawn (or trace vectors read) for the check."""

    @property
    def confirmed(self) -> bool:
        return self.drawn_copies <= self.planned_copies


def confirm_buffers(cfg: JobConfig, plan: SkewPlan, *, steps: int = 4,
                    budget: int = DRAW_BUDGET) -> list[BufferCheck]:
    """Each drawn micro-batch's per-expert copies (``drawn_counts``), cut at the dispatcher's capacity
    and placed in each row's slots, against the receive rows the plan sized the hottest rank's
    buffers for."""
    E, K = cfg.moe.num_experts, cfg.moe.top_k
    micro_tokens = plan.micro_batch_size * cfg.data.seq_len * plan.world
    drawn, count = [0] * len(plan.rows), 0
    for counts_E in drawn_counts(cfg, plan, steps=steps, budget=budget):
        count += 1
        for i, r in enumerate(plan.rows):
            cap = None if r.capacity_factor is None else expert_capacity(
                micro_tokens, num_experts=E, top_k=K, capacity_factor=r.capacity_factor)
            got = rank_copies(counts_E / counts_E.sum(), copies=float(counts_E.sum()), ep=plan.ep,
                              edp=plan.world // plan.ep, capacity=cap, held=r.placement)
            drawn[i] = max(drawn[i], math.ceil(max(got.expected)))
    return [BufferCheck(r.setting, r.bound_copies, d, count) for r, d in zip(plan.rows, drawn, strict=True)]


def drawn_counts(cfg: JobConfig, plan: SkewPlan, *, steps: int, budget: int = DRAW_BUDGET):
    """Per-expert copies ``[E]`` (fp64) of each micro-batch and MoE layer: for a zipf, hot or drift
    spec, the ids the trainer's moe.force_skew draws (``ForcedSkew``: seeded per step, layer and token
    block) for the micro-batches of its first ``steps`` steps, in order, until ``budget`` uniforms are
    drawn (the first micro-batch whole in any case); for a trace (``--routing-trace`` or
    ``trace:PATH``), every recorded step's and layer's counts, scaled to one micro-batch of this plan."""
    E, K, S = cfg.moe.num_experts, cfg.moe.top_k, cfg.data.seq_len
    kind, params = ("trace", (plan.source[len("trace "):],)) if plan.source.startswith("trace ") else \
        parse_force_skew(plan.source, num_experts=E)
    if kind == "trace":
        from moetrain.train.routing_trace import expert_loads

        # A step's counts spread over this plan's micro-batch (the trace may come from another batch size).
        _, _, load_SLE, _ = expert_loads(params[0])
        copies = plan.micro_batch_size * S * plan.world * K
        yield from (v / v.sum() * copies for v in load_SLE.reshape(-1, E) if v.sum() > 0)
        return
    if kind == "none":
        raise ValueError("--dry-run with --skew needs a skewed spec (zipf, hot, drift or trace), not 'none'")
    micro_tokens = plan.micro_batch_size * S * plan.world
    spent = 0
    for step in range(1, steps + 1):
        w_E = skew_weights(kind, params, step=step, num_experts=E)
        for layer in range(len(cfg.model.moe_layer_ids)):
            for m in range(plan.grad_accum):
                if spent and spent + micro_tokens * E > budget:
                    return
                counts_E = torch.zeros(E, dtype=torch.float64)
                for start in range(m * micro_tokens, (m + 1) * micro_tokens, DRAW_CHUNK):
                    length = min(DRAW_CHUNK, (m + 1) * micro_tokens - start)
                    ids_TK = skewed_assignment(w_E, num_tokens=length, top_k=K, seed=skew_seed(step, layer),
                                               start=start)
                    counts_E += torch.bincount(ids_TK.reshape(-1), minlength=E)
                spent += micro_tokens * E
                yield counts_E


def format_buffer_checks(checks: list[BufferCheck]) -> str:
    drawn = checks[0].micro_batches if checks else 0
    lines = [f"dry run of the routing ({drawn} micro-batches x MoE layers: the trainer's forced draw, or the "
             "trace's recorded steps): receive rows of the hottest rank",
             f"{'setting':28s} {'planned':>8s} {'drawn':>8s}"]
    lines += [f"{c.setting:28s} {c.planned_copies:8d} {c.drawn_copies:8d} {'ok' if c.confirmed else 'EXCEEDED'}"
              for c in checks]
    return "\n".join(lines)
