"""`moetrain report RUN_DIR`: PNG plots from a run's metrics.jsonl."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: report runs on training nodes without a display
import matplotlib.pyplot as plt
import numpy as np
import torch

from moetrain.train.metrics import read_class_names, read_metrics
from moetrain.train.routing_trace_read import INDEX, TRACE_DIR, rank_loads, straggler_factors

log = logging.getLogger("moetrain")


def _series(records: list[dict], key: str) -> tuple[list[int], list]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _step_edges(steps: list[int]) -> np.ndarray:
    """Column edges of a step heat map: each column centred on its step, spanning half the spacing to
    each neighbour (one step: width 1), so uneven or single log steps still line up with the axis."""
    s = np.asarray(steps, dtype=float)
    if len(s) == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[1:] + s[:-1]) / 2
    return np.concatenate([[s[0] - (mid[0] - s[0])], mid, [s[-1] + (s[-1] - mid[-1])]])


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(records, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    s, v = _series(records, "loss")
    ax.plot(s, v, label="train loss", lw=1.2)
    s, v = _series(records, "val_loss")
    if s:
        ax.plot(s, v, "o-", label="val loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "loss.png")


def plot_throughput(records, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    s, v = _series(records, "tokens_per_s")
    ax.plot(s, v, lw=1.2, color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s (all ranks)")
    ax.set_title("Throughput")
    ax.grid(alpha=0.3)
    return _save(fig, out / "throughput.png")


def plot_expert_load(records, out: Path) -> Path | None:
    """One heatmap per MoE layer: expert (rows) x log step (columns), colour = share of the
    layer's routed copies. Uniform routing is 1/E everywhere; a bright row is a hot expert.

    Expert-health marks (when the run logged them): a cyan x where an expert counted as unused
    (no token for moe.unused_expert_steps steps), a red triangle above a layer at each log step
    whose window raised a routing-collapse alarm."""
    steps, shares = _series(records, "expert_share")
    if not steps:
        return None
    arr = np.asarray(shares, dtype=float)  # [steps, layers, experts]
    num_layers, num_experts = arr.shape[1], arr.shape[2]
    fig, axes = plt.subplots(num_layers, 1, figsize=(8, 1.2 + 1.6 * num_layers), squeeze=False, sharex=True)
    vmax = max(2.0 / num_experts, float(arr.max()))
    unused = {r["step"]: r["unused_experts"] for r in records if r.get("unused_experts") is not None}
    alarms = {r["step"]: r["routing_collapse_alarms"] for r in records if r.get("routing_collapse_alarms")}
    for i in range(num_layers):
        ax = axes[i][0]
        im = ax.pcolormesh(_step_edges(steps), np.arange(num_experts + 1) - 0.5, arr[:, i, :].T, cmap="magma",
                           vmin=0.0, vmax=vmax)
        ax.set_ylim(num_experts - 0.5, -0.5)  # expert 0 on top
        pts = [(s, e) for s, per_layer in unused.items() for e in per_layer[i]]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker="x", s=14, color="cyan", label="unused")
        hits = [s for s, per_layer in alarms.items() if per_layer[i] > 0]
        if hits:
            ax.scatter(hits, [-0.5] * len(hits), marker="v", s=30, color="red", clip_on=False, label="collapse alarm")
        if pts or hits:
            ax.legend(fontsize=7, loc="upper right")
        ax.set_ylabel(f"MoE layer {i}\nexpert")
        fig.colorbar(im, ax=ax, label="share")
    axes[-1][0].set_xlabel("step")
    fig.suptitle(f"Expert load (uniform = {1 / num_experts:.3f})")
    return _save(fig, out / "expert_load.png")


HEALTH_PANELS = (("load_cv", "load CV (std / mean)"), ("load_max_over_mean", "max / mean load"),
                 ("max_token_fraction", "largest expert's token fraction"),
                 ("routing_entropy", "routing entropy (nats / token)"))


def plot_expert_health(records, out: Path) -> Path | None:
    """Per-layer expert-health series (logged by moetrain.train.balancing): load imbalance, the
    hottest expert's token fraction and the router's entropy."""
    panels = [(key, label) for key, label in HEALTH_PANELS if _series(records, key)[0]]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), squeeze=False, sharex=True)
    for ax, (key, label) in zip(axes[:, 0], panels, strict=True):
        s, v = _series(records, key)
        arr = np.asarray(v, dtype=float).reshape(len(s), -1)
        for i in range(arr.shape[1]):
            ax.plot(s, arr[:, i], lw=1.0, label=f"layer {i}")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=4)
    axes[-1][0].set_xlabel("step")
    fig.suptitle("Expert health")
    return _save(fig, out / "expert_health.png")


def plot_dropped(records, out: Path) -> Path | None:
    s, v = _series(records, "dropped_fraction")
    if not s:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    arr = np.asarray(v, dtype=float).reshape(len(s), -1)
    for i in range(arr.shape[1]):
        ax.plot(s, arr[:, i], lw=1.0, label=f"layer {i}")
    ax.set_xlabel("step")
    ax.set_ylabel("dropped token copies (fraction)")
    ax.set_title("Capacity drops" + (" (dropless run: all zero)" if not arr.any() else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / "dropped.png")


def plot_accuracy(records, out: Path) -> Path | None:
    """A classifier's validation accuracy and macro-F1 per evaluation (and the final test figures)."""
    s, v = _series(records, "val_accuracy")
    if not s:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(s, v, "o-", label="val accuracy", lw=1.5)
    ax.plot(*_series(records, "val_macro_f1"), "s--", label="val macro-F1", lw=1.0)
    for key, marker in (("test_accuracy", "*"), ("test_macro_f1", "P")):
        ts, tv = _series(records, key)
        if ts:
            ax.plot(ts, tv, marker, ms=11, label=f"{key.replace('_', ' ')} {tv[-1]:.4f}")
    ax.set_xlabel("step")
    ax.set_title("Classification")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "accuracy.png")


def plot_confusion(records, out: Path, class_names: list[str] | None) -> Path | None:
    """The last evaluation's confusion matrix (the test split's when the run evaluated it): rows the
    true class, columns the prediction, colour the row's share (recall), cells the counts."""
    key = next((k for k in ("test_confusion", "val_confusion") if _series(records, k)[0]), None)
    if key is None:
        return None
    steps, matrices = _series(records, key)
    counts = np.asarray(matrices[-1], dtype=np.int64)
    num_classes = counts.shape[0]
    names = class_names if class_names and len(class_names) == num_classes else [str(i) for i in range(num_classes)]
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    size = 2.5 + 0.45 * num_classes
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    im = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    if num_classes <= 25:  # beyond that the numbers no longer fit in their cells
        for i in range(num_classes):
            for j in range(num_classes):
                ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if share[i, j] > 0.5 else "black")
    ax.set_xticks(range(num_classes), names, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(num_classes), names, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = np.trace(counts) / max(counts.sum(), 1)
    ax.set_title(f"{key.split('_')[0]} confusion, step {steps[-1]} (accuracy {accuracy:.4f})")
    fig.colorbar(im, ax=ax, label="share of the true class")
    return _save(fig, out / "confusion.png")


def plot_rank_load(run_dir: Path, out: Path) -> list[Path]:
    """The per-rank expert load of a run and ``routing_straggler.json``.

    From the routing trace (log.routing_trace): one heat map per MoE layer, expert-parallel rank
    (rows; each ep group's ranks in turn when there are several) x recorded step (columns), colour =
    the rank's received copies / its group's mean rank's (1 = balanced; a bright row is a straggler),
    with the experts counted on their home ranks; and in the JSON (``steps``, ``layers``): per layer,
    the straggler factor (max rank tokens / mean, the worst ep group's) at each recorded step, its mean
    and its max, and each group's factors (``groups``, [step][group], null for a group the step's
    layout lacks).

    A rebalanced run (``rebalance.jsonl`` in the run folder) is served by replicas too, so the home
    layout is not what its ranks received: ``rank_load.png`` then shows the copies each rank's slots
    received (the records' ``rank_copies``), the trace's figure becomes ``rank_load_home.png``
    ("home layout (before replicas)"), and the JSON adds ``replicas`` (:func:`_replica_summary`).
    ``rebalanced`` says which; ``steps`` and ``layers`` stay the trace's home layout."""
    rebal = _replica_loads(run_dir)
    made: list[Path] = []
    summary: dict = {}
    if (run_dir / TRACE_DIR / INDEX).is_file():
        steps, layers, load_SLGP = rank_loads(run_dir)
        if steps:
            factor_SL, factor_SLG = straggler_factors(load_SLGP), straggler_factors(load_SLGP, per_group=True)
            per_layer = {name: {"straggler_factor": _rounded(factor_SL[:, i].tolist()),
                                **_factor_stats(factor_SL[:, i]), "groups": _rounded(factor_SLG[:, i].tolist())}
                         for i, name in enumerate(layers)}
            summary = {"steps": steps, "layers": per_layer}
            name, title = ("rank_load_home.png", "home layout (before replicas)") if rebal else \
                ("rank_load.png", "routing trace")
            captions = [f"straggler factor mean {_fmt(per_layer[n]['mean'])}, max {_fmt(per_layer[n]['max'])}"
                        for n in layers]
            made.append(_rank_heat_map(steps, layers, load_SLGP, captions, out / name,
                                       f"Per-rank expert load, {title}"))
    if rebal is not None:
        steps, load_SLP, first_plan = rebal
        layers = list(summary.get("layers", {}))  # the trace's names, when it has as many layers
        if len(layers) != load_SLP.shape[1]:
            layers = [f"layer {i}" for i in range(load_SLP.shape[1])]
        summary["replicas"] = _replica_summary(steps, layers, load_SLP, first_plan)
        captions = [_replica_caption(summary["replicas"]["layers"][n]) for n in layers]
        made.insert(0, _rank_heat_map(steps, layers, load_SLP[:, :, None, :], captions, out / "rank_load.png",
                                      "Per-rank expert load with replicas (rebalance.jsonl: copies each rank's "
                                      "slots received)", first_plan=first_plan))
    if not summary:
        return []
    summary["rebalanced"] = rebal is not None
    json_path = out / "routing_straggler.json"
    json_path.write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    return [*made, json_path]


def _replica_loads(run_dir: Path) -> tuple[list[int], torch.Tensor, int | None] | None:
    """``(steps, load_SLP, first_plan)`` of a rebalanced run's ``rebalance.jsonl``: the copies each
    rank of rank 0's ep group received per layer at each step (after capacity drops, homes and
    replicas together), and the step of the first re-plan (None: none yet). None without records."""
    path = run_dir / "rebalance.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("rank_copies")]
    if not records:
        return None
    # A resume at another ep writes records of another width: the last layout's steps (from the
    # resume on, when it restarted from the home layout) are the ones shown.
    width = len(records[-1]["rank_copies"][0])
    start = max((i + 1 for i, r in enumerate(records) if len(r["rank_copies"][0]) != width), default=0)
    if start:
        log.warning("%s: steps %d-%d ran at another ep; the replica load figure shows steps %d-%d only",
                    path, records[0]["step"], records[start - 1]["step"], records[start]["step"], records[-1]["step"])
        records = records[start:]
    load_SLP = torch.tensor([r["rank_copies"] for r in records], dtype=torch.float64)
    first_plan = next((r["step"] for r in records if r.get("rebalanced")), None)
    return [r["step"] for r in records], load_SLP, first_plan


def _replica_summary(steps: list[int], layers: list[str], load_SLP: torch.Tensor, first_plan: int | None) -> dict:
    """``routing_straggler.json``'s ``replicas``: per layer the straggler factor of what each rank
    received at each step of rebalance.jsonl, its mean and max over all steps (``all_steps``), over
    the steps that ran the home layout (``before_first_plan``: up to the first re-plan's) and over
    those that ran with replicas (``after_first_plan``; null without a plan)."""
    factor_SL = straggler_factors(load_SLP)
    after = torch.tensor([first_plan is not None and s > first_plan for s in steps], dtype=torch.bool)
    per_layer = {name: {"straggler_factor": _rounded(factor_SL[:, i].tolist()),
                        "all_steps": _factor_stats(factor_SL[:, i]),
                        "before_first_plan": _factor_stats(factor_SL[~after, i]),
                        "after_first_plan": _factor_stats(factor_SL[after, i])}
                 for i, name in enumerate(layers)}
    return {"source": "rebalance.jsonl rank_copies", "steps": steps, "first_plan_step": first_plan,
            "layers": per_layer}


def _factor_stats(factor_S: torch.Tensor) -> dict:
    """Mean and max of a layer's straggler factors (NaN steps left out; null when there are none)."""
    present = factor_S[~factor_S.isnan()]
    if present.numel() == 0:
        return {"mean": None, "max": None}
    return {"mean": _rounded(float(present.mean())), "max": _rounded(float(present.max()))}


def _rank_heat_map(steps: list[int], layers: list[str], load_SLGP: torch.Tensor, captions: list[str], path: Path,
                   title: str, *, first_plan: int | None = None) -> Path:
    """One heat map per layer: rank (rows, ep groups in turn) x step, colour = load / group mean;
    a dashed line after the first re-plan's step (the steps right of it ran with replicas)."""
    num_steps, _, num_groups, ep = load_SLGP.shape
    mean_SLG1 = load_SLGP.nanmean(-1, keepdim=True).clamp(min=1e-12)
    rel_SLR = (load_SLGP / mean_SLG1).reshape(num_steps, len(layers), num_groups * ep).numpy()
    vmax = max(2.0, float(np.nanmax(rel_SLR)) if not np.isnan(rel_SLR).all() else 0.0)
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 1.2 + 1.4 * len(layers)), squeeze=False, sharex=True)
    for i, name in enumerate(layers):
        ax = axes[i][0]
        im = ax.pcolormesh(_step_edges(steps), np.arange(num_groups * ep + 1) - 0.5,
                           np.ma.masked_invalid(rel_SLR[:, i, :].T), cmap="magma", vmin=0.0, vmax=vmax)
        ax.set_ylim(num_groups * ep - 0.5, -0.5)
        ax.set_ylabel(f"{name}\n" + ("ep rank" if num_groups == 1 else f"ep group x rank ({ep} each)"))
        ax.set_yticks(range(num_groups * ep))
        ax.set_title(captions[i], fontsize=8)
        if first_plan is not None:
            ax.axvline(first_plan + 0.5, color="cyan", ls="--", lw=1.0, label=f"first plan (after step {first_plan})")
            ax.legend(fontsize=7, loc="upper right")
        fig.colorbar(im, ax=ax, label="load / group mean")
    axes[-1][0].set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _replica_caption(stats: dict) -> str:
    before, after = stats["before_first_plan"], stats["after_first_plan"]
    text = f"straggler factor before the first plan: mean {_fmt(before['mean'])}"
    return text + (f"; after it: mean {_fmt(after['mean'])}, max {_fmt(after['max'])}" if after["mean"] is not None
                   else "; no plan yet")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _rounded(value):
    """``value`` (a float or nested lists of them) rounded, NaN as None: routing_straggler.json is JSON."""
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return round(value, 5) if math.isfinite(value) else None


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    made = [plot_loss(records, out), plot_throughput(records, out), plot_expert_load(records, out),
            plot_expert_health(records, out), plot_dropped(records, out), plot_accuracy(records, out),
            plot_confusion(records, out, read_class_names(run_dir))]
    return [p for p in made if p is not None] + plot_rank_load(Path(run_dir), out)
