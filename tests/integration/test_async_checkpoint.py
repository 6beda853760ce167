"""``checkpoint.async_save``: checkpoints written by a background thread, with real ranks and real
signals.

* Two gloo ranks at ep=2 (expert weights are DTensors): the checkpoints an async run publishes
  hold exactly the tensors of a synchronous run's (every model, optimizer, RNG entry and the
  trainer state but its wall time); a write that fails on one rank stops both ranks at the same
  step with the write's error, and nothing of that step is published.
* SIGKILL while the background thread writes: the checkpoint published before stays ``latest``,
  and the run resumed from it (an async-saved checkpoint) continues bit for bit as a synchronous
  run that never stopped.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.config.loader import load_config
from moetrain.train.checkpoint.index import SafeReader, saved_like, tensor_text
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses
from tests.integration.test_fault_tolerance import _env, _fit, _output, _records, _wait_for, _worker, in_child

ASYNC = "--checkpoint.async_save=true"


def _entries(path: Path) -> dict[str, object]:
    """Every entry of a checkpoint, read in this process alone; the trainer state as JSON
    without its wall time and the job config (its run folder and checkpoint.async_save differ)."""
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    state = {k: saved_like(metadata, k) for k, md in metadata.state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    out: dict[str, object] = dict(state)
    trainer = json.loads(tensor_text(state["trainer"]))
    trainer.pop("time")
    trainer.pop("config")
    out["trainer"] = trainer
    return out


def _same_entries(a: Path, b: Path) -> None:
    ea, eb = _entries(a), _entries(b)
    assert sorted(ea) == sorted(eb)
    for key, value in ea.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, eb[key]), key  # type: ignore[arg-type]
        else:
            assert value == eb[key], key


def _fit_in_group(overrides: list[str]):
    """A whole run in the launcher's process group, left open for the next run (``close`` would
    destroy it)."""
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
    return trainer


def _async_and_sync_runs(rank: int, world_size: int, root: Path) -> tuple[int, str] | None:
    def job(name: str, *extra: str) -> list[str]:
        return job_overrides(root / name, steps=4, ep=2, extra=("--checkpoint.every=2", "--checkpoint.keep_last=0",
                                                                 *extra))

    _fit_in_group(job("sync"))
    _fit_in_group(job("async", ASYNC))
    # Rank 1 alone fails to write the step-2 checkpoint.
    write_data = dcp.FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        if rank == 1 and "step_000000002" in str(self.path):
            raise OSError("no space left on device (injected)")
        return write_data(self, plan, planner)

    dcp.FileSystemWriter.write_data = failing_write  # type: ignore[method-assign]
    try:
        trainer = None
        from moetrain.train.trainer import Trainer

        trainer = Trainer(load_config(None, job("failing", ASYNC)))
        trainer.fit()
    except RuntimeError as e:
        assert trainer is not None
        return trainer.step, str(e)
    finally:
        dcp.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    return None


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_async_checkpoints_equal_sync_ones_and_a_failed_write_stops_every_rank(tmp_path, shakespeare_cached):
    failures = run_ranks(_async_and_sync_runs, 2, tmp_path, timeout_s=140)
    for step in (2, 4):
        name = f"step_{step:09d}"
        _same_entries(tmp_path / "async" / "checkpoints" / name, tmp_path / "sync" / "checkpoints" / name)
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text().strip() == "step_000000004"

    # Both ranks raise, at the same step, with the failed rank's message and the step it saved.
    assert all(f is not None for f in failures), failures
    assert failures[0][0] == failures[1][0] and 2 <= failures[0][0] <= 4, failures
    for _, message in failures:
        assert "checkpoint of step 2" in message and "checkpoint.async_save" in message, message
        assert "no space left on device (injected)" in message, message
    ckpts = tmp_path / "failing" / "checkpoints"
    assert not (ckpts / "step_000000002").exists() and not (ckpts / "latest").exists()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkill_during_async_write_keeps_published_and_resume_is_exact(tmp_path, shakespeare_cached):
    run_dir = tmp_path / "run"
    overrides = job_overrides(run_dir, steps=6, extra=("--checkpoint.every=2", ASYNC))
    ready = tmp_path / "writing"
    # The background write of step 4 stops once its data files are written; training goes on
    # until the step-6 save waits for it.
    env = _env(FAULT_HANG_IN_SAVE="4", FAULT_READY_FILE=str(ready))
    proc = subprocess.Popen([sys.executable, str(_worker(tmp_path)), "train", *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(ready.exists, timeout_s=60, proc=proc, what="the background write of step 4")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _records(run_dir), _output(proc)
    ckpts = run_dir / "checkpoints"
    partial = ckpts / ".step_000000004.tmp"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert (ckpts / "latest").read_text().strip() == "step_000000002"
    assert not (ckpts / "step_000000004").exists()

    # The async-saved step-2 checkpoint resumes (here with synchronous saves) exactly as a
    # synchronous run that never stopped.
    ref = in_child(_fit, job_overrides(tmp_path / "ref", steps=6, extra=("--checkpoint.every=2",)))
    resumed = in_child(_fit, job_overrides(run_dir, steps=6, extra=("--checkpoint.every=2",)))
    assert resumed["resumed_from"] == ckpts / "step_000000002"
    assert not partial.exists()
    assert read_losses(run_dir) == read_losses(ref["run_dir"])
    _same_entries(ckpts / "step_000000006", tmp_path / "ref" / "checkpoints" / "step_000000006")
