"""Multi-node launch: two torchrun agents on localhost (``--nnodes 2 --nproc-per-node 2``) meet
through the c10d rendezvous, and the 4 ranks run the dp=2 x ep=2 parity check."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.ep_parity import assert_parity, run_reference
from tests.distributed.torchrun_parity import LAYOUTS

SCRIPT = Path(__file__).with_name("torchrun_parity.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_node_torchrun_launch_matches_single_process(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "moetrain-test",
                      str(SCRIPT), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for _ in range(2)]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=200)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert all(a.returncode == 0 for a in agents), "\n\n".join(logs)[-6000:]

    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    nodes = [r["ep2/groups"]["node"] for r in results]
    # Each ep group (ranks 0-1, 2-3) sits on one node; data parallelism spans the two nodes.
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    for ep, cases in LAYOUTS:
        for case in cases:
            assert_parity(case, [r[f"ep{ep}/{case.name}"] for r in results], run_reference(case, 4), ep=ep)
