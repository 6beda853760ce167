"""torchrun agents on localhost for the multi-node tests: each agent is one "node"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> list[str]:
    """The torchrun of this interpreter's environment."""
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def run_agents(script: Path, *args: str, num_nodes: int = 2, nproc_per_node: int = 2, rdzv_id: str,
               timeout_s: float = 200) -> None:
    """``num_nodes`` agents meeting through a c10d rendezvous, each starting ``nproc_per_node`` ranks
    of ``script``; raises with the agents' output unless every agent exits 0."""
    cmd = torchrun() + ["--nnodes", str(num_nodes), "--nproc-per-node", str(nproc_per_node),
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                        "--rdzv-id", rdzv_id, str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for _ in range(num_nodes)]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=timeout_s)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert all(a.returncode == 0 for a in agents), "\n\n".join(logs)[-6000:]
