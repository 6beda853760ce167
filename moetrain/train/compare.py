"""`moetrain compare RUN_A RUN_B [...] [--out DIR]`: runs side by side, for routing A/B tests.

Reads each run's ``metrics.jsonl`` and ``config.yaml`` and writes into ``--out`` (default
``./compare``):

- one PNG per quantity of `QUANTITIES` that some run logged, every run a line over its steps
  (runs of any length; a run that never logged the quantity, such as a dense run's load CV or a run
  without evaluation, is left out of that plot and noted in the legend);
- ``summary.md``: the runs, a table of final figures (each quantity's last logged value per run,
  "-" where the run has none), the config fields that differ between the runs (dotted names, one
  column per run; ``log.run_dir`` left out, it always differs) and the plots;
- ``summary.json``: the same final figures and differences, unrounded, for scripts.

Quantities logged per MoE layer (load CV, max/mean load, dropped fraction) are averaged over the
layers, both in the plots and in the table.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: compare runs on training nodes without a display
import matplotlib.pyplot as plt
import yaml

from moetrain.train.metrics import read_metrics

MISSING = "-"
"""Table cell of a quantity or config field a run does not have."""

IGNORED_FIELDS = ("log.run_dir",)
"""Config fields left out of the differences: they differ between any two runs."""


@dataclass(frozen=True)
class Quantity:
    key: str
    """Key in metrics.jsonl."""
    label: str
    """Axis and table label."""
    marker: str = ""
    """Matplotlib marker: evaluations are sparse, drawn with points."""


QUANTITIES = (
    Quantity("loss", "train loss"),
    Quantity("val_loss", "val loss", "o"),
    Quantity("val_accuracy", "val accuracy", "o"),
    Quantity("val_macro_f1", "val macro-F1", "o"),
    Quantity("load_cv", "load CV (std / mean), mean over MoE layers"),
    Quantity("load_max_over_mean", "max / mean expert load, mean over MoE layers"),
    Quantity("dropped_fraction", "dropped token fraction, mean over MoE layers"),
    Quantity("tokens_per_s", "tokens / s"),
    Quantity("samples_per_s", "samples / s"),
)


@dataclass
class Run:
    name: str
    path: Path
    records: list[dict]
    config: dict | None
    """config.yaml as plain values, None when the run has none."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key``; per-layer lists averaged over the layers."""
        steps, values = [], []
        for r in self.records:
            value = r.get(key)
            if value is None or isinstance(value, bool):
                continue
            if isinstance(value, list):
                if not value or not all(isinstance(v, (int, float)) for v in value):
                    continue
                value = sum(value) / len(value)
            if isinstance(value, (int, float)):
                steps.append(r["step"])
                values.append(float(value))
        return steps, values

    def final(self, key: str) -> float | None:
        values = self.series(key)[1]
        return values[-1] if values else None

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.records if isinstance(r.get("step"), int)]
        return max(steps) if steps else None


def load_run(path: str | os.PathLike, name: str) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"run ({str(path)!r}) is not a folder: pass the run directories (log.run_dir) to compare")
    records = read_metrics(path)
    config_path = path / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
    return Run(name=name, path=path, records=records, config=config if isinstance(config, dict) else None)


def run_names(paths: list[str | os.PathLike]) -> list[str]:
    """Each run's folder name, or its path as given where two runs share a folder name."""
    names = [Path(p).resolve().name for p in paths]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths, strict=True)]


def flatten(config: dict, prefix: str = "") -> dict:
    """``{"moe": {"router": "softmax"}}`` -> ``{"moe.router": "softmax"}`` (lists stay values)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_differences(runs: list[Run]) -> dict[str, list]:
    """Dotted field -> value per run (`MISSING` where a run's config lacks it), for the fields
    whose values are not all equal; sorted by name."""
    flat = [flatten(r.config) if r.config is not None else {} for r in runs]
    fields = sorted(set().union(*flat) - set(IGNORED_FIELDS))
    out = {}
    for field in fields:
        values = [f.get(field, MISSING) for f in flat]
        if any(v != values[0] for v in values[1:]):
            out[field] = values
    return out


def format_value(value) -> str:
    """A table cell: numbers to 6 significant digits, YAML spellings for the rest, pipes escaped."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:.6g}" if math.isfinite(value) else str(value)
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, separators=(", ", ": "))
    else:
        text = str(value)
    return text.replace("|", "\\|")


def plot_quantity(runs: list[Run], quantity: Quantity, out: Path) -> Path | None:
    """One line per run over its steps; None when no run logged ``quantity``."""
    series = [(run, *run.series(quantity.key)) for run in runs]
    if not any(steps for _, steps, _ in series):
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, steps, values in series:
        if steps:
            ax.plot(steps, values, marker=quantity.marker or None, ms=4, lw=1.2, label=run.name)
        else:
            ax.plot([], [], lw=0, label=f"{run.name} (not logged)")
    ax.set_xlabel("step")
    ax.set_ylabel(quantity.key)
    ax.set_title(quantity.label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{quantity.key}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def summary_markdown(runs: list[Run], finals: dict[str, list], differences: dict[str, list],
                     plots: list[Path]) -> str:
    names = [format_value(r.name) for r in runs]
    lines = ["# Run comparison", "", "| run | folder | last step |", "|---|---|---|"]
    lines += [f"| {n} | {format_value(str(r.path))}{'' if r.config is not None else ' (no config.yaml)'} | "
              f"{format_value(r.last_step) if r.last_step is not None else MISSING} |"
              for n, r in zip(names, runs, strict=True)]
    labels = {q.key: q.label for q in QUANTITIES}
    lines += ["", "## Final figures", "",
              "Last logged value of each quantity; per-layer quantities are averaged over the MoE layers.", ""]
    lines += _table(["quantity", *names], [[f"{labels[key]} (`{key}`)",
                                            *(MISSING if v is None else format_value(v) for v in values)]
                                           for key, values in finals.items()])
    lines += ["", "## Config fields that differ", ""]
    if differences:
        lines += _table(["field", *names], [[f"`{field}`", *(MISSING if v is MISSING else format_value(v)
                                                            for v in values)]
                                            for field, values in differences.items()])
    else:
        lines.append(f"None (besides {', '.join(IGNORED_FIELDS)}).")
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _finite_or_null(value):
    """``value`` with NaN and infinities as None: summary.json is standard JSON (metrics.jsonl keeps
    Python's NaN, which strict parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def compare_runs(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike = "compare") -> list[Path]:
    """Write the plots, summary.md and summary.json of ``run_dirs`` into ``out_dir``; returns the
    files written (summary.md first)."""
    if len(run_dirs) < 2:
        raise ValueError(f"compare needs at least two runs, got {len(run_dirs)}: {[str(p) for p in run_dirs]}")
    runs = [load_run(p, name) for p, name in zip(run_dirs, run_names(run_dirs), strict=True)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = [p for p in (plot_quantity(runs, q, out) for q in QUANTITIES) if p is not None]
    finals = {q.key: [r.final(q.key) for r in runs] for q in QUANTITIES
              if any(r.final(q.key) is not None for r in runs)}
    differences = config_differences(runs)
    md = out / "summary.md"
    md.write_text(summary_markdown(runs, finals, differences, plots), encoding="utf-8")
    summary = {"runs": [{"name": r.name, "path": str(r.path), "last_step": r.last_step} for r in runs],
               "final": finals, "config_differences": differences}
    js = out / "summary.json"
    js.write_text(json.dumps(_finite_or_null(summary), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return [md, js, *plots]
