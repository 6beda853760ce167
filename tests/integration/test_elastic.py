"""Elastic membership under ``torchrun --nnodes 1:2``: a node lost, a node added, the run goes on.

Three torchrun agents on localhost (one process each) share a c10d rendezvous, whose store the
test hosts. Agents A and B
start the job at world 2; once a checkpoint exists, B is killed (a lost node): A's process fails on
its next collective, A restarts it, the rendezvous closes with one node, and the run resumes from
the latest checkpoint at world 1 (two micro-batches per step instead of one). Once that has
saved a checkpoint, agent C joins: A restarts its process for the new membership, and the run
resumes at world 2 and finishes.

The reference is the same job run uninterrupted at world 2. With the global batch kept, and the
load-balancing loss off (it is computed per micro-batch, so another accumulation changes it),
the final weights are equal, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moetrain.train.checkpoint.index import load_model_weights
from tests.distributed.workers.torchrun_agents import free_port, torchrun
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

# World 1 trains on until C has joined: the run resumed at world 2 at steps 52-59 in four runs, C
# starting at the step-30 checkpoint; STEPS leaves more than twice those ~25 steps as margin.
STEPS = 120
EXTRA = ("--moe.aux_loss_coef=0", "--train.deterministic=true", "--checkpoint.every=10",
         "--checkpoint.keep_last=20", "--train.collective_timeout_s=60")


def _agent(port: int, run_dir: Path, log: Path) -> subprocess.Popen:
    cmd = torchrun() + ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "moetrain-elastic",
                      # keep_alive_*: the lost node's rendezvous heartbeat counts as dead after 8 s, not
                      # torch's 3 x 5 s (A would wait that long before its restart at world 1); not less,
                      # so that a live agent starved of CPU on a loaded machine is not taken for dead.
                      "--rdzv-conf", "is_host=false,last_call_timeout=2,join_timeout=120,keep_alive_interval=1,"
                      "keep_alive_max_attempt=8", "--max-restarts", "4",
                      "--monitor-interval", "0.5", "-m", "moetrain.cli", "train",
                      *job_overrides(run_dir, steps=STEPS, extra=EXTRA)]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the shared store (torch's default), an agent that
    # stays rank 0 across rounds does not publish the master address again, and a joining node
    # waits for it until the join times out (torch 2.13).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_node(agent: subprocess.Popen) -> None:
    """The agent and its workers die at once, as with a lost node."""
    for pid in [agent.pid, *_descendants(agent.pid)]:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(condition, what: str, logs: list[Path], timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.2)


def _checkpoints(run_dir: Path) -> list[int]:
    ckpts = run_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in ckpts.glob("step_*")) if ckpts.exists() else []


def _events(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if r.get("event") == "world_size_changed"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lost_and_added_node_resume_at_the_new_world_size_with_the_same_result(tmp_path, shakespeare_cached):
    # The reference only needs its final checkpoint (saved at the end whatever checkpoint.every says).
    reference_run = job_overrides(tmp_path / "ref", steps=STEPS, extra=(*EXTRA, "--checkpoint.every=0"))
    run_ranks(train_job, 2, reference_run, timeout_s=300)

    run_dir, port = tmp_path / "elastic", free_port()
    # The rendezvous store outlives every node, as `moetrain launch store` in the k8s manifest of
    # an elastic job: no agent hosts it, so losing one loses no state.
    store = subprocess.Popen([sys.executable, "-m", "moetrain.cli", "launch", "store", f"--port={port}"],
                             stdout=subprocess.PIPE, text=True)
    assert store.stdout is not None and "listening" in store.stdout.readline()
    logs = [tmp_path / f"agent_{n}.log" for n in "abc"]
    a, b = _agent(port, run_dir, logs[0]), _agent(port, run_dir, logs[1])
    agents = [a, b]
    try:
        _wait_for(lambda: any(s >= 20 for s in _checkpoints(run_dir)), "a checkpoint at world 2", logs)
        _kill_node(b)
        b.wait(timeout=30)
        _wait_for(lambda: len(_events(run_dir)) >= 1, "the restart at world 1", logs)
        resumed_at = _events(run_dir)[0]["step"]
        _wait_for(lambda: any(s > resumed_at for s in _checkpoints(run_dir)), "a checkpoint at world 1", logs)
        c = _agent(port, run_dir, logs[2])
        agents.append(c)
        for agent in (a, c):
            agent.wait(timeout=300)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)
        store.terminate()
        assert store.wait(timeout=30) == 0  # SIGTERM stops it cleanly
    tails = "\n\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    assert a.returncode == 0 and c.returncode == 0, tails

    events = _events(run_dir)
    assert [(e["world_size_before"], e["world_size"], e["grad_accum"]) for e in events] == [(2, 1, 2), (1, 2, 1)]
    assert events[0]["step"] < events[1]["step"] < STEPS  # the world-1 phase trained and saved
    final, _ = load_model_weights(run_dir / "checkpoints" / f"step_{STEPS:09d}")
    reference, _ = load_model_weights(tmp_path / "ref" / "checkpoints" / f"step_{STEPS:09d}")
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name
