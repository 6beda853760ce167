"""The parallel layouts ``moetrain verify`` runs: parsed from ``--layouts "ep=2,dp=2; pp=2,ep=2"``
or chosen from the job (``auto``), each checked against the layout rules before any process starts.

A layout names degrees: ``dp``, ``ep``, ``tp``, ``pp``, ``etp`` and ``zero`` (the ZeRO stage). The
processes are dp * tp * pp; dp defaults to the smallest that holds ep * etp expert ranks folded over
the dp * tp ranks of a stage (``ep=2`` alone is 2 processes, ``pp=2,ep=2`` is 4).
"""

from __future__ import annotations

from dataclasses import dataclass

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
        if not sep or key not in KEYS or not value.strip().isdigit():
            raise ValueError(f"--layouts ({text!r}): {part!r} must be KEY=N with KEY one of {', '.join(KEYS)}")
        values[key] = int(value)
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


def auto_layouts(cfg: JobConfig) -> list[Layout]:
    """The job's own layout folded down to at most ``MAX_PROCESSES`` processes (each degree capped
    at 2), then the other ZeRO family: ZeRO-3 beside a ZeRO 0-2 job, plain data parallelism beside a
    ZeRO-3 one; at ep = 2 for an MoE job."""
    par = cfg.parallel
    moe = cfg.model.is_moe
    ep = min(par.ep, 2) if moe else 1
    own = Layout(ep=ep, tp=min(par.tp, 2), pp=min(par.pp, 2), etp=min(par.etp, 2) if moe else 1,
                 zero=par.zero_stage, dp=1)
    own = Layout(**{**own.__dict__, "dp": max(1, own.ep * own.etp // own.tp)})
    while own.world > MAX_PROCESSES:
        own = Layout(**{**own.__dict__, "tp": 1, "etp": 1, "dp": max(1, own.ep)})
    layouts = [own] if own.world > 1 else []
    other = Layout(ep=2 if moe else 1, dp=2, zero=0 if par.zero_stage == 3 else 3)
    if other not in layouts:
        layouts.append(other)
    return layouts


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
