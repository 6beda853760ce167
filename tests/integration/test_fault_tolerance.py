"""Fault tolerance with real processes and real signals, sent from the test and bounded in time:

* SIGTERM to a training process: it saves at the end of the step in flight and exits 143; the
  resumed run's losses equal those of a run that never stopped, bit for bit.
* SIGKILL while a checkpoint is being written: the previous checkpoint stays loadable and
  ``latest`` keeps pointing at it.
* SIGKILL of one rank under ``torchrun --max-restarts``: the job restarts, resumes from the last
  checkpoint and ends with the weights of an uninterrupted run.
* A rank that stalls: the others fail within ``train.collective_timeout_s``, naming the phase
  and the collective, instead of hanging.
* NaN/Inf loss or gradient: the step is skipped and counted; ``train.max_consecutive_skips`` in
  a row stop the run with a checkpoint of the last good state.

A worker script (written to the test's folder) runs the real ``moetrain`` CLI, optionally slowed
down per step (so that a signal lands mid-run) or stopped inside a checkpoint write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moetrain.config.loader import load_config
from moetrain.train.checkpoint.files import CheckpointError, resolve_checkpoint
from moetrain.train.checkpoint.index import load_model_weights
from tests.helpers.dist_launcher import RankError, run_ranks
from tests.integration.conftest import job_overrides, read_losses

REPO = Path(__file__).resolve().parents[2]

WORKER = f"""
import os, sys, time
sys.path.insert(0, {str(REPO)!r})
import torch
torch.set_num_threads(1)  # bit-exact comparisons with the in-test reference runs
from moetrain.train.trainer import Trainer

delay = float(os.environ.get("FAULT_STEP_DELAY", "0"))
if delay:  # slow steps, so that the test's signal lands mid-run
    train_step = Trainer.train_step
    def slow_train_step(self):
        train_step(self)
        time.sleep(delay)
    Trainer.train_step = slow_train_step

hang = os.environ.get("FAULT_HANG_IN_SAVE")
if hang:  # the checkpoint of step `hang` stops right after its data files are written
    import torch.distributed.checkpoint as dcp
    write_data = dcp.FileSystemWriter.write_data
    def write_then_hang(self, plan, planner):
        future = write_data(self, plan, planner)
        future.wait()
        if "step_%09d" % int(hang) in str(self.path):
            open(os.environ["FAULT_READY_FILE"], "w").close()
            time.sleep(600)
        return future
    dcp.FileSystemWriter.write_data = write_then_hang

from moetrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        out = []
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written right now
                pass
        return out


def _wait_for(predicate, *, timeout_s: float, proc: subprocess.Popen | None = None, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}:\n{_output(proc)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _output(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        return "(no output)"
    return (out or "")[-6000:]


def _latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().split("_")[1]) if pointer.exists() else 0


def _fit(overrides: list[str]) -> dict:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {"run_dir": trainer.run_dir, "resumed_from": trainer.resumed_from}


def _call(rank: int, world_size: int, body, *args):
    return body(*args)


def in_child(body, *args, timeout_s: float = 120):
    """``body(*args)`` in a forked one-rank process with one thread (the workers' kernels, for
    bit-exact comparisons). Not in the test process: once a process has used gloo, ranks forked
    from it can hang in their collectives, and the tests here fork ranks."""
    return run_ranks(_call, 1, body, *args, timeout_s=timeout_s)[0]


# --- signals to whole runs -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_saves_exits_143_and_resume_is_exact(tmp_path, shakespeare_cached):
    run_dir = tmp_path / "run"
    overrides = job_overrides(run_dir, steps=10)
    proc = subprocess.Popen([sys.executable, str(_worker(tmp_path)), "train", *overrides], env=_env(
        FAULT_STEP_DELAY="0.3"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: len(_records(run_dir)) >= 3, timeout_s=60, proc=proc, what="3 logged steps")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, _output(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped_at = _records(run_dir)[-1]["step"]
    assert 3 <= stopped_at < 10
    assert _latest_step(run_dir) == stopped_at  # saved at the step it stopped at

    ref = in_child(_fit, job_overrides(tmp_path / "ref", steps=10))
    resumed = in_child(_fit, overrides)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"].name == f"step_{stopped_at:09d}"
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 11))
    assert read_losses(run_dir) == read_losses(ref["run_dir"])  # bit for bit, every step


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (Linux /proc): the launcher, torchrun and
    the ranks of one run, found by its run folder (torchrun starts each rank in a session of its own)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace") and \
                    (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # gone meanwhile
    return found


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of one rank of a run started by ``--nproc`` (found by its run folder and RANK)."""
    for pid in _processes_naming(str(run_dir)):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["launcher", "one_rank"])
def test_sigterm_under_the_nproc_launcher_stops_every_rank_with_a_checkpoint(tmp_path, shakespeare_cached, target):
    """``moetrain train --nproc 2`` signalled by PID, the launcher's (a supervisor; PID 1 of a
    container) or one rank's (a pod signalled alone): both ranks save at the same step and stop,
    the command exits 143 and leaves no process running. Before, a signalled launcher died alone
    and its ranks trained on, orphaned; a signalled rank made the command exit 1, as a failure."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "moetrain.cli", "train", "--nproc", "2",
                             *job_overrides(run_dir, steps=100_000)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: len(_records(run_dir)) >= 3, timeout_s=90, proc=proc, what="3 logged steps")
        pid = proc.pid if target == "launcher" else _rank_pid(run_dir, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, _output(proc)
        _wait_for(lambda: not _processes_naming(str(run_dir)), timeout_s=20, what="the ranks to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_naming(str(run_dir)):
            os.kill(pid, signal.SIGKILL)
    stopped_at = _records(run_dir)[-1]["step"]
    assert 3 <= stopped_at < 100_000 and _latest_step(run_dir) == stopped_at


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_during_checkpoint_write_keeps_previous(tmp_path, shakespeare_cached):
    run_dir = tmp_path / "run"
    overrides = job_overrides(run_dir, steps=6, extra=("--checkpoint.every=2",))
    ready = tmp_path / "writing"
    env = _env(FAULT_HANG_IN_SAVE="4", FAULT_READY_FILE=str(ready))
    proc = subprocess.Popen([sys.executable, str(_worker(tmp_path)), "train", *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(ready.exists, timeout_s=60, proc=proc, what="the step-4 checkpoint write")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    ckpts = run_dir / "checkpoints"
    partial = ckpts / ".step_000000004.tmp"
    assert partial.is_dir() and any(partial.glob("*.distcp")) and not (partial / "manifest.json").exists()
    assert (ckpts / "latest").read_text().strip() == "step_000000002"
    assert not (ckpts / "step_000000004").exists()
    with pytest.raises(CheckpointError, match="never finished"):
        resolve_checkpoint(partial)

    # The previous checkpoint loads: the restarted run continues from step 2 exactly as a run
    # that was never killed, and clears the debris.
    ref = in_child(_fit, job_overrides(tmp_path / "ref", steps=6))
    resumed = in_child(_fit, overrides)
    assert resumed["resumed_from"] == ckpts / "step_000000002"
    assert not partial.exists()
    assert read_losses(run_dir) == read_losses(ref["run_dir"])


def _worker_pids(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the worker processes a torchrun agent started."""
    children = set()
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        try:
            children.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    ranks = {}
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def _train_ranks(rank: int, world_size: int, overrides: list[str]) -> list[float] | None:
    _fit(overrides)
    return read_losses(Path(load_config(None, overrides).log.run_dir)) if rank == 0 else None


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torchrun_restarts_after_rank_sigkill_and_ends_with_uninterrupted_weights(tmp_path,
                                                                                   shakespeare_cached):
    run_dir = tmp_path / "run"
    overrides = job_overrides(run_dir, steps=12, ep=2,
                              extra=("--checkpoint.every=3", "--checkpoint.keep_last=0"))
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.2",
           str(_worker(tmp_path)), "train", *overrides]
    agent = subprocess.Popen(cmd, env=_env(FAULT_STEP_DELAY="0.25"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # Kill rank 1 between checkpoints: steps after the latest one are lost and redone.
        def past_a_checkpoint():
            latest, logged = _latest_step(run_dir), _records(run_dir)
            return latest >= 3 and logged and logged[-1]["step"] >= latest + 1
        _wait_for(past_a_checkpoint, timeout_s=90, proc=agent, what="a checkpoint and one more step")
        killed_after = _records(run_dir)[-1]["step"]
        workers = _worker_pids(agent.pid)
        assert set(workers) == {0, 1}, workers
        os.kill(workers[1], signal.SIGKILL)
        out, _ = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert agent.returncode == 0, out[-6000:]
    assert "resumed from" in out, out[-6000:]
    assert killed_after < 12

    ref_dir = tmp_path / "ref"
    ref_losses = run_ranks(_train_ranks, 2, job_overrides(ref_dir, steps=12, ep=2), timeout_s=90)[0]
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 13))
    assert read_losses(run_dir) == ref_losses
    got, _ = load_model_weights(run_dir / "checkpoints" / "step_000000012")
    want, _ = load_model_weights(ref_dir / "checkpoints" / "step_000000012")
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ


# --- a stalled rank --------------------------------------------------------------------------------


def _stall(rank: int, world_size: int, overrides: list[str], stall_s: float) -> None:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    if rank == 1:
        train_step = trainer.train_step

        def stalling_train_step():
            if trainer.step == 2:
                time.sleep(stall_s)  # the "deadlock": this rank never reaches step 3's all-to-all
            train_step()

        trainer.train_step = stalling_train_step
    trainer.fit()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_stalled_rank_fails_the_others_within_the_collective_timeout(tmp_path, shakespeare_cached):
    overrides = job_overrides(tmp_path / "run", steps=4, ep=2, extra=("--train.collective_timeout_s=3",))
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        # run_ranks' own limit (60 s) is far above the collective timeout: a hang would show as
        # a TimeoutError, not as rank 0's error.
        run_ranks(_stall, 2, overrides, 120.0, timeout_s=60)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert "rank 0 of 2 failed" in message
    assert "CollectiveError" in message
    assert ("did not complete within train.collective_timeout_s=3 s during forward/backward of step 3"
            in message)
    # The operation: the expert dispatch's count exchange.
    assert "torch.distributed.all_to_all_single" in message and "_exchange_counts" in message
    assert elapsed < 45, elapsed


# --- non-finite steps ------------------------------------------------------------------------------


def test_nonfinite_loss_step_is_skipped_and_counted(tmp_path, shakespeare_cached):
    in_child(_nonfinite_loss_step_skipped, tmp_path)


def _nonfinite_loss_step_skipped(tmp_path):
    from moetrain.train.trainer import Trainer

    clean = _fit(job_overrides(tmp_path / "clean", steps=2))

    trainer = Trainer(load_config(None, job_overrides(tmp_path / "nan", steps=3)))

    def poison_loss(module, args, output):
        return output * float("nan") if trainer.step == 2 else output  # during step 3

    trainer.model.output.register_forward_hook(poison_loss)
    try:
        trainer.fit()
    finally:
        trainer.close()
    records = _records(tmp_path / "nan")
    assert [r["skipped_steps"] for r in records] == [0, 0, 1]
    assert records[2]["skipped_steps_total"] == 1 and records[2]["loss"] != records[2]["loss"]  # NaN
    # The skipped step changed nothing: the weights after step 3 are those after step 2.
    got, state = load_model_weights(tmp_path / "nan" / "checkpoints" / "step_000000003")
    want, _ = load_model_weights(clean["run_dir"] / "checkpoints" / "step_000000002")
    assert state["skipped_total"] == 1
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_consecutive_nonfinite_steps_stop_with_last_good_checkpoint(tmp_path, shakespeare_cached):
    in_child(_consecutive_nonfinite_steps_stop, tmp_path)


def _consecutive_nonfinite_steps_stop(tmp_path):
    from moetrain.train.faults import NonFiniteError
    from moetrain.train.trainer import Trainer

    clean = _fit(job_overrides(tmp_path / "clean", steps=6, extra=("--checkpoint.every=1",
                                                                         "--checkpoint.keep_last=0")))
    overrides = job_overrides(tmp_path / "nan", steps=10, extra=("--train.max_consecutive_skips=3",))
    trainer = Trainer(load_config(None, overrides))
    weight = trainer.model.norm.weight
    weight.register_hook(lambda g: g * float("inf") if trainer.step in (4, 5, 6) else g)  # steps 5-7
    try:
        with pytest.raises(NonFiniteError, match=r"steps 5-7 all had a non-finite loss or gradient.*"
                                                 r"last good state \(after step 4\) is in .*step_000000004"):
            trainer.fit()
    finally:
        trainer.close()
    ckpts = tmp_path / "nan" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000000004"
    assert [r["skipped_steps_total"] for r in _records(tmp_path / "nan")] == [0, 0, 0, 0, 1, 2, 3]
    got, state = load_model_weights(ckpts / "step_000000004")
    want, want_state = load_model_weights(clean["run_dir"] / "checkpoints" / "step_000000004")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert state["step"] == 4
    assert state["data"] == want_state["data"] and state["scheduler"] == want_state["scheduler"]

    # Resuming from it (problem gone) continues exactly like the clean run.
    _fit(overrides)
    assert read_losses(tmp_path / "nan")[4:6] == read_losses(clean["run_dir"])[4:6]
