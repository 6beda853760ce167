"""A 2-process expert-parallel training run with W&B (offline) and MLflow (a local SQLite store) on: rank 0
sends each tracker exactly the scalars of metrics.jsonl at every logged step, the per-expert load table,
the resolved config and the report's PNGs; the other rank starts no tracker run."""

from __future__ import annotations

import json

import pytest

from moetrain.train.trackers import scalars
from tests.helpers import wandb_records
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]




def test_trackers_receive_the_metrics_of_an_expert_parallel_run(tmp_path, shakespeare_cached, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # a new experiment's artifacts go to MLflow's default, ./mlruns

    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers = ("--log.wandb={project: moetrain-test, mode: offline}",
                f"--log.mlflow={{tracking_uri: '{uri}', experiment: moetrain-test}}", "--log.every=2")
    run_ranks(train_job, 2, job_overrides(run_dir, steps=4, ep=2, extra=trackers), timeout_s=240)
    with open(run_dir / "metrics.jsonl") as f:
        records = {r.pop("step"): r for r in map(json.loads, f)}
    assert sorted(records) == [2, 4] and "expert_share" in records[4]

    rows = wandb_records.history(wandb_records.run_file(run_dir))  # one run: rank 1 started none
    assert sorted(rows) == [2, 4]
    for step, record in records.items():
        expected = scalars(record)
        assert "loss" in expected and "load_cv/layer1" in expected
        assert {k: rows[step][k] for k in expected} == expected
        assert rows[step]["expert_share/nrows"] == 2 * 4  # layers x experts

    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["parallel.ep"] == "2"
    for key in scalars(records[4]):
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        assert history == [(s, scalars(r)[key]) for s, r in records.items() if key in scalars(r)], key
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "loss.png", "expert_load.png", "expert_share"} <= artifacts
