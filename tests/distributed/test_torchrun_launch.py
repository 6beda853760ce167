"""Multi-node launch: two torchrun agents on localhost (``--nnodes 2 --nproc-per-node 2``) meet
through the c10d rendezvous; their 4 ranks run the dp=2 x ep=2 parity check against one plain
process, and the hierarchical all-to-all with the node layout taken from the launcher and the
dispatcher from the config (the same checks as test_hierarchical.py's one-layer comparison)."""

from pathlib import Path

import pytest
import torch

from tests.distributed.workers.ep_parity import assert_parity, run_reference
from tests.distributed.workers.hierarchical_worker import assert_inter_node_bytes, assert_layer_parity
from tests.distributed.workers.torchrun_agents import run_agents
from tests.distributed.workers.torchrun_nodes import DIM, HIERARCHICAL_SETTINGS, LAYOUTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "workers" / "torchrun_nodes.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("torchrun")
    run_agents(SCRIPT, str(out), rdzv_id="moetrain-test", timeout_s=280)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_two_node_torchrun_launch_matches_single_process(ranks):
    results = [r["parity"] for r in ranks]
    nodes = [r["ep2/groups"]["node"] for r in results]
    # Each ep group (ranks 0-1, 2-3) sits on one node; data parallelism spans the two nodes.
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    for ep, cases in LAYOUTS:
        for case in cases:
            assert_parity(case, [r[f"ep{ep}/{case.name}"] for r in results], run_reference(case, 4), ep=ep)


def test_hierarchical_exchange_takes_the_nodes_from_the_launcher(ranks):
    results = [r["hierarchical"] for r in ranks]
    for rank, res in enumerate(results):
        # The launcher's layout: torchrun numbers a node's ranks consecutively.
        assert res["config_path"] == {"ranks_per_node": 2, "hierarchical_ep": True,
                                      "dispatcher": "HierarchicalDispatcher"}, res["config_path"]
        layout = res["layout"]
        assert layout["nodes"] == 2 and layout["ep_rank_nodes"] == [0, 0, 1, 1]
        assert layout["node"] == rank // 2 == int(layout["group_rank"])
    for name, setting in HIERARCHICAL_SETTINGS.items():
        assert_layer_parity(results, name, setting)
        assert_inter_node_bytes(results, name, setting, dim=DIM, ranks_per_node=2)
