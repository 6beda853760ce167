"""A rebalanced run resumed between re-plans plans as the run that never stopped
(docs/routing.md#expert-rebalancing): re-planned every 3 steps under a drifting forced skew (the
load moves every step), resumed from its step-2 checkpoint in another folder, its step-3 plan comes
from the load of steps 1-3, not only step 3's, so rebalance.jsonl's placements and received copies
match those of the uninterrupted run; with step 3 skipped (a NaN loss) and checkpointed, the re-plan
due on it comes at step 4 in the resumed run too. In the same launch of 2 gloo processes, ``moetrain report`` on
a run re-planned every step under zipf:1.2 with a routing trace: the ranks' straggler factor after
the first plan, from what their slots received, is near 1, while the home layout's stays above it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.train.checkpoint.files import step_dir_name
from moetrain.train.report import write_report
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses

pytestmark = pytest.mark.timeout(240)
COMMON = ("--train.deterministic=true", "--log.memory=false", "--parallel.expert_slots_per_rank=3")
JOB = ("--moe.force_skew=drift:1.2:1", "--moe.rebalance_every=3", *COMMON)


def _runs(rank: int, world_size: int, runs: list[tuple[list[str], int | None]]) -> None:
    """Each run in turn: its overrides, and the step whose loss is made NaN on every rank (None: none)."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    for overrides, nan_step in runs:
        trainer = Trainer(load_config(None, overrides))
        if nan_step is not None:
            def poison(module, args, output, trainer=trainer, nan_step=nan_step):
                return output * float("nan") if trainer.step + 1 == nan_step else output

            trainer.model.output.register_forward_hook(poison)
        trainer.fit()
        trainer.metrics.close()


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "rebalance.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_resume_between_replans_plans_as_the_uninterrupted_run(tmp_path, shakespeare_cached):
    full, resumed, zipf = tmp_path / "full", tmp_path / "resumed", tmp_path / "zipf"
    skip, skip_resumed = tmp_path / "skip", tmp_path / "skip-resumed"
    ckpt = full / "checkpoints" / step_dir_name(2)
    run_ranks(_runs, 2, [
        (job_overrides(full, steps=4, ep=2, extra=(*JOB, "--checkpoint.every=2", "--checkpoint.keep_last=0")), None),
        (job_overrides(resumed, steps=4, ep=2, extra=(*JOB, f"--checkpoint.resume={ckpt}")), None),
        # Step 3 skipped (NaN loss): its re-plan waits for step 4, also across a checkpoint of step 3.
        (job_overrides(skip, steps=4, ep=2, extra=(*JOB, "--checkpoint.every=3", "--checkpoint.keep_last=0")), 3),
        (job_overrides(skip_resumed, steps=4, ep=2, extra=(
            *JOB, f"--checkpoint.resume={skip / 'checkpoints' / step_dir_name(3)}")), None),
        (job_overrides(zipf, steps=3, ep=2, extra=(*COMMON, "--moe.force_skew=zipf:1.2", "--moe.rebalance_every=1",
                                                     "--log.routing_trace=counts")), None),
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
    want, got = _records(skip), _records(skip_resumed)
    assert [(s, want[s]["rebalanced"]) for s in sorted(want)] == [(1, False), (2, False), (3, False), (4, True)]
    assert sorted(got) == [4] and got[4]["rebalanced"] and got[4]["replicas"] == want[4]["replicas"], (got, want)

    write_report(zipf)
    report = json.loads((zipf / "report" / "routing_straggler.json").read_text())
    assert report["rebalanced"] and report["replicas"]["first_plan_step"] == 1
    for name, home in report["layers"].items():
        assert home["mean"] > 1.2, (name, home)  # zipf:1.2 on the experts' home ranks
        assert report["replicas"]["layers"][name]["after_first_plan"]["max"] < 1.1, (name, report["replicas"])
        # Step 1 ran the home layout, dropless: the copies the ranks received are the trace's by home rank.
        assert report["replicas"]["layers"][name]["straggler_factor"][0] == home["straggler_factor"][0]
    assert (zipf / "report" / "rank_load_home.png").is_file()
