"""Run metrics: one JSON line per log step in ``metrics.jsonl``, the same scalars in TensorBoard and in
the experiment trackers that are on (``moetrain.train.trackers``).

Only rank 0 writes. Values must already be Python numbers (the trainer does its one host sync
per log step before calling ``log``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from moetrain.config.moe import MoEConfig
from moetrain.utils.files import jsonl_records_until

if TYPE_CHECKING:  # imported lazily at run time: only a logging rank with TensorBoard on needs it
    from torch.utils.tensorboard import SummaryWriter

    from moetrain.train.trackers import Tracker

log = logging.getLogger("moetrain")


def expert_load_summary(counts_LE: torch.Tensor) -> dict:
    """Per-layer load statistics from routed-copy counts [L layers, E experts].

    share: fraction of copies each expert got; cv: std/mean of the counts (0 = perfectly
    balanced); max_over_mean: the hottest expert's load relative to the mean (what sets the
    step time under expert parallelism).
    """
    counts_LE = counts_LE.double()
    mean_L = counts_LE.mean(dim=1).clamp(min=1e-12)
    share_LE = counts_LE / counts_LE.sum(dim=1, keepdim=True).clamp(min=1e-12)
    return {
        "expert_share": [[round(v, 5) for v in row] for row in share_LE.tolist()],
        "load_cv": [round(v, 5) for v in (counts_LE.std(dim=1, unbiased=False) / mean_L).tolist()],
        "load_max_over_mean": [round(v, 5) for v in (counts_LE.max(dim=1).values / mean_L).tolist()],
    }


@dataclass
class StepSums:
    """Device-side sums over the micro-steps of one optimizer step (adding them is no host sync).
    The expert-load counts are the balancer's (``moetrain.train.balancing``)."""

    loss: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    mtp: torch.Tensor | None = None
    """``[model.mtp_depth]`` each multi-token depth's loss (None without multi-token prediction)."""

    def add(self, name: str, value: torch.Tensor) -> None:
        cur = getattr(self, name)
        setattr(self, name, value.detach().clone() if cur is None else cur + value.detach())


@dataclass
class MetricsWindow(StepSums):
    """Sums over the good (not skipped) steps since the last log step; read once per log step
    (the host sync)."""

    steps: int = 0
    """Steps taken, skipped ones included (for the step time and throughput)."""
    skipped: int = 0
    tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def add_step(self, sums: StepSums | None, *, tokens: int) -> None:
        """Count an optimizer step of ``tokens`` tokens: taken, with its ``sums``, or skipped (None)."""
        self.steps += 1
        self.tokens += tokens
        if sums is None:
            self.skipped += 1
            return
        for name in ("loss", "aux", "mtp"):
            value = getattr(sums, name)
            if value is not None:
                self.add(name, value)

    def throughput(self, *, seq_len: int, num_ranks: int, flops_per_token: float,
                   peak_flops: float | None) -> dict:
        """Tokens and samples per second, the mean step time and the model-FLOPs utilisation of
        the window up to now (``peak_flops``: one rank's; None on a device of unknown peak: no MFU)."""
        dt = time.perf_counter() - self.t0
        tokens_per_s = self.tokens / dt
        mfu = None if peak_flops is None else tokens_per_s / num_ranks * flops_per_token / peak_flops
        return {"tokens_per_s": tokens_per_s, "samples_per_s": tokens_per_s / seq_len, "step_time_s": dt / self.steps,
                "mfu": mfu}


class ProgressBar:
    """The tqdm bar of the training steps, showing the last logged loss, tokens/s and validation
    loss (and a classifier's validation accuracy); does nothing when not ``enabled`` (on every rank
    but the main one)."""

    def __init__(self, *, enabled: bool, total: int, initial: int) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm  # lazy: only the main rank draws a bar

            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def show(self, metrics: dict) -> None:
        if self._bar is not None:
            postfix = {"loss": f"{metrics['loss']:.3f}", "tok_s": f"{metrics['tokens_per_s']:.0f}"}
            if "val_loss" in metrics:
                postfix["val"] = f"{metrics['val_loss']:.3f}"
            if "val_accuracy" in metrics:  # a classifier
                postfix["val_acc"] = f"{metrics['val_accuracy']:.4f}"
            self._bar.set_postfix(postfix)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_tags(moe: MoEConfig | None) -> dict:
    """Settings that make a run's throughput and losses incomparable with an ordinary run's, for
    every metrics record (``MetricsLogger(tags=...)``): ``force_balance`` (its mode) when
    ``moe.force_balance`` overrides the routing, ``force_skew`` (its spec) with ``moe.force_skew``.
    Empty for an ordinary run or a dense model."""
    tags = {}
    if moe is not None and moe.force_balance != "none":
        tags["force_balance"] = moe.force_balance
    if moe is not None and moe.force_skew != "none":
        tags["force_skew"] = moe.force_skew
    return tags


PER_EXPERT_KEYS = ("expert_share", "expert_bias", "expert_lr_scale")
"""Metrics that are [layer][expert] tables of numbers (TensorBoard histograms per layer). Other
nested lists (``unused_experts``: expert ids per layer) are kept in metrics.jsonl only; their
counts (``num_unused_experts``) go to TensorBoard as per-layer scalars."""

PER_CLASS_SUFFIX = "_per_class_f1"
"""A classifier's per-class lists (``val_per_class_f1``): one TensorBoard scalar per class. Its confusion
matrices (``val_confusion``, [true][predicted] counts) stay in metrics.jsonl; the report draws them."""


def read_class_names(run_dir: str | os.PathLike) -> list[str] | None:
    """The class names a classifier run wrote (``RUN/classes.json``; class id = index), or None."""
    try:
        names = json.loads((Path(run_dir) / "classes.json").read_text(encoding="utf-8"))["classes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None


def class_tags(names: list[str] | None, num_classes: int) -> list[str]:
    """The name of each class's per-class scalar (``val_per_class_f1/<tag>``): the class name with every
    character but letters, digits, "_", "." and "-" made "_" (TensorBoard's tag rule; a "/" would nest it).
    ``class<i>`` for every class without names for ``num_classes`` classes, or where two names would
    give the same tag."""
    fallback = [f"class{i}" for i in range(num_classes)]
    if names is None or len(names) != num_classes:
        return fallback
    tags = [re.sub(r"[^\w.\-]", "_", name) for name in names]
    return tags if len(set(tags)) == len(tags) and all(tags) else fallback


class ClassNames:
    """A run's class names for its per-class scalars, read from ``RUN/classes.json`` at the first record
    that has per-class values (the trainer writes the file before its first evaluation)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self._names: list[str] | None = None
        self._read = False

    def for_record(self, metrics: dict) -> list[str] | None:
        if not self._read and any(key.endswith(PER_CLASS_SUFFIX) for key in metrics):
            self._names, self._read = read_class_names(self.run_dir), True
        return self._names


class MetricsLogger:
    """Writes ``metrics.jsonl`` (and TensorBoard events) in ``run_dir``.

    ``keep_until_step``: a resumed run's file keeps the records of steps up to this one and
    drops those the stopped run wrote after it, so it reads like the file of a run that never
    stopped (TensorBoard's events likewise). None starts an empty file (and TensorBoard drops the
    events already in the folder). ``tags`` (``run_tags``) go into every record, after the
    step, so a benchmark-mode run cannot be mistaken for an ordinary one. ``report`` (log.report):
    whether ``close`` draws the report's PNGs for the trackers.
    """

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True,
                 keep_until_step: int | None = None, tags: dict | None = None,
                 trackers: Sequence[Tracker] = (), report: bool = True) -> None:
        self.enabled = enabled
        self.report = report
        self.tags = dict(tags or {})
        self.run_dir = Path(run_dir)
        self.trackers = list(trackers)
        self.class_names = ClassNames(run_dir)
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file: TextIO | None = None
        self._tb: SummaryWriter | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = jsonl_records_until(self.path, keep_until_step) if keep_until_step is not None else []
        # Open for the whole run (line-buffered, one record per step); close() closes it.
        self._file = open(self.path, "w", buffering=1)  # noqa: SIM115
        self._file.write("".join(kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard reads every event file of the folder: a START marker at this step makes it
            # drop the stopped run's events from here on, as metrics.jsonl drops its records.
            purge_step = 0 if keep_until_step is None else keep_until_step + 1
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: dict) -> None:
        for tracker in self.trackers:
            tracker.log(step, {**self.tags, **metrics})
        if not self.enabled:
            return
        record = {"step": step, **self.tags, **metrics}
        assert self._file is not None, "an enabled logger holds its file until close()"
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            names = self.class_names.for_record(metrics)
            for key, value in metrics.items():
                _tb_write(self._tb, key, value, step, names)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            if self.trackers:
                from moetrain.train.report import write_report  # the report reads this module's records

                files = [self.run_dir / "config.yaml", *(write_report(self.run_dir) if self.report else [])]
                for tracker in self.trackers:
                    tracker.log_files([f for f in files if f.exists()])
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _tb_write(tb: SummaryWriter, key: str, value, step: int, class_names: list[str] | None) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value):
            tb.add_scalar(key, value, step)
    elif key.endswith(PER_CLASS_SUFFIX) and isinstance(value, list):
        # A classifier's per-class F1 (None for a class neither present nor predicted).
        for tag, v in zip(class_tags(class_names, len(value)), value, strict=True):
            if v is not None:
                tb.add_scalar(f"{key}/{tag}", v, step)
    elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        # Per-layer lists (load_cv, dropped_fraction, ...) become one scalar per layer.
        for i, v in enumerate(value):
            tb.add_scalar(f"{key}/layer{i}", v, step)
    elif key in PER_EXPERT_KEYS and isinstance(value, list):
        # [layer][expert] values: one histogram over the experts per layer.
        for i, row in enumerate(value):
            tb.add_histogram(f"{key}/layer{i}", torch.tensor(row, dtype=torch.float64), step, bins=len(row))


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``RUN/metrics.jsonl``. A last line that is not a JSON object is a record cut short
    by a crash mid-write: it is left out with a warning. Any other bad line, or no file, is a ValueError
    naming the file (and the line)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: is {str(run_dir)!r} a moetrain run directory (log.run_dir)?")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    records = []
    for i, (line_no, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record = e.msg
        if isinstance(record, dict):
            records.append(record)
        elif i == len(lines) - 1:
            log.warning("%s:%d: left out a record cut short (the run stopped while writing it)", path, line_no)
        else:
            raise ValueError(f"{path}:{line_no}: not a JSON object (a metrics record): {line[:80]!r}")
    return records
