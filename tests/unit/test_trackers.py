"""Experiment trackers: what W&B (offline) and MLflow (a local SQLite store) receive from the metrics
logger, read back from the files each writes; config errors; nothing imported when both are off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.config.loader import load_config
from moetrain.train.metrics import MetricsLogger, class_tags
from moetrain.train.trackers import MlflowTracker, WandbTracker, expert_rows, scalars
from tests.helpers import wandb_records

RECORDS = [
    (2, {"loss": 3.5, "aux_loss": 0.01, "lr": 1e-3, "load_cv": [0.25, 0.5], "expert_share": [[0.5, 0.5], [0.75, 0.25]],
         "unused_experts": [[], [1]], "event_flag": True, "note": "text", "grad_norm": float("nan")}),
    (4, {"loss": 3.0, "aux_loss": 0.02, "lr": 2e-3, "load_cv": [0.125, 0.375],
         "expert_share": [[0.25, 0.75], [0.5, 0.5]], "val_per_class_f1": [0.5, None, 1.0]}),
]


def test_scalars_flatten_like_tensorboard():
    step, record = RECORDS[0]
    assert scalars(record) == {"loss": 3.5, "aux_loss": 0.01, "lr": 1e-3, "load_cv/layer0": 0.25,
                               "load_cv/layer1": 0.5}  # tables, strings, flags and NaN left out
    assert scalars(RECORDS[1][1])["val_per_class_f1/class2"] == 1.0
    assert "val_per_class_f1/class1" not in scalars(RECORDS[1][1])
    assert expert_rows([[0.5, 0.5], [0.75, 0.25]]) == [[0, 0, 0.5], [0, 1, 0.5], [1, 0, 0.75], [1, 1, 0.25]]


def test_per_class_scalars_are_named_after_the_classes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = RECORDS[1][1]  # val_per_class_f1 [0.5, None, 1.0]
    assert {k: v for k, v in scalars(record, ["10", "2", "a/b c"]).items() if "per_class" in k} == {
        "val_per_class_f1/10": 0.5, "val_per_class_f1/a_b_c": 1.0}
    # Names that would give the same tag, or names for another count: the class ids.
    assert class_tags(["a b", "a_b", "c"], 3) == class_tags(None, 3) == ["class0", "class1", "class2"]
    assert class_tags(["x", "y"], 3) == ["class0", "class1", "class2"]
    (tmp_path / "classes.json").write_text(json.dumps({"classes": ["10", "2", "a/b c"]}))
    logger = MetricsLogger(tmp_path, report=False)
    logger.log(4, record)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = {t for t in events.Tags()["scalars"] if "per_class" in t}
    assert tags == {"val_per_class_f1/10", "val_per_class_f1/a_b_c"}
    assert events.Scalars("val_per_class_f1/10")[0].value == 0.5


def test_config_errors_name_the_field():
    cfg = load_config("tiny", ["--log.wandb={project: p, mode: offline}", "--log.mlflow={experiment: e}"])
    assert cfg.log.wandb.mode == "offline" and cfg.log.mlflow.experiment == "e" and cfg.log.mlflow.tracking_uri is None
    with pytest.raises(ValueError, match=r"log\.wandb\.mode \('sometimes'\) must be one of"):
        load_config("tiny", ["--log.wandb={mode: sometimes}"])
    with pytest.raises(ValueError, match=r"log\.mlflow\.experiment"):
        load_config("tiny", ["--log.mlflow={experiment: ''}"])
    with pytest.raises(ValueError, match=r"log\.mlflow\.uri"):
        load_config("tiny", ["--log.mlflow={uri: x}"])


def test_nothing_imported_when_off():
    code = ("import sys, moetrain.cli.train, moetrain.train.trainer; "
            "print('wandb' in sys.modules, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _log_all(run_dir: Path, trackers) -> None:
    (run_dir / "config.yaml").write_text("train:\n  steps: 4\n")
    logger = MetricsLogger(run_dir, tensorboard=False, trackers=trackers)
    for step, record in RECORDS:
        logger.log(step, record)
    logger.close()  # writes the report and hands its PNGs and config.yaml to the trackers


def test_wandb_offline_run_holds_the_jsonl_scalars_and_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("tiny", ["--log.wandb={project: moetrain-test, mode: offline}"])
    _log_all(tmp_path, [WandbTracker(cfg.log.wandb, run_dir=tmp_path, config={"train": {"steps": 4}})])
    rows = wandb_records.history(wandb_records.run_file(tmp_path))
    assert sorted(rows) == [2, 4]
    for step, record in RECORDS:
        for key, value in scalars(record).items():
            assert rows[step][key] == value, (step, key)
        assert rows[step]["expert_share/_type"] == "table-file" and rows[step]["expert_share/nrows"] == 4
        assert rows[step]["expert_share_hist/layer0/_type"] == "histogram"
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    table = wandb_records.run_file(tmp_path).parent / "files" / rows[4]["expert_share/path"]
    assert run_id in str(table)
    assert json.loads(table.read_text())["data"] == [[0, 0, 0.25], [0, 1, 0.75], [1, 0, 0.5], [1, 1, 0.5]]
    artifacts = [r.artifact for r in wandb_records.records(wandb_records.run_file(tmp_path))
                 if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "run-files"]
    names = {e.path for a in artifacts for e in a.manifest.contents}
    assert {"config.yaml", "loss.png"} <= names


def test_mlflow_run_holds_the_jsonl_scalars_tables_and_resumes(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # a new experiment's artifacts go to MLflow's default, ./mlruns

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config("tiny", [f"--log.mlflow={{tracking_uri: '{uri}', experiment: moetrain-test}}"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "classes.json").write_text(json.dumps({"classes": ["neg", "pos", "a/b"]}))
    _log_all(run_dir, [MlflowTracker(cfg.log.mlflow, run_dir=run_dir, config={"train": {"steps": 4}})])
    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "4"
    named = [(s, scalars(r, ["neg", "pos", "a/b"])) for s, r in RECORDS]
    for key in ("loss", "load_cv/layer1", "val_per_class_f1/neg", "val_per_class_f1/a_b"):
        expected = [(s, values[key]) for s, values in named if key in values]
        assert expected and [(m.step, m.value) for m in client.get_metric_history(run_id, key)] == expected, key
    assert client.get_metric_history(run_id, "val_per_class_f1/class0") == []
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id,
                                                                                                      "expert_share")}
    assert {"config.yaml", "loss.png", "expert_share/step00000002.json"} <= artifacts
    table = client.download_artifacts(run_id, "expert_share/step00000004.json", str(tmp_path))
    assert json.loads(Path(table).read_text()) == {"layer": [0, 0, 1, 1], "expert": [0, 1, 0, 1],
                                                   "expert_share": [0.25, 0.75, 0.5, 0.5]}
    # A resumed run continues the same MLflow run and skips the steps it already logged.
    tracker = MlflowTracker(cfg.log.mlflow, run_dir=run_dir, config={})
    assert tracker.run_id == run_id and client.get_run(run_id).info.status == "RUNNING"
    tracker.log(4, {"loss": 99.0})
    # ... but not the event a resume at another world size logs at the step it resumed from.
    tracker.log(4, {"event": "world_size_changed", "world_size_before": 1, "world_size": 2})
    tracker.log(6, {"loss": 2.5})
    tracker.close()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(2, 3.5), (4, 3.0), (6, 2.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "world_size")] == [(4, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "world_size_before")] == [(4, 1.0)]


def test_wandb_resumed_run_takes_the_resume_event_on_its_next_row(tmp_path, monkeypatch):
    """A resumed W&B run holds steps up to 4 (set by hand: an offline run cannot resume); the
    world_size_changed record logged at step 4 lands on step 5's row, the steps it holds are skipped."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("tiny", ["--log.wandb={project: moetrain-test, mode: offline}"])
    tracker = WandbTracker(cfg.log.wandb, run_dir=tmp_path, config={})
    tracker.last_step = 4
    tracker.log(4, {"loss": 99.0})
    tracker.log(4, {"event": "world_size_changed", "world_size_before": 1, "world_size": 2})
    tracker.log(6, {"loss": 2.5})
    tracker.close()
    rows = wandb_records.history(wandb_records.run_file(tmp_path))
    assert sorted(rows) == [5, 6]
    assert rows[5]["world_size"] == 2 and rows[5]["world_size_before"] == 1 and "loss" not in rows[5]
    assert rows[6]["loss"] == 2.5
