"""A script from ``moetrain launch slurm`` run here as Slurm would run it, on two "nodes" of one
process each (two local torchrun agents meeting at the c10d rendezvous): ``srun``, ``scancel`` and
``scontrol`` are stand-ins that do what Slurm's do (srun starts its command once a node and, as the
real one, turns a SIGTERM into SIGKILL for its tasks; ``scancel --signal`` signals every process of
the step; scontrol names this host and records a requeue), torchrun is the real one. The signal Slurm
sends before the time limit (SIGUSR1) makes the script stop the workers, which save a checkpoint at
the step they were in (each gets the SIGTERM from scancel and again from torchrun), and requeue the
job; the requeued job (the same script again) resumes there and finishes the run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import main
from tests.integration.conftest import job_overrides
from tests.integration.test_fault_tolerance import _env, _output, _records, _wait_for, _worker

# srun: one task a node, each node here a local process. Slurm's srun forwards most signals to its
# tasks, but SIGTERM and SIGHUP become SIGKILL ("forcing job termination", src/srun/signals.c).
SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
echo $$ > "$FAKE_STEP_PID"
pids=()
for _ in $(seq "$SLURM_NNODES"); do "$@" & pids+=($!); done
trap 'kill -KILL "${pids[@]}" 2>/dev/null' TERM
for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null; do wait "$p" || true; done
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit "$status"
"""
# scancel --signal=SIG JOB.STEP: the signal to every process of the step (slurmstepd signals the
# step's whole process tree): the tasks and what they started, not srun.
SCANCEL = """import os, signal, sys
sig = getattr(signal, "SIG" + sys.argv[1].split("=")[1])
root, children = int(open(os.environ["FAKE_STEP_PID"]).read()), {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        parent = int(open("/proc/" + pid + "/stat").read().rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(pid))
    except OSError:
        pass
todo = list(children.get(root, []))
while todo:
    pid = todo.pop()
    todo += children.get(pid, [])
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
"""
SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; exit 0; fi
echo "$*" >> "$SCONTROL_LOG"
"""
# torchrun, with the worker script (slowed steps) in place of `-m moetrain.cli`.
TORCHRUN = """#!/bin/bash
args=() module=0
for a in "$@"; do
    if [ "$a" = -m ]; then module=1; continue; fi
    if [ "$module" = 1 ]; then args+=("$WORKER"); module=0; continue; fi
    args+=("$a")
done
exec {python} -m torch.distributed.run "${{args[@]}}"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_slurm(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("torchrun", TORCHRUN.format(python=sys.executable)),
                       ("scancel", f"#!{sys.executable}\n{SCANCEL}")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_slurm_script_saves_requeues_before_the_time_limit_and_the_requeued_job_resumes(tmp_path,
                                                                                        shakespeare_cached):
    run_dir, script, requeues = tmp_path / "run", tmp_path / "job.sbatch", tmp_path / "scontrol.log"
    assert main(["launch", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--port", str(_free_port()),
                 "--out", str(script), *job_overrides(run_dir, steps=6, ep=2)]) == 0
    env = _env(PATH=f"{_fake_slurm(tmp_path)}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="localhost",
               SLURM_NNODES="2", SCONTROL_LOG=str(requeues), WORKER=str(_worker(tmp_path)),
               FAKE_STEP_PID=str(tmp_path / "step.pid"))

    job = subprocess.Popen(["bash", str(script)], env={**env, "FAULT_STEP_DELAY": "0.3"}, cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(lambda: len(_records(run_dir)) >= 2, timeout_s=90, proc=job, what="2 logged steps")
        job.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@180 sends
        assert job.wait(timeout=60) == 0, _output(job)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    stopped_at = _records(run_dir)[-1]["step"]
    assert 2 <= stopped_at < 6
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:09d}"
    assert requeues.read_text().split("\n")[0] == "requeue 7"

    # The requeued job: the same script, from the checkpoint just saved to the last step.
    rerun = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stdout[-4000:] + rerun.stderr[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:09d}'}" in rerun.stdout + rerun.stderr
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 7))
    assert requeues.read_text().count("requeue") == 1
