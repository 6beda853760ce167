"""The command line end to end: `moetrain train` under torchrun on 2 gloo ranks leaves a
complete run directory, and the saved config.yaml reproduces the run exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import job_overrides, read_losses

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _torchrun(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "moetrain.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_train_under_torchrun_and_reproduce_from_saved_config(tmp_path, shakespeare_cached):
    run = tmp_path / "run"
    overrides = job_overrides(run, steps=6, ep=2, extra=("--log.tensorboard=true", "--train.eval_every=3",
                                                         "--train.eval_steps=2"))
    r = _torchrun(["train", *overrides])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "final val loss" in r.stdout
    for name in ("config.yaml", "metrics.jsonl", "report/loss.png", "report/throughput.png",
                 "report/expert_load.png", "report/dropped.png"):
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").glob("events.out.tfevents.*"))
    losses = read_losses(run)
    assert len(losses) == 6

    # The saved config is the whole run: re-running it (into another folder) gives the same losses.
    again = tmp_path / "again"
    r2 = _torchrun(["train", "--config", str(run / "config.yaml"), f"--log.run_dir={again}"])
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert read_losses(again) == losses


def test_bad_config_fails_fast_with_the_field_named(tmp_path):
    cmd = [sys.executable, "-m", "moetrain.cli", "train", "--nproc", "2", "--moe.num_experts=8",
           "--parallel.ep=3", f"--log.run_dir={tmp_path / 'x'}"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert "parallel.ep (3) must divide moe.num_experts (8)" in r.stderr
    assert not (tmp_path / "x").exists()  # nothing was started or written


def test_config_show_prints_the_resolved_config():
    cmd = [sys.executable, "-m", "moetrain.cli", "config", "show", "--config", str(ROOT / "configs/tiny.yaml"),
           "--moe.top_k=1"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    import re

    assert re.search(r"^\* moe\.top_k\s+= 1$", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^  moe\.num_experts\s+= 8$", r.stdout, re.MULTILINE), r.stdout
