"""The multi-node run of test_torchrun_launch.py: two torchrun agents on localhost, each one "node"
of 2 ranks, met through the c10d rendezvous:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        tests/distributed/workers/torchrun_nodes.py OUT_DIR

One launch serves both checks, since starting the agents and their ranks costs more than the
checks themselves. Every rank trains the LAYOUTS cases (dp=2 x ep=2) for the single-process
parity check, then takes its node layout from the launcher (LOCAL_WORLD_SIZE = 2, GROUP_RANK),
builds the hierarchical dispatcher through the config (parallel.ep_hierarchical at ep = 4) and
runs layer_worker's flat vs hierarchical comparison. It saves both to OUT_DIR/rank<r>.pt.
"""

import os
import sys

import torch
import torch.distributed as dist

# Run as a script: the repository root makes `tests.distributed` importable, as under pytest.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.distributed import ParallelDims, apply_expert_parallel
from moetrain.models.moe import MoELayer
from tests.distributed.workers.ep_parity import Case, parity_worker
from tests.distributed.workers.hierarchical_worker import NUM_EXPERTS, layer_worker

LAYOUTS = [(2, [Case("dropless"), Case("capacity_position", moe={"capacity_factor": 1.0})])]

DIM, TOKENS = 64, 24
HIERARCHICAL_SETTINGS = {
    "none_k2_dropless": {"dispatch_dtype": "none", "top_k": 2},
    "none_k2_capacity_position": {"dispatch_dtype": "none", "top_k": 2, "capacity_factor": 1.0},
    "fp8_e4m3_k4_dropless": {"dispatch_dtype": "fp8_e4m3", "top_k": 4},
}


def _hierarchical(rank: int, world: int) -> dict:
    # The user's path: the option in the config, the nodes from the launcher.
    dims = ParallelDims.from_config(ParallelConfig(ep=world, ep_hierarchical=True), world_size=world,
                                    num_experts=NUM_EXPERTS)
    dims.build_mesh("cpu")
    layer = apply_expert_parallel(torch.nn.Sequential(MoELayer(DIM, MoEConfig(num_experts=NUM_EXPERTS))), dims)[0]
    results = layer_worker(rank, world, HIERARCHICAL_SETTINGS, dim=DIM, tokens=TOKENS)
    results["config_path"] = {"ranks_per_node": dims.ranks_per_node, "hierarchical_ep": dims.hierarchical_ep,
                              "dispatcher": type(layer.dispatcher).__name__}
    return results


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results = {"parity": parity_worker(rank, world, LAYOUTS), "hierarchical": _hierarchical(rank, world)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
