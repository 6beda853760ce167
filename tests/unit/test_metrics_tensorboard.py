"""TensorBoard after a resume: the stopped run's events after the resume point are dropped, so each
step has the one value metrics.jsonl keeps (read back with TensorBoard's own EventAccumulator)."""

from __future__ import annotations

import json

from moetrain.train.metrics import MetricsLogger


def _tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _jsonl(run_dir) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key != "step":
                out.setdefault(key, []).append((record["step"], value))
    return out


def test_a_resumed_run_keeps_one_value_per_step(tmp_path):
    first = MetricsLogger(tmp_path, report=False)
    for step, loss in ((2, 3.0), (4, 2.5), (6, 2.25), (8, 2.0)):
        first.log(step, {"loss": loss})
    first.close()  # stopped after step 8; its last checkpoint was step 4
    resumed = MetricsLogger(tmp_path, report=False, keep_until_step=4)
    for step, loss in ((6, 1.5), (8, 1.25)):
        resumed.log(step, {"loss": loss})
    resumed.close()
    assert _jsonl(tmp_path) == {"loss": [(2, 3.0), (4, 2.5), (6, 1.5), (8, 1.25)]}
    assert _tensorboard(tmp_path) == _jsonl(tmp_path)
    # A fresh start in the same folder (no resume point): an empty metrics.jsonl, and no old events.
    fresh = MetricsLogger(tmp_path, report=False)
    fresh.log(2, {"loss": 9.0})
    fresh.close()
    assert _tensorboard(tmp_path) == _jsonl(tmp_path) == {"loss": [(2, 9.0)]}
