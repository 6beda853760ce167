"""A pipeline-parallel run (pp=2 x dp=2, or pp=2 x tp=2 with the experts on the tp ranks; experts over
ep=2 in each stage, the router bias moving) resumed from its checkpoint continues with exactly the
losses of the uninterrupted run: each stage reads its own layers from the checkpoint, its optimizer
keeps its own parameters, and the balancer counters of every stage come back to the stage that holds
those layers. The pp=2 x tp=2 run keeps a weight average (optim.ema_decay), which its evaluations
use: each stage saves and reloads its layers' tp-sharded averages, and its report is drawn from the
metrics the stages logged. Every run is the trainer on forked gloo ranks (what each rank of
``moetrain train --nproc 4`` runs; the launcher has tests of its own in test_cli.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.dist_launcher import run_ranks

OVERRIDES = ["--train.steps=6", "--data.seq_len=64", "--train.global_batch_size=8", "--train.micro_batch_size=2",
             "--train.eval_every=0", "--checkpoint.every=3", "--checkpoint.keep_last=0",
             "--moe.router_bias_update_rate=0.01", "--log.every=1", "--log.progress_bar=false",
             "--log.tensorboard=false"]


def _rank(rank: int, world_size: int, overrides: list[str]) -> str | None:
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config("hybrid-dp-ep-pp", overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return None if trainer.resumed_from is None else Path(trainer.resumed_from).name


def _train(run: Path, layout: list[str]) -> list[str | None]:
    """The job on 4 gloo ranks (each runs what a rank of ``moetrain train --nproc 4`` runs); the
    checkpoint each rank resumed from."""
    return run_ranks(_rank, 4, [*OVERRIDES, f"--log.run_dir={run}", *layout], timeout_s=300)


def _losses(run: Path) -> dict[int, float]:
    import json

    lines = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {d["step"]: d["loss"] for d in lines if "loss" in d}


def _val_losses(run: Path) -> dict[int, float]:
    import json

    lines = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {d["step"]: d["val_loss"] for d in lines if "val_loss" in d}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [[], ["--parallel.tp=2", "--train.eval_every=3", "--train.eval_steps=1",
                                         "--optim.ema_decay=0.9"]],
                         ids=["pp2_dp2_ep2", "pp2_tp2_ep2"])
def test_pipeline_run_resumes_exactly(tmp_path, shakespeare_cached, layout):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert _train(whole, layout) == [None] * 4
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000000003", resumed / "checkpoints" / "step_000000003")
    assert _train(resumed, layout) == ["step_000000003"] * 4
    want, got = _losses(whole), _losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]
    if "--train.eval_every=3" in layout:  # evaluation runs stage after stage on tp-sharded streams
        assert _val_losses(resumed) == {6: _val_losses(whole)[6]}  # with the averaged weights
        from moetrain.train.report import write_report

        # What `moetrain train` draws once the ranks are done, from the stages' own records.
        assert (whole / "report" / "loss.png") in write_report(whole)
