"""The CUDA tier (`make test-gpu`, run first by benchmarks/gpu.sh): what CPU runs cannot reach.
Every module here is marked ``cuda``; tests/conftest.py deselects them where torch sees no GPU.

A one-rank NCCL world, built as ``moetrain.distributed.runtime`` builds it at ``--nproc 1`` (an
in-memory store, no port), so the all-to-all dispatcher, DeviceMesh and FSDP2 run over NCCL on
CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def device() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@pytest.fixture(scope="session")
def nccl_world(device):
    """The default process group: NCCL, world size 1, on ``device``."""
    if dist.is_initialized():
        assert dist.get_backend() == "nccl" and dist.get_world_size() == 1, \
            f"a {dist.get_backend()} group of {dist.get_world_size()} was left initialised by another test"
        yield dist.group.WORLD
        return
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
