"""Multi-node launch: two torchrun agents on localhost (``--nnodes 2 --nproc-per-node 2``) meet
through the c10d rendezvous, and the 4 ranks run the dp=2 x ep=2 parity check."""

from pathlib import Path

import pytest
import torch

from tests.distributed.workers.ep_parity import assert_parity, run_reference
from tests.distributed.workers.torchrun_agents import run_agents
from tests.distributed.workers.torchrun_parity import LAYOUTS

SCRIPT = Path(__file__).parent / "workers" / "torchrun_parity.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_node_torchrun_launch_matches_single_process(tmp_path):
    run_agents(SCRIPT, str(tmp_path), rdzv_id="moetrain-test")

    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    nodes = [r["ep2/groups"]["node"] for r in results]
    # Each ep group (ranks 0-1, 2-3) sits on one node; data parallelism spans the two nodes.
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    for ep, cases in LAYOUTS:
        for case in cases:
            assert_parity(case, [r[f"ep{ep}/{case.name}"] for r in results], run_reference(case, 4), ep=ep)
