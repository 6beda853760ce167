"""`moetrain eval` at any process count for runs trained with tensor or pipeline parallelism: a
tp=2 run and a pp=2 run (2 steps of a tiny MoE on 2 processes) evaluate at 1 process, their layout
folded to fit, to the validation loss the run itself measured in its own layout (the trainer's
last evaluation covers the whole validation stream here, in the same batches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import job_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _cli(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "moetrain.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("layout", ["--parallel.tp=2", "--parallel.pp=2"])
def test_a_tp_or_pp_run_evaluates_at_one_process(tmp_path, shakespeare_cached, layout):
    run_dir = tmp_path / "run"
    whole_stream = ("--train.eval_every=2", "--train.eval_steps=1000000", layout)
    r = _cli(["train", "--nproc", "2", *job_overrides(run_dir, steps=2, extra=whole_stream)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [rec["val_loss"] for rec in records if "val_loss" in rec][-1]

    r = _cli(["eval", str(run_dir), "--nproc", "1"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(step 2, 1 process(es))" in r.stdout, r.stdout
    result = json.loads((run_dir / "eval-val-step2.json").read_text())
    assert result["world_size"] == 1
    assert result["val_loss"] == pytest.approx(trained, rel=1e-5)
