"""Experiment trackers beside metrics.jsonl: Weights & Biases (``log.wandb``) and MLflow (``log.mlflow``).

Rank 0 logs what it writes to metrics.jsonl, flattened the way TensorBoard gets it (``scalars``), and the
per-expert tables (``expert_share``, ...) as tables of (layer, expert, value) rows. Each tracker keeps its
run id in the run folder, so a resumed run continues the same tracker run; a tracker ignores the records
a resumed run writes again for steps it already had. The packages are imported only when a tracker is on.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from moetrain.config.log import LogConfig, MlflowConfig, WandbConfig
from moetrain.train.metrics import PER_CLASS_SUFFIX, PER_EXPERT_KEYS, ClassNames, class_tags


def scalars(metrics: dict, class_names: list[str] | None = None) -> dict[str, float]:
    """The finite numbers of a metrics record, per-layer lists as ``key/layer<i>`` and per-class lists as
    ``key/<class name>`` (``metrics.class_tags``; ``key/class<i>`` without ``class_names``); tables,
    strings, flags and non-finite values left out."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[key] = float(value)
        elif key.endswith(PER_CLASS_SUFFIX) and isinstance(value, list):
            tags = class_tags(class_names, len(value))
            out.update({f"{key}/{tag}": float(v) for tag, v in zip(tags, value, strict=True) if v is not None})
        elif isinstance(value, list) and value and all(_is_number(v) for v in value):
            out.update({f"{key}/layer{i}": float(v) for i, v in enumerate(value) if math.isfinite(v)})
    return out


def expert_rows(values_LE: list[list[float]]) -> list[list[float]]:
    """A [layer][expert] table as (layer, expert, value) rows."""
    return [[layer, expert, float(v)] for layer, row in enumerate(values_LE) for expert, v in enumerate(row)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _run_id(path: Path, new_id) -> tuple[str, bool]:
    """The id kept at ``path`` (and True: a resumed run), or a new one written there (False)."""
    if path.exists():
        return path.read_text().strip(), True
    run_id = new_id()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id, False


class Tracker(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...

    def log_files(self, paths: list[Path]) -> None: ...

    def close(self) -> None: ...


class WandbTracker:
    """A W&B run in ``run_dir/wandb`` (offline mode writes only there)."""

    def __init__(self, cfg: WandbConfig, *, run_dir: Path, config: dict) -> None:
        import wandb

        self._wandb = wandb
        self.class_names = ClassNames(run_dir)
        run_id, _ = _run_id(run_dir / "wandb_run_id", lambda: uuid.uuid4().hex[:12])
        mode = cast(Literal["online", "offline", "disabled"], cfg.mode)  # WandbConfig validated it
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=mode, dir=str(run_dir), id=run_id,
                              resume="allow", name=run_dir.name, config=config)
        self.last_step = self.run.step - 1 if self.run.resumed else -1

    def log(self, step: int, metrics: dict) -> None:
        # W&B keeps one history row per step, in order: a step it holds is skipped, except an event
        # record (a resume's world_size_changed is logged at the step the tracker already holds).
        if step <= self.last_step and "event" not in metrics:
            return
        row: dict[str, Any] = dict(scalars(metrics, self.class_names.for_record(metrics)))
        for key in PER_EXPERT_KEYS:
            if isinstance(metrics.get(key), list):
                table = metrics[key]
                row[key] = self._wandb.Table(columns=["layer", "expert", key], data=expert_rows(table))
                for i, values in enumerate(table):
                    row[f"{key}_hist/layer{i}"] = self._wandb.Histogram(values, num_bins=max(1, len(values)))
        if row and step > self.last_step:
            self.run.log(row, step=step)
            self.last_step = step
        elif row:  # W&B cannot go back a step: the event joins the next one's row
            self.run.log(row, step=self.last_step + 1, commit=False)

    def log_files(self, paths: list[Path]) -> None:
        artifact = self._wandb.Artifact(f"{self.run.id}-files", type="run-files")
        for path in paths:
            artifact.add_file(str(path), name=path.name)
        self.run.log_artifact(artifact)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in ``cfg.experiment`` (created when missing)."""

    def __init__(self, cfg: MlflowConfig, *, run_dir: Path, config: dict) -> None:
        from mlflow.entities import Metric, Param, RunStatus
        from mlflow.tracking import MlflowClient

        self._metric, self._status = Metric, RunStatus
        self.class_names = ClassNames(run_dir)
        self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
        self.run_id, resumed = _run_id(run_dir / "mlflow_run_id", lambda: self.client.create_run(
            experiment_id, run_name=run_dir.name).info.run_id)
        self.last_step = -1
        if resumed:
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            history = self.client.get_metric_history(self.run_id, "loss")
            self.last_step = max((m.step for m in history), default=-1)
        else:
            params = [Param(k, str(v)[:6000]) for k, v in _flat_config(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict) -> None:
        if step <= self.last_step and "event" not in metrics:  # an event record is new even at a held step
            return
        now = int(time.time() * 1000)
        names = self.class_names.for_record(metrics)
        batch = [self._metric(k, v, now, step) for k, v in scalars(metrics, names).items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1,000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])
        for key in PER_EXPERT_KEYS:
            if isinstance(metrics.get(key), list):
                rows = expert_rows(metrics[key])
                columns = {"layer": [r[0] for r in rows], "expert": [r[1] for r in rows], key: [r[2] for r in rows]}
                self.client.log_dict(self.run_id, columns, f"{key}/step{step:08d}.json")
        self.last_step = max(self.last_step, step)

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status=self._status.to_string(self._status.FINISHED))


def _flat_config(config: dict) -> dict[str, Any]:
    return {f"{section}.{name}": value for section, fields in config.items() for name, value in fields.items()}


def build_trackers(cfg: LogConfig, *, run_dir: Path, config: dict) -> list[Tracker]:
    """The trackers ``cfg`` turns on, each started (rank 0 calls this; the others log nothing)."""
    trackers: list[Tracker] = []
    if cfg.wandb is not None:
        trackers.append(WandbTracker(cfg.wandb, run_dir=run_dir, config=config))
    if cfg.mlflow is not None:
        trackers.append(MlflowTracker(cfg.mlflow, run_dir=run_dir, config=config))
    return trackers
