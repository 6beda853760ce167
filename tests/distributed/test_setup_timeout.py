"""The process group a job starts with waits ``runtime.SETUP_TIMEOUT`` for rank 0's data
preparation, whatever the backend's own default (NCCL's is 10 minutes), and
``set_collective_timeout`` then sets the training timeout on it. Two gloo processes joined by
``init_runtime``'s own rendezvous (env://), as torchrun starts them."""

import pytest

from tests.helpers.dist_launcher import run_ranks
from tests.integration.test_cluster_launch_run import _free_port

pytestmark = pytest.mark.timeout(60)


def _rendezvous(rank, world_size, port):
    import os

    import torch
    import torch.distributed as dist

    from moetrain.distributed import ParallelDims
    from moetrain.distributed.runtime import init_runtime, set_collective_timeout

    dist.destroy_process_group()  # the launcher's; init_runtime joins its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_runtime(device="cpu", backend="gloo", deterministic=False)

    def world_timeout_s() -> float:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    setup = world_timeout_s()
    dims = ParallelDims(world_size=world_size)
    dims.build_mesh("cpu")
    set_collective_timeout(42.0, dims)
    return setup, world_timeout_s()


def test_the_world_group_waits_the_setup_timeout_then_the_training_one():
    from moetrain.distributed.runtime import SETUP_TIMEOUT

    port = _free_port()
    assert SETUP_TIMEOUT.total_seconds() >= 3600
    assert run_ranks(_rendezvous, 2, port, timeout_s=50) == [(SETUP_TIMEOUT.total_seconds(), 42.0)] * 2
