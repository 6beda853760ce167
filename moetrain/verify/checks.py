"""What ``moetrain verify`` compares and how close counts as equal (docs/verify.md explains each
bound).

A value ``x`` of a layout passes against the single-process value ``r`` when
``|x - r| <= abs + rel * |r|`` element by element. The bounds, by quantity:

    routing counts, drops        exact: an integer per expert; a token changing expert is a layout
                                 bug unless a router score tie flipped, which fp32 makes rare and
                                 bf16 routers avoid (the router runs in fp32)
    loss, aux terms, lr          rel = ULP-scaled in fp32, measured in bf16 and fp8 (``Precision``): the
                                 same sums in another order
    grad norm                    rel = 4x the loss bound in fp32: a sum of squares over every gradient
    parameters                   abs = lr * steps * parameter bound: Adam moves each weight by about
                                 lr per step, its direction set by m/sqrt(v); rounding noise changes
                                 that direction only where the gradient is itself at rounding level
    optimizer moments            rel to the tensor's largest entry: moments of near-zero gradients
                                 carry the gradient's rounding noise

A quantity missing from one side (a tensor the layout did not save) always fails.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from moetrain.config.job import JobConfig

UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
"""Unit roundoff of each compute dtype: half the gap between 1 and the next representable number."""

FP8_UNIT_ROUNDOFF = 2.0 ** -4
"""e4m3's unit roundoff (3 mantissa bits): the dispatch payload's rounding with moe.dispatch_dtype fp8."""


MEASURED = {
    "bf16": {"scalar": 1e-3, "aux": 1e-3, "grad_norm": 1e-2, "moments": 0.2, "routing": 0.01},
    "fp8": {"scalar": 1e-3, "aux": 1e-2, "grad_norm": 1e-2, "moments": 0.6, "routing": 0.15},
}
"""Bounds of a bf16 step (or bf16 dispatch) and of an fp8 dispatch, set from clean runs of the
shipped configs (docs/verify.md, "Why these tolerances", has the measured figures): relative for
the loss and multi-token losses (``scalar``), the aux loss, the grad norm, the moments (of each
tensor's largest entry); ``routing``: the share of a layer's routed copies whose expert may change.
The world-1 reference does not quantize its dispatch (no exchange), so an fp8 layout differs from it
by the whole e4m3 rounding of the expert inputs, not by a reduction order."""


@dataclass(frozen=True)
class Precision:
    """The rounding a job's step carries: its compute dtype and its dispatch payload dtype. fp32
    bounds are ``growth * u`` (u the unit roundoff; sums over up to a few thousand terms in another
    order: sqrt(n) * u for the typical case, with a factor of 100 headroom for the steps after the
    first, whose inputs already differ by that much); bf16 and an fp8 dispatch use ``MEASURED``;
    fp16 (not measured) 5 u."""

    dtype: str
    dispatch_dtype: str = "none"

    @property
    def u(self) -> float:
        u = UNIT_ROUNDOFF.get(self.dtype, UNIT_ROUNDOFF["fp32"])
        if self.fp8:
            u = max(u, FP8_UNIT_ROUNDOFF)
        elif self.dispatch_dtype == "bf16":
            u = max(u, UNIT_ROUNDOFF["bf16"])
        return u

    @property
    def fp8(self) -> bool:
        return self.dispatch_dtype.startswith("fp8")  # moe.dispatch_dtype names the format: fp8_e4m3

    @property
    def low_precision(self) -> bool:
        return self.u > UNIT_ROUNDOFF["fp32"]

    def _measured(self) -> dict[str, float] | None:
        if self.fp8:
            return MEASURED["fp8"]
        return MEASURED["bf16"] if self.u == UNIT_ROUNDOFF["bf16"] else None

    def bound(self, kind: str) -> float:
        """``kind``: scalar (loss, multi-token losses), aux, grad_norm, moments or routing."""
        measured = self._measured()
        if measured is not None:
            return measured[kind]
        scalar = self.u * (5.0 if self.low_precision else 1e3)  # fp16 5 u; fp32 6e-5
        return {"scalar": scalar, "aux": scalar, "grad_norm": 4 * scalar, "moments": 10 * scalar,
                "routing": 0.01}[kind]

    def scalar_rel(self) -> float:
        """The loss's bound: fp32 1000 u = 6e-5; bf16 and fp8 dispatch 1e-3 (``MEASURED``)."""
        return self.bound("scalar")


@dataclass(frozen=True)
class Tolerance:
    abs: float
    rel: float
    why: str

    def text(self) -> str:
        if self.abs == 0 and self.rel == 0:
            return "exact"
        parts = ([f"abs {self.abs:.1e}"] if self.abs else []) + ([f"rel {self.rel:.1e}"] if self.rel else [])
        return " + ".join(parts)


EXACT = Tolerance(0.0, 0.0, "integer counts: a routing difference is a layout bug")


@dataclass
class Result:
    """One quantity over every step it was compared at: the worst differences, and the first step
    (and check) at which it left its tolerance."""

    quantity: str
    max_abs: float
    max_rel: float
    tolerance: Tolerance
    ok: bool
    note: str = ""
    num_values: int = 0
    first_bad: tuple[int, int] | None = None
    """(step, order of the check) of the first failure; the earliest over all quantities is named."""

    def row(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "first_bad"}
        out["tolerance"] = self.tolerance.text()
        out["why"] = self.tolerance.why
        out["first_failing_step"] = None if self.first_bad is None else self.first_bad[0]
        return out


@dataclass
class Comparison:
    """The results by quantity, in the order first checked; a quantity checked at several steps is
    one row. The failure named last is the one at the earliest step (then the earliest check)."""

    results: list[Result] = field(default_factory=list)
    _order: int = 0
    _loose_worst: dict[str, float] = field(default_factory=dict)
    """By quantity: the largest diff / max |want| of ``scaled``'s loosened rows over every step."""

    def values(self, quantity: str, got, want, tol: Tolerance, *, step: int = 0,
               abs_bounds: torch.Tensor | None = None) -> Result:
        """Compare ``got`` with ``want`` (numbers, nested lists or tensors of one size).
        ``abs_bounds``: a bound per element (flattened) in place of ``tol.abs``."""
        g = torch.as_tensor(got, dtype=torch.float64).detach().double().flatten()
        w = torch.as_tensor(want, dtype=torch.float64).detach().double().flatten()
        if g.shape != w.shape:
            return self.missing(quantity, f"{g.numel()} values against {w.numel()}", tol, step=step)
        if g.numel() == 0:
            return self._add(quantity, 0.0, 0.0, tol, True, step=step)
        both_nan = torch.isnan(g) & torch.isnan(w)
        diff = torch.where(both_nan, torch.zeros_like(g), (g - w).abs())
        # A difference from an exact zero is infinitely relative (shown "inf"); none at all is 0.
        rel = torch.where(w == 0, torch.where(diff > 0, math.inf, 0.0), diff / w.abs().clamp(min=1e-300))
        bound = tol.abs if abs_bounds is None else abs_bounds.double().flatten()
        ok = not bool((torch.isnan(g) != torch.isnan(w)).any()) and bool((diff <= bound + tol.rel * w.abs()).all())
        return self._add(quantity, _finite(diff.max()), _finite(rel.max()), tol, ok, step=step, num=g.numel())

    def scaled(self, quantity: str, pairs: list[tuple[torch.Tensor, torch.Tensor]], tol: Tolerance, *,
               step: int = 0, rows: list[torch.Tensor | None] | None = None, rows_why: str = "") -> Result:
        """Tensors compared relative to each one's largest entry (``tol.rel`` of it): max abs diff
        over all, and max of diff / max |want| per tensor. ``rows``: per pair, None or an absolute
        bound per leading-dim row; rows whose bound exceeds the tensor's plain one (flipped experts,
        moetrain/verify/flips.py) are held to it, are left out of the max rel shown, and are counted
        in the note with their largest diff / max |want| (``rows_why`` says why they are looser)."""
        worst_abs, worst_rel, ok = 0.0, 0.0, True
        num_loose, worst_loose = 0, 0.0
        for i, (got, want) in enumerate(pairs):
            if want.numel() == 0:
                continue
            diff = (got.double() - want.double()).abs()
            scale = want.double().abs().max().clamp(min=1e-30)
            worst_abs = max(worst_abs, _finite(diff.max()))
            bound_E = rows[i] if rows is not None else None
            if bound_E is None:
                rel = _finite(diff.max() / scale)
                ok = ok and rel <= tol.rel
            else:
                diff_E = diff.flatten(1).amax(dim=1) if diff.dim() > 1 else diff
                loose_E = bound_E > tol.rel * scale
                plain_E = diff_E[~loose_E]
                rel = _finite(plain_E.max() / scale) if plain_E.numel() else 0.0
                ok = ok and rel <= tol.rel and bool((diff_E[loose_E] <= bound_E[loose_E]).all())
                if bool(loose_E.any()):
                    num_loose += int(loose_E.sum())
                    worst_loose = max(worst_loose, _finite(diff_E[loose_E].max() / scale))
            worst_rel = max(worst_rel, rel)
        r = self._add(quantity, worst_abs, worst_rel, tol, ok, step=step, num=sum(w.numel() for _, w in pairs))
        if num_loose:
            worst_loose = self._loose_worst[quantity] = max(self._loose_worst.get(quantity, 0.0), worst_loose)
        if num_loose and (r.ok or (r.first_bad is not None and r.first_bad[0] == step)):
            # the latest passing step's count (the flipped experts only accumulate), else the failing one's
            note = (f"{num_loose} expert rows loosened: {rows_why}; their largest diff {worst_loose:.3g} of "
                    "the tensor's max")
            r.note = note if r.ok else f"step {step}: {note}"
        return r

    def missing(self, quantity: str, note: str, tol: Tolerance = EXACT, *, step: int = 0) -> Result:
        return self._add(quantity, math.inf, math.inf, tol, False, step=step, note=note)

    def note(self, quantity: str, note: str) -> Result:
        """A check that could not run here (not a failure): shown with its reason."""
        return self._add(quantity, 0.0, 0.0, Tolerance(0.0, 0.0, note), True, note=f"skipped: {note}")

    def _add(self, quantity: str, max_abs: float, max_rel: float, tol: Tolerance, ok: bool, *, step: int = 0,
             num: int = 0, note: str = "") -> Result:
        self._order += 1
        r = next((r for r in self.results if r.quantity == quantity), None)
        if r is None:
            r = Result(quantity, 0.0, 0.0, tol, True)
            self.results.append(r)
        r.max_abs, r.max_rel = max(r.max_abs, max_abs), max(r.max_rel, max_rel)
        if r.ok:  # the bound shown: the failing step's, else the last (the loosest: bounds grow with steps)
            r.tolerance = tol
        r.num_values += num
        if note and not r.note:
            r.note = note if ok else f"step {step}: {note}"
        if not ok and r.ok:
            r.ok, r.first_bad = False, (step, self._order)
        return r

    @property
    def first_failure(self) -> Result | None:
        bad = [r for r in self.results if not r.ok]
        return min(bad, key=lambda r: r.first_bad or (0, 0)) if bad else None


def _finite(t: torch.Tensor) -> float:
    v = float(t)
    return v if math.isfinite(v) else math.inf


def routed_counts(cfg: JobConfig) -> dict[str, list[int]]:
    """By per-layer key of metrics.jsonl, the count each MoE layer's value is a share of in one
    step's record (verify logs every step), in the logged layer order: the MoE blocks of
    ``model.num_layers`` by index (dense blocks log no row), then multi-token depths 1..D, whose
    blocks are MoE blocks in an MoE model (models/transformer.py).

    ``expert_share``: routed copies, B * S * K in a main layer, B * (S - k) * K at depth k, which
    routes only the S - k positions with a token k places ahead (models/mtp.py; with keep_length
    too, its token mask, and tensor parallelism refuses a capacity factor that would route the
    padding). ``dropped_fraction``: the same copies; expert choice: tokens (B * S, B * (S - k)),
    which no expert took. Expert choice's shares are 1/E in every layer, whatever the total.
    B is the global batch: the counts are summed over the micro-batches and ranks. A classifier
    does not route its padding, so its counts fall below these (not modelled: they vary by batch)."""
    B, S, m = cfg.train.global_batch_size, cfg.data.seq_len, cfg.model
    positions_L = [S] * len(m.moe_layer_ids) + ([S - k for k in range(1, m.mtp_depth + 1)] if m.is_moe else [])
    copies_L = [B * p * cfg.moe.top_k for p in positions_L]
    return {"expert_share": copies_L,
            "dropped_fraction": [B * p for p in positions_L] if cfg.moe.is_expert_choice else copies_L}


def counts_from_shares(shares_L: list, routed_L: list[int]) -> torch.Tensor:
    """Counts from metrics.jsonl's per-layer shares, ``[L]`` or ``[L, E]`` (rounded to 5 digits
    there, exact again once multiplied by the layer's count ``routed_L[l]`` while it stays below
    50,000), as float64 ``[L]`` or ``[L, E]``."""
    shares = torch.tensor(shares_L, dtype=torch.float64)
    if shares.shape[0] != len(routed_L):
        raise ValueError(f"{shares.shape[0]} layers of shares against {len(routed_L)} layer counts")
    routed = torch.tensor(routed_L, dtype=torch.float64).reshape(-1, *[1] * (shares.dim() - 1))
    return (shares * routed).round()
