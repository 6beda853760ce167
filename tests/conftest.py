"""The test tiers, decided by where a test lives and what it needs, not by a marker someone must
remember:

    tests/unit/         no marker: `make test-fast` (`-m "not slow"`) runs them
    tests/distributed/  marked ``slow`` here: real gloo processes
    tests/integration/  marked ``slow`` here: the trainer and the CLI end to end
    tests/gpu/          marked ``cuda`` by their modules: `make test-gpu` (`-m cuda`)

Without CUDA the ``cuda`` tests are deselected, not skipped: a CPU run reports them as deselected
and never counts them as passed.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Tests are timed on a 2-core machine; more threads than cores only adds contention.
torch.set_num_threads(min(2, torch.get_num_threads()))

_SLOW_FOLDERS = tuple(Path(__file__).parent / name for name in ("distributed", "integration"))


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.path.is_relative_to(folder) for folder in _SLOW_FOLDERS):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    deselected = [item for item in items if item.get_closest_marker("cuda") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("cuda") is None]


@pytest.fixture
def ep_mesh(tmp_path):
    """A one-process gloo group and its 1-rank ``ep`` DeviceMesh, for DTensor expert shards in a
    unit test; destroyed after it. A group left by an earlier test is that test's bug."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized(), "an earlier test left a process group initialised"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()
