"""A resume continues the same model: relaunched into the same run folder with another top_k and
router, every rank refuses the checkpoint with the fields named, before the run folder's
config.yaml is rewritten; with other training settings (the aux-loss coefficient,
a capacity factor, dispatch chunks) it resumes and trains on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RECORD = ("config.yaml",)  # a byte tokenizer writes no tokenizer.json


def _relaunch(rank: int, world_size: int, run_dir: Path, refused: list[str],
              allowed: list[str]) -> tuple[str | None, dict[str, bytes], int]:
    """The refusal each rank raised for ``refused`` (None when it resumed) and the run folder's
    record after it, then the step that the run of ``allowed`` reached."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    try:
        Trainer(load_config(None, refused))
    except ValueError as e:
        error = str(e)
    else:
        return None, {}, 0  # it resumed (its close would end the process group the next run needs)
    record = {name: (run_dir / name).read_bytes() for name in RECORD}
    trainer = Trainer(load_config(None, allowed))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return error, record, trainer.step


def test_a_resume_refuses_another_model_on_every_rank_and_allows_other_training_settings(tmp_path, shakespeare_cached):
    run_dir = tmp_path / "run"
    run_ranks(train_job, 2, job_overrides(run_dir, steps=2, ep=2), timeout_s=120)
    before = {name: (run_dir / name).read_bytes() for name in RECORD}
    refused = job_overrides(run_dir, steps=3, ep=2, extra=("--moe.top_k=1", "--moe.router=sigmoid"))
    allowed = job_overrides(run_dir, steps=3, ep=2, extra=(
        "--moe.aux_loss_coef=0.02", "--moe.capacity_factor=2.0", "--moe.dispatch_chunks=2"))
    results = run_ranks(_relaunch, 2, run_dir, refused, allowed, timeout_s=180)
    for error, record, step in results:
        assert error is not None, "a resume with another top_k and router went on"
        assert "does not match this job's model: moe.router (saved 'softmax', now 'sigmoid'); " \
               "moe.top_k (saved 2, now 1)." in error
        assert "--checkpoint.init_from" in error
        assert record == before  # the refused relaunch left the run's record as it was
        assert step == 3
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # resumed at step 2, not started over
    assert "aux_loss_coef: 0.02" in (run_dir / "config.yaml").read_text()
