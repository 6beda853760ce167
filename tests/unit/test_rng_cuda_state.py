"""Which CUDA RNG state a resumed rank takes (``own_cuda_state``): its own device's, whatever the
number of devices the saving and the resuming processes see. The selection is plain logic over
the checkpoint's entries, checked here without a GPU; the restore itself (``torch.cuda.set_rng_state``
on the rank's device) runs on CUDA machines only."""

import torch

from moetrain.train.rng_state import own_cuda_state, rng_state_problems


def _states(*names: str) -> dict[str, torch.Tensor]:
    return {n: torch.full((4,), i, dtype=torch.uint8) for i, n in enumerate(names)}


def test_the_rank_takes_the_state_of_its_own_device():
    # This version saves the rank's own device's state, whatever the device's index.
    assert torch.equal(own_cuda_state(_states("cuda"), 3), torch.full((4,), 0, dtype=torch.uint8))
    # An older checkpoint, one entry per visible device (8 at save): rank on cuda:5 takes entry 5.
    old = _states(*(f"cuda{i}" for i in range(8)))
    assert torch.equal(own_cuda_state(old, 5), old["cuda5"])
    # A process that saw one device saved one entry: its own device's, whatever index the rank has now.
    assert torch.equal(own_cuda_state(_states("cuda0"), 6), torch.full((4,), 0, dtype=torch.uint8))
    # Two entries, neither of them this device's: not guessed.
    assert own_cuda_state(_states("cuda0", "cuda1"), 4) is None
    assert own_cuda_state(_states(), 0) is None


def test_both_formats_pass_the_checks_and_junk_does_not():
    base = {"torch": torch.zeros(8, dtype=torch.uint8), "numpy_keys": torch.zeros(624, dtype=torch.int64),
            "numpy_ints": torch.zeros(2, dtype=torch.int64), "numpy_gauss": torch.zeros(1, dtype=torch.float64),
            "python_state": torch.zeros(625, dtype=torch.int64), "python_ints": torch.zeros(2, dtype=torch.int64),
            "python_gauss": torch.zeros(1, dtype=torch.float64)}
    assert rng_state_problems({**base, **_states("cuda")}) == []
    assert rng_state_problems({**base, **_states("cuda0", "cuda1")}) == []
    assert rng_state_problems({**base, "cudax": torch.zeros(4, dtype=torch.uint8)}) == ["cudax is not an RNG state"]
