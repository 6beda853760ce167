"""``train.eval_every`` acts on its own cadence: an evaluation step writes its metrics record
whatever ``log.every`` (evaluation used to run only on logging steps, so eval_every=3 with
log.every=5 evaluated at step 6 alone, the last step)."""

from __future__ import annotations

import json

from moetrain.config.loader import load_config
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides


def _fit(rank: int, world_size: int, run_dir) -> list[tuple[int, bool]]:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, job_overrides(run_dir, steps=7, extra=(
        "--train.eval_every=3", "--log.every=5", "--train.eval_steps=1"))))
    try:
        trainer.fit()
    finally:
        trainer.close()
    with open(run_dir / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, filter(str.strip, f)) if "loss" in r]
    return [(r["step"], "val_loss" in r) for r in records]


def test_evaluations_follow_eval_every_whatever_log_every(tmp_path, shakespeare_cached):
    (got,) = run_ranks(_fit, 1, tmp_path / "run", timeout_s=180)
    assert got == [(3, True), (5, False), (6, True), (7, True)]
