"""Parity run launched by torchrun, as test_torchrun_launch.py does it on localhost:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        tests/distributed/workers/torchrun_parity.py OUT_DIR

Every rank trains the LAYOUTS cases (dp=2 x ep=2 on 4 ranks) and saves its results to
OUT_DIR/rank<r>.pt; the test compares them with the single-process reference.
"""

import os
import sys

import torch
import torch.distributed as dist

# Run as a script: the repository root makes `tests.distributed` importable, as under pytest.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from tests.distributed.workers.ep_parity import Case, parity_worker

LAYOUTS = [(2, [Case("dropless"), Case("capacity_position", moe={"capacity_factor": 1.0})])]


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = parity_worker(dist.get_rank(), dist.get_world_size(), LAYOUTS)
        torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
