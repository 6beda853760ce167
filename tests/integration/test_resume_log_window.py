"""A resume from a checkpoint saved off the ``log.every`` cadence: every metrics record after it
equals the uninterrupted run's. Each record averages the steps since the previous record; the
checkpoint does not hold that window, so a resume that started inside one would average only the
steps trained since the resume (the balancer's counters, which the checkpoint does hold, would
still cover the whole window)."""

from __future__ import annotations

import json

import torch

from moetrain.config.loader import load_config
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides

# Not comparable: the timings, and the memory peaks (measured on log.every steps only).
_COMPARED = ("loss", "aux_loss", "lr", "grad_norm", "skipped_steps", "skipped_steps_total", "expert_share",
             "load_cv", "load_max_over_mean", "routing_entropy", "dropped_fraction", "unused_experts")


def _records(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if "loss" in r]


def _call(rank: int, world_size: int, body, *args):
    return body(*args)


def _uninterrupted_and_resumed(tmp_path) -> tuple[list[dict], list[dict]]:
    from moetrain.train.trainer import Trainer

    torch.use_deterministic_algorithms(True)  # this child process only
    # log.every=3, checkpoint.every=2: the step-4 checkpoint falls inside the window of steps 4-6.
    extra = ("--train.deterministic=true", "--log.every=3", "--checkpoint.every=2", "--checkpoint.keep_last=0")
    for run_dir, more in ((tmp_path / "ref", ()),
                          (tmp_path / "resumed", (f"--checkpoint.resume={tmp_path}/ref/checkpoints/step_000000004",))):
        trainer = Trainer(load_config(None, job_overrides(run_dir, steps=6, extra=(*extra, *more))))
        trainer.fit()
        trainer.close()
    return _records(tmp_path / "ref"), _records(tmp_path / "resumed")


def test_records_after_a_resume_off_the_log_cadence_equal_the_uninterrupted_runs(tmp_path, shakespeare_cached):
    ref, resumed = run_ranks(_call, 1, _uninterrupted_and_resumed, tmp_path, timeout_s=180)[0]
    assert [r["step"] for r in resumed] == [6]
    want = [r for r in ref if r["step"] > 4]
    assert [r["step"] for r in want] == [6], [r["step"] for r in ref]
    for key in _COMPARED:
        assert [r[key] for r in resumed] == [r[key] for r in want], key
