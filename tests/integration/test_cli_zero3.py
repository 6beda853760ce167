"""ZeRO-3 with expert parallelism through the command line: `moetrain train --nproc 2` at
parallel.ep=2 x parallel.zero_stage=3 (dense weights FSDP-sharded over the 2 data-parallel ranks,
experts split over ep), resumed from the checkpoint of its step 3, continues with exactly the losses
of the run that saved it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import job_overrides, read_losses

ROOT = Path(__file__).resolve().parents[2]
ZERO3_EP2 = ("--parallel.zero_stage=3", "--train.deterministic=true", "--checkpoint.every=3")


def _train(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moetrain.cli", "train", "--nproc", "2",
           *job_overrides(run_dir, steps=steps, ep=2, extra=ZERO3_EP2)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_ep2_resume_through_the_cli_is_exact(tmp_path, shakespeare_cached):
    ref = _train(tmp_path / "ref", steps=6)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    want = read_losses(tmp_path / "ref")
    assert len(want) == 6
    saved = tmp_path / "ref" / "checkpoints" / "step_000000003"
    manifest = (saved / "manifest.json").read_text()
    assert '"zero_stage": 3' in manifest and '"ep": 2' in manifest

    run = tmp_path / "run"
    shutil.copytree(saved, run / "checkpoints" / saved.name)
    resumed = _train(run, steps=6)  # checkpoint.resume=auto: continues from step 3
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    # FSDP's reduce-scatter over gloo sums in a fixed order and the resumed run starts from the
    # same bits (weights, Adam moments, data position, RNG), so the losses match exactly.
    assert read_losses(run) == want[3:]
