"""`moetrain eval` at any process count for runs trained with tensor or pipeline parallelism: a
tp=2 run and a pp=2 run (2 steps of a tiny MoE on 2 processes) evaluate at 1 process, their layout
folded to fit, to the validation loss the run itself measured in its own layout (the trainer's
last evaluation covers the whole validation stream here, in the same batches). The run trains on
forked gloo ranks (what each rank of ``moetrain train --nproc 2`` runs; that launcher has tests of
its own) and ``moetrain eval --nproc 1`` runs in this process, as the command does at one process."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.cli import main
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", ["--parallel.tp=2", "--parallel.pp=2"])
def test_a_tp_or_pp_run_evaluates_at_one_process(tmp_path, shakespeare_cached, capsys, layout):
    run_dir = tmp_path / "run"
    whole_stream = ("--train.eval_every=2", "--train.eval_steps=1000000", "--data.val_fraction=0.005", layout)
    run_ranks(train_job, 2, job_overrides(run_dir, steps=2, extra=whole_stream), timeout_s=240)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [rec["val_loss"] for rec in records if "val_loss" in rec][-1]

    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command's process would (OMP_NUM_THREADS=1): no contention with other jobs
    try:
        assert main(["eval", str(run_dir), "--nproc", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "(step 2, 1 process(es))" in out, out
    result = json.loads((run_dir / "eval-val-step2.json").read_text())
    assert result["world_size"] == 1
    assert result["val_loss"] == pytest.approx(trained, rel=1e-5)


def test_in_training_validation_reads_the_same_windows_at_every_layout(tmp_path, shakespeare_cached):
    """train.eval_steps counts global batches: at world 1 (2 micro-batches a step) and at dp = 2 (1
    each) the trainer evaluates the same 2 x 8 windows, so the validation losses agree as the
    training losses do (to 1e-4: the two layouts sum the gradients in other orders). Counted in
    micro-batches, world 1 read half as many."""
    extra = ("--train.eval_every=2", "--train.eval_steps=2", "--data.val_fraction=0.05")
    runs = {n: tmp_path / n for n in ("dp2", "world1")}
    run_ranks(train_job, 2, job_overrides(runs["dp2"], steps=2, extra=extra), timeout_s=120)
    run_ranks(train_job, 1, job_overrides(runs["world1"], steps=2, extra=extra), timeout_s=120)
    got = {}
    for name, run_dir in runs.items():
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        got[name] = ([r["loss"] for r in records if "loss" in r], [r["val_loss"] for r in records if "val_loss" in r])
    assert got["world1"][0] == pytest.approx(got["dp2"][0], rel=1e-4)
    assert len(got["dp2"][1]) == 1 and got["world1"][1] == pytest.approx(got["dp2"][1], rel=1e-4), got
