"""``moetrain plan``'s text: the ranked table of a ``Plan`` (``make_plan``), the choices that do not
fit, the invalid ones grouped by the rule they break, the tp/etp/pp tables and the advice."""

from __future__ import annotations

from moetrain.plan.expert_tensor_parallel import format_etp
from moetrain.plan.pipeline import format_pipeline_choices
from moetrain.plan.planner import Plan, PlanRow
from moetrain.plan.tensor_parallel import format_tp


def _step_columns(step: dict | None) -> str:
    if step is None:
        return f" | {'-':>8} {'-':>10} {'-':>6}"
    return f" | {step['step_s']:8.3f} {step['tokens_per_s']:10.0f} {step['mfu']:6.1%}"


def stage3_advice(plan: Plan) -> list[str]:
    """What the ranking decided about stage 3, from the numbers: it ranks after every lighter
    choice that fits (``Plan.ranked``), so it leads only when nothing lighter fits."""
    ranked = plan.ranked
    if ranked:
        return ["only ZeRO-3 fits this device: parameters must be sharded"] if ranked[0].choice.zero_stage == 3 else []
    fits = plan.device_memory is None
    return [] if fits else ["nothing fits: add ranks, offload, checkpoint activations or shrink the micro-batch"]


def format_plan(plan: Plan, *, top: int | None = 20, show_invalid: bool = True) -> str:
    """The human-readable table: ranked valid choices, then the invalid ones grouped by reason."""
    valid = [r for r in plan.rows if r.valid]
    big = max((max(r.device_bytes, r.host_bytes, r.comm["total"]) for r in valid), default=0)
    unit, scale = ("GiB", 2**30) if big >= 2**30 else ("MiB", 2**20)
    gib = 2**30

    def g(x: int) -> str:
        return f"{x / scale:8.2f}"

    lines = [(f"world {plan.world} processes on {plan.nodes} node(s); {plan.tokens_per_micro_batch} tokens per "
             f"micro-batch ({plan.micro_batch_size} sequence(s)), {plan.grad_accum} micro-batch(es) per step; "
             f"parameters {plan.counts['total'] / 1e9:.3f}B ({plan.counts['expert'] / 1e9:.3f}B in experts)")]
    lines += ["note: " + n for n in (plan.batch_note, plan.layout_note) if n is not None]
    if plan.device_memory is not None:
        lines.append(f"device memory {plan.device_memory / gib:.2f} GiB per rank")
    lines.append(f"per rank, {unit} (the largest rank); communication: {unit} this rank sends per step")
    if any(r.average_bytes for r in valid):
        lines.append("optim includes the weight average of optim.ema_decay (one more copy of the rank's weights)")
    hdr = (f"{'#':>3} {'choice':44s} {'param':>8} {'grad':>8} {'optim':>8} {'gather':>8} {'transnt':>8} {'activ':>8} "
           f"{'a2a buf':>8} {'device':>8} {'host':>8} | {'a2a':>8} {'allred':>8} {'redsc':>8} {'allgat':>8} "
           f"{'total':>8} {'inter':>8} fits")
    timed = any(r.step for r in valid)
    if timed:
        hdr += f" | {'step s':>8} {'tok/s':>10} {'MFU':>6}"
    lines.append(hdr)

    def line(i: int, r: PlanRow) -> str:
        cm = r.comm
        fits = "-" if r.fits is None else ("yes" if r.fits else "NO")
        return (f"{i:>3} {r.choice.label():44s} {g(r.param_bytes)} {g(r.grad_bytes)} "
                f"{g(r.optim_bytes + r.average_bytes)} {g(r.gathered_param_bytes)} {g(r.transient_bytes)} "
                f"{g(r.activation_bytes)} {g(r.a2a_buffer_bytes)} {g(r.device_bytes)} {g(r.host_bytes)} | "
                f"{g(cm['all_to_all'])} {g(cm['all_reduce'])} "
                f"{g(cm['reduce_scatter'])} {g(cm['all_gather'])} {g(cm['total'])} {g(cm['inter_node'])} {fits:4s}"
                + (_step_columns(r.step) if timed else "") + (f" [{'; '.join(r.notes)}]" if r.notes else ""))

    ranked = plan.ranked
    for i, r in enumerate(ranked[:top] if top else ranked, 1):
        lines.append(line(i, r))
    if top and len(ranked) > top:
        lines.append(f"    ... {len(ranked) - top} more that fit (--all lists every choice)")
    too_big = sorted((r for r in plan.rows if r.valid and r.fits is False), key=lambda r: r.device_bytes)
    if too_big:
        lines.append(f"do not fit ({len(too_big)}), least device memory first:")
        for r in too_big[:top] if top else too_big:
            lines.append(line(0, r).replace("  0 ", "  - ", 1))
    if show_invalid:
        reasons: dict[str, int] = {}
        for r in plan.rows:
            if r.reason is not None:  # the invalid ones
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
        if reasons:
            lines.append("invalid:")
            lines += [f"  {n:3d} choice(s): {reason}" for reason, n in reasons.items()]
    for advice in stage3_advice(plan):
        lines.append("advice: " + advice)
    if len(plan.tp_rows) > 1:
        lines += format_tp(plan.tp_rows)
    if len(plan.etp_rows) > 1:
        lines += format_etp(plan.etp_rows)
    if plan.pp_rows:
        lines += format_pipeline_choices(plan.pp_rows)
        if plan.device_memory is not None and not any(r.fits for r in plan.rows if r.valid):
            fitting = [c for c in plan.pp_rows if c.fits and c.reason is None]
            if fitting:
                best = min(fitting, key=lambda c: (c.bubble_fraction, c.pp))
                virtual = f" parallel.pp_virtual_stages={best.virtual_stages}" if best.virtual_stages > 1 else ""
                lines.append(f"advice: no layout without pipelining fits; pp={best.pp} with {best.schedule} fits "
                             f"(bubble {best.bubble_fraction:.3f}): parallel.pp={best.pp} "
                             f"parallel.pp_schedule={best.schedule}{virtual}")
    return "\n".join(lines)
