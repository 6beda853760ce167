"""A rebalanced run resumed between re-plans plans as the run that never stopped
(docs/routing.md#expert-rebalancing): re-planned every 3 steps under a drifting forced skew (the
load moves every step), resumed from its step-2 checkpoint in another folder, its step-3 plan comes
from the load of steps 1-3, not only step 3's, so rebalance.jsonl's placements and received copies
match those of the uninterrupted run. One launch of 2 gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.train.checkpoint.files import step_dir_name
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses

pytestmark = pytest.mark.timeout(240)
JOB = ("--moe.force_skew=drift:1.2:1", "--train.deterministic=true", "--log.memory=false",
       "--parallel.expert_slots_per_rank=3", "--moe.rebalance_every=3")


def _runs(rank: int, world_size: int, runs: list[list[str]]) -> None:
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    for overrides in runs:
        trainer = Trainer(load_config(None, overrides))
        trainer.fit()
        trainer.metrics.close()


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "rebalance.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_resume_between_replans_plans_as_the_uninterrupted_run(tmp_path, shakespeare_cached):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    ckpt = full / "checkpoints" / step_dir_name(2)
    run_ranks(_runs, 2, [
        job_overrides(full, steps=4, ep=2, extra=(*JOB, "--checkpoint.every=2", "--checkpoint.keep_last=0")),
        job_overrides(resumed, steps=4, ep=2, extra=(*JOB, f"--checkpoint.resume={ckpt}")),
    ], timeout_s=200)

    want, got = _records(full), _records(resumed)
    assert [(s, want[s]["rebalanced"]) for s in sorted(want)] == [(1, False), (2, False), (3, True), (4, False)]
    assert sorted(got) == [3, 4], got
    # The plan of step 3 differs from one made from step 3's load alone under this drift (seen: another
    # replica set), so equal placements mean the load of steps 1-2 came through the checkpoint.
    assert got[3]["replicas"] == want[3]["replicas"]
    for s in (3, 4):
        assert got[s]["rank_copies"] == want[s]["rank_copies"], s
    assert read_losses(resumed) == read_losses(full)[2:]
