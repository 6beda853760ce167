"""Run metrics: one JSON line per log step in ``metrics.jsonl``, the same scalars in TensorBoard.

Only rank 0 writes. Values must already be Python numbers (the trainer does its one host sync
per log step before calling ``log``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch


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


PER_EXPERT_KEYS = ("expert_share", "expert_bias", "expert_lr_scale")
"""Metrics that are [layer][expert] tables of numbers (TensorBoard histograms per layer). Other
nested lists (``unused_experts``: expert ids per layer) are kept in metrics.jsonl only; their
counts (``num_unused_experts``) go to TensorBoard as per-layer scalars."""


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Open for the whole run (line-buffered, one record per step); close() closes it.
        self._file = open(self.path, "w", buffering=1)  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb_write(key, value, step)

    def _tb_write(self, key: str, value, step: int) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            # Per-layer lists (load_cv, dropped_fraction, ...) become one scalar per layer.
            for i, v in enumerate(value):
                self._tb.add_scalar(f"{key}/layer{i}", v, step)
        elif key in PER_EXPERT_KEYS and isinstance(value, list):
            # [layer][expert] values: one histogram over the experts per layer.
            for i, row in enumerate(value):
                self._tb.add_histogram(f"{key}/layer{i}", torch.tensor(row, dtype=torch.float64),
                                       step, bins=len(row))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a moetrain run directory?")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
