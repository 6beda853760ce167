"""The outcome of ``moetrain verify``: a table (quantity | max abs diff | max rel diff | tolerance |
PASS/FAIL), the same as JSON, and a last line that names the first failing quantity."""

from __future__ import annotations

import json
import math
from pathlib import Path

from moetrain.verify.checks import Comparison, Result
from moetrain.verify.shrink import Change


def _num(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.3e}"


def _status(r: Result) -> str:
    if r.note.startswith("skipped"):
        return "SKIP"
    return "PASS" if r.ok else "FAIL"


def table(comparison: Comparison) -> str:
    rows = [("quantity", "max abs diff", "max rel diff", "tolerance", "PASS/FAIL")]
    for r in comparison.results:
        rows.append((r.quantity, _num(r.max_abs), _num(r.max_rel), r.tolerance.text(), _status(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    notes = [f"  {r.quantity}: {r.note}" for r in comparison.results if r.note]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def last_line(comparison: Comparison) -> str:
    bad = comparison.first_failure
    if bad is None:
        checked = sum(1 for r in comparison.results if _status(r) == "PASS")
        return f"verify: PASS ({checked} quantities within tolerance)"
    num_bad = sum(1 for r in comparison.results if not r.ok)
    detail = f" ({bad.note})" if bad.note else f" (max abs diff {_num(bad.max_abs)}, tolerance {bad.tolerance.text()})"
    at = f" at step {bad.first_bad[0]}" if bad.first_bad is not None else ""
    return f"verify: FAIL: {bad.quantity}{at}{detail}; {num_bad} quantities failed"


def write_json(path: str | Path, comparison: Comparison, *, changes: list[Change], layouts: list[str],
               excluded: dict[str, str], steps: int) -> None:
    doc = {"passed": comparison.first_failure is None, "steps": steps, "layouts": layouts,
           "shrink": [{"field": c.field, "old": c.old, "new": c.new, "why": c.why} for c in changes],
           "excluded": excluded,
           "results": [{**r.row(), "status": _status(r),
                        "max_abs": None if math.isinf(r.max_abs) else r.max_abs,
                        "max_rel": None if math.isinf(r.max_rel) else r.max_rel} for r in comparison.results]}
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
