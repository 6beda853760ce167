"""An unusable ``checkpoint.dir`` stops the run before step 1, as one error line (exit 2) naming the
field: found at the first save instead, the ``checkpoint.every`` steps before it would be lost with
a traceback. Checked by rank 0 for every rank of a job, and by the ``--nproc`` launcher before it
starts any rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides

ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    below_a_file = tmp_path / "a_file" / "ck"  # mkdir fails: its parent is a file
    (tmp_path / "a_file").write_text("")
    cmd = [sys.executable, "-m", "moetrain.cli", "train", *args,
           *job_overrides(run_dir, steps=4, extra=("--checkpoint.every=2", f"--checkpoint.dir={below_a_file}"))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)


def _error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("moetrain: error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def _losses(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [r for r in map(json.loads, filter(str.strip, metrics.read_text().splitlines())) if "loss" in r]


def test_an_unwritable_checkpoint_dir_stops_the_run_before_step_1(tmp_path, shakespeare_cached):
    run_dir = tmp_path / "run"
    line = _error_line(_train(tmp_path, run_dir))
    assert "checkpoint.dir (" in line and "cannot be written" in line and "Not a directory" in line, line
    assert _losses(run_dir) == []  # no step was trained


def test_the_nproc_launcher_refuses_it_before_starting_the_ranks(tmp_path):
    run_dir = tmp_path / "run"
    line = _error_line(_train(tmp_path, run_dir, "--nproc", "2"))
    assert "checkpoint.dir (" in line and "cannot be written" in line, line
    assert not run_dir.exists()  # no rank started: the ranks create the run folder first


def _rank_sees(rank: int, world_size: int, run_dir: Path, checkpoint_dir: str) -> str:
    from moetrain.train.checkpoint.files import prepare_checkpoint_folder

    try:
        prepare_checkpoint_folder(run_dir, checkpoint_dir if rank == 0 else str(run_dir / "elsewhere"))
    except ValueError as e:
        return str(e)
    return "no error"


def test_every_rank_raises_rank_0s_error(tmp_path):
    (tmp_path / "a_file").write_text("")
    # Only rank 0 tests the folder (here the others are even given a usable one): all raise its error.
    seen = run_ranks(_rank_sees, 2, tmp_path, str(tmp_path / "a_file" / "ck"))
    assert seen[0] == seen[1] and seen[0].startswith(f"checkpoint.dir ({str(tmp_path / 'a_file' / 'ck')!r})")
    assert not (tmp_path / "elsewhere").exists()
