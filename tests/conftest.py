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
