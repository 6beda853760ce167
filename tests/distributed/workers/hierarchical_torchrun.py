"""The hierarchical all-to-all across two torchrun agents on localhost, as test_hierarchical.py
launches it:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        tests/distributed/workers/hierarchical_torchrun.py OUT_DIR

The 4 ranks take their node layout from the launcher (LOCAL_WORLD_SIZE = 2, GROUP_RANK), build the
dispatcher through the config (parallel.ep_hierarchical at ep = 4), run layer_worker's flat vs
hierarchical comparison and save their results to OUT_DIR/rank<r>.pt for the test to check.
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
from tests.distributed.workers.hierarchical_worker import NUM_EXPERTS, layer_worker

DIM, TOKENS = 64, 24
SETTINGS = {"none_k2_dropless": {"dispatch_dtype": "none", "top_k": 2},
            "none_k2_capacity_position": {"dispatch_dtype": "none", "top_k": 2, "capacity_factor": 1.0},
            "fp8_e4m3_k4_dropless": {"dispatch_dtype": "fp8_e4m3", "top_k": 4}}


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        # The user's path: the option in the config, the nodes from the launcher.
        dims = ParallelDims.from_config(ParallelConfig(ep=world, ep_hierarchical=True), world_size=world,
                                        num_experts=NUM_EXPERTS)
        dims.build_mesh("cpu")
        layer = apply_expert_parallel(torch.nn.Sequential(MoELayer(DIM, MoEConfig(num_experts=NUM_EXPERTS))), dims)[0]
        results = layer_worker(rank, world, SETTINGS, dim=DIM, tokens=TOKENS)
        results["config_path"] = {"ranks_per_node": dims.ranks_per_node, "hierarchical_ep": dims.hierarchical_ep,
                                  "dispatcher": type(layer.dispatcher).__name__}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
