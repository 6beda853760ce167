"""The parallel layouts ``moetrain verify`` runs: parsed from ``--layouts "ep=2,dp=2; pp=2,ep=2"``
or chosen from the job (``auto``), each checked against the layout rules before any process starts.

A layout names degrees: ``dp``, ``ep``, ``tp``, ``pp``, ``etp`` and ``zero`` (the ZeRO stage). The
processes are dp * tp * pp; dp defaults to the smallest that holds ep * etp expert ranks folded over
the dp * tp ranks of a stage (``ep=2`` alone is 2 processes, ``pp=2,ep=2`` is 4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrain.config.job import JobConfig

KEYS = {"dp": "dp", "ep": "ep", "tp": "tp", "pp": "pp", "etp": "etp", "zero": "zero_stage"}
"""Layout key -> parallel.<field>."""

MAX_PROCESSES = 4
"""Processes of an ``auto`` layout: what a CPU verification affords."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    etp: int = 1
    zero: int = 0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "ep", "tp", "pp", "etp") if getattr(self, k) > 1]
        if self.zero:
            parts.append(f"zero={self.zero}")
        return ",".join(parts) or "world 1"

    def overrides(self, *, micro_batch: int) -> list[str]:
        """The ``--parallel.*`` and ``--train.micro_batch_size`` overrides of this layout."""
        return [f"--parallel.{KEYS[k]}={getattr(self, k)}" for k in KEYS] + [f"--train.micro_batch_size={micro_batch}"]


def parse_layout(text: str) -> Layout:
    """``"pp=2,ep=2"`` -> ``Layout(dp=2, ep=2, pp=2)``; ValueError naming the part that is wrong."""
    values: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key = key.strip()
        digits = value.strip()
        # str.isdigit accepts superscripts and other scripts' digits, which int() refuses.
        if not sep or key not in KEYS or not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"--layouts ({text!r}): {part!r} must be KEY=N with KEY one of {', '.join(KEYS)}")
        if key in values:
            raise ValueError(f"--layouts ({text!r}): {key} is named twice in one layout")
        values[key] = int(digits)
    if not values:
        raise ValueError(f"--layouts ({text!r}): a layout names at least one degree, e.g. ep=2")
    if any(v < 1 for k, v in values.items() if k != "zero") or values.get("zero", 0) not in (0, 1, 2, 3):
        raise ValueError(f"--layouts ({text!r}): degrees must be >= 1 and zero one of 0, 1, 2, 3")
    tp, ep, etp = values.get("tp", 1), values.get("ep", 1), values.get("etp", 1)
    values.setdefault("dp", max(1, ep * etp // tp))
    return Layout(**values)


def parse_layouts(text: str) -> list[Layout]:
    """``"ep=2,dp=2; zero=3,ep=2"`` -> the layouts, duplicates dropped."""
    out: list[Layout] = []
    for item in (t for t in text.split(";") if t.strip()):
        layout = parse_layout(item)
        if layout not in out:
            out.append(layout)
    if not out:
        raise ValueError(f"--layouts ({text!r}) names no layout")
    return out


def job_world(cfg: JobConfig) -> int:
    """The processes the job declares: pp * tp * dp, with dp = -1 read as the fewest data-parallel
    ranks that hold its ep * etp expert ranks folded over a stage's dp * tp ranks."""
    par = cfg.parallel
    dp = par.dp if par.dp > 0 else max(1, -(-par.ep * par.etp // par.tp))
    return par.pp * par.tp * dp


def fold(layout: Layout) -> Layout:
    """``layout`` at CPU size: each degree capped at 2 (dp at least the ranks that hold the expert
    ranks), then tp and etp dropped while it needs more than ``MAX_PROCESSES`` processes."""
    capped = {k: min(getattr(layout, k), 2) for k in ("ep", "tp", "pp", "etp")}
    dp = max(min(layout.dp, 2), capped["ep"] * capped["etp"] // capped["tp"], 1)
    out = Layout(**capped, zero=layout.zero, dp=dp)
    while out.world > MAX_PROCESSES:
        out = Layout(**{**out.__dict__, "tp": 1, "etp": 1, "dp": max(1, out.ep)})
    return out


AUTO_LAYOUTS = 2
"""Layouts an ``auto`` verification runs (each costs a training run per check)."""


def auto_layouts(cfg: JobConfig, *, nproc: int | None = None) -> list[Layout]:
    """What ``--layouts auto`` verifies: the choices ``moetrain plan`` ranks best for the job at its real
    size (``nproc``, default ``job_world``, at least 2), in rank order, each folded to CPU size (``fold``; the job's
    tp, pp and etp with the choice's ZeRO stage and ep), the first ``AUTO_LAYOUTS`` distinct ones of
    more than one process; for an MoE job the best choice with ep > 1 takes the last place when none
    of them has it, so the expert-parallel exchange is always verified."""
    from moetrain.plan.planner import make_plan

    par = cfg.parallel
    moe = cfg.model.is_moe
    world = nproc or max(2, job_world(cfg))
    plan = make_plan(replace(cfg, parallel=replace(par, dp=-1)), nproc=world)
    folded: list[Layout] = []
    for row in plan.ranked:
        layout = fold(Layout(dp=world // (par.tp * par.pp), ep=row.choice.ep if moe else 1, tp=par.tp, pp=par.pp,
                             etp=par.etp if moe else 1, zero=row.choice.zero_stage))
        if layout.world > 1 and layout not in folded:
            folded.append(layout)
    if not folded:
        raise ValueError(f"--layouts auto: moetrain plan finds no valid layout of more than one process for the "
                         f"job at {world} processes; name the layouts with --layouts")
    chosen = folded[:AUTO_LAYOUTS]
    with_ep = [lay for lay in folded if lay.ep > 1]
    if moe and with_ep and not any(lay.ep > 1 for lay in chosen):
        chosen[-1] = with_ep[0]
    return chosen


def micro_batch_sizes(layouts: list[Layout], *, global_batch: int, grad_accum: int) -> dict[Layout, int]:
    """Each layout's micro-batch: the ``global_batch / grad_accum`` sequences of one micro-batch
    step split over its dp ranks, so every layout runs the micro-batches one process runs."""
    group = global_batch // grad_accum
    out = {}
    for layout in layouts:
        if global_batch % grad_accum or group % layout.dp:
            raise ValueError(f"train.global_batch_size ({global_batch}) must split into {grad_accum} micro-batch "
                             f"steps of sequences divisible by layout {layout.name}'s dp ({layout.dp})")
        out[layout] = group // layout.dp
    return out
