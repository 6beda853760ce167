"""Expert rebalancing through the trainer (docs/routing.md#expert-rebalancing), 2 gloo processes:
a run with replicas (re-planned every step, zipf:1.2 forced skew) gives the losses and grad norms of
the same run without them; it resumes from its step-2 checkpoint to the same losses, with
rebalancing at the same layout and without it at another (ep = 1), since the checkpoint holds the
experts in logical order; and its rebalance.jsonl shows the hot rank's load spread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.train.checkpoint.files import step_dir_name
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses

pytestmark = pytest.mark.timeout(240)
SKEW = ("--moe.force_skew=zipf:1.2", "--train.deterministic=true", "--log.memory=false")
REBALANCE = ("--parallel.expert_slots_per_rank=3", "--moe.rebalance_every=1")


def _runs(rank: int, world_size: int, runs: list[list[str]]) -> None:
    """Each run in turn in this process group (the trainer reuses an initialised one)."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    for overrides in runs:
        trainer = Trainer(load_config(None, overrides))
        trainer.fit()
        trainer.metrics.close()


def _grad_norms(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["grad_norm"] for r in map(json.loads, lines) if "loss" in r]


def _close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b, strict=True)), (what, a, b)


def test_rebalanced_training_matches_and_resumes_at_any_layout(tmp_path, shakespeare_cached):
    plain, rebal, same, other = (tmp_path / n for n in ("plain", "rebal", "resume-same", "resume-ep1"))
    ckpt = rebal / "checkpoints" / step_dir_name(2)
    runs = [job_overrides(plain, steps=3, ep=2, extra=SKEW),
            job_overrides(rebal, steps=3, ep=2, extra=(*SKEW, *REBALANCE, "--checkpoint.every=2",
                                                       "--checkpoint.keep_last=0")),
            job_overrides(same, steps=3, ep=2, extra=(*SKEW, *REBALANCE, f"--checkpoint.resume={ckpt}")),
            job_overrides(other, steps=3, ep=1, extra=(*SKEW, f"--checkpoint.resume={ckpt}"))]
    run_ranks(_runs, 2, runs, timeout_s=200)
    _close(read_losses(rebal), read_losses(plain), "loss with vs without replicas")
    _close(_grad_norms(rebal), _grad_norms(plain), "grad norm with vs without replicas")
    _close(read_losses(same), read_losses(plain)[2:], "resumed with replicas at ep=2")
    _close(read_losses(other), read_losses(plain)[2:], "resumed without replicas at ep=1")
    recs = [json.loads(line) for line in (rebal / "rebalance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["rebalanced"] for r in recs)
    for r in recs[1:]:  # planned from the previous step's load
        for copies in r["rank_copies"]:
            assert max(copies) <= 1.2 * sum(copies) / len(copies), r
    first = recs[0]["rank_copies"][0]
    assert max(first) > 1.3 * sum(first) / len(first), first  # the home layout under zipf:1.2
