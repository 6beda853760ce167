"""The random-number generator states of one process as tensors, so that a checkpoint stores them
as data and loading one never unpickles anything.

    torch          uint8 [N]     ``torch.get_rng_state()``
    cuda           uint8 [N]     ``torch.cuda.get_rng_state()``: this rank's own device's, when CUDA is
                                 in use (not every visible device's: a resume may see fewer or more)
    numpy_keys     int64 [624]   numpy's MT19937 key (uint32 values)
    numpy_ints     int64 [2]     its position and has-gauss flag
    numpy_gauss    float64 [1]   its cached Gaussian
    python_state   int64 [625]   ``random.getstate()[1]``: the MT19937 words and position
    python_ints    int64 [2]     the state's version and whether a Gaussian is cached
    python_gauss   float64 [1]   the cached Gaussian (0.0 when there is none)

Every value converts to and from its tensor exactly (uint32 and small ints in int64, doubles in
float64), so a resumed run draws the same numbers as one that never stopped. Checkpoints of earlier
versions hold ``cuda<i>`` per visible device instead; ``own_cuda_state`` picks the rank's from them.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from moetrain.utils.seeds import derived_seed

log = logging.getLogger("moetrain")

_MT_WORDS = 624
# name -> (dtype, shape); the cuda / cuda<i> entries are optional and checked apart.
_LAYOUT = {
    "torch": (torch.uint8, None),
    "numpy_keys": (torch.int64, (_MT_WORDS,)),
    "numpy_ints": (torch.int64, (2,)),
    "numpy_gauss": (torch.float64, (1,)),
    "python_state": (torch.int64, (_MT_WORDS + 1,)),
    "python_ints": (torch.int64, (2,)),
    "python_gauss": (torch.float64, (1,)),
}


def capture_rng_state() -> dict[str, torch.Tensor]:
    """This process's torch, CUDA, numpy and Python RNG states as tensors (see the module docstring)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    assert kind == "MT19937", kind  # numpy's legacy global generator is always MT19937
    version, words, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_ints": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached_gaussian], dtype=torch.float64),
        "python_state": torch.tensor(words, dtype=torch.int64),
        "python_ints": torch.tensor([version, gauss_next is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss_next is None else gauss_next], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: the rank's (runtime sets it)
    return state


def own_cuda_state(state: dict[str, torch.Tensor], device_index: int) -> torch.Tensor | None:
    """The CUDA RNG state ``state`` holds for the rank's device ``device_index``: its ``cuda`` entry;
    in an older checkpoint's ``cuda<i>`` per visible device, entry ``device_index``, or the only
    entry (the saving process saw one device, its own); None when it cannot tell."""
    if "cuda" in state:
        return state["cuda"]
    per_device = {int(name[4:]): t for name, t in state.items() if name.startswith("cuda") and name[4:].isdigit()}
    if device_index in per_device:
        return per_device[device_index]
    return next(iter(per_device.values())) if len(per_device) == 1 else None


def rng_state_problems(state: dict[str, torch.Tensor]) -> list[str]:
    """What keeps ``state`` from being restored: missing, unexpected or mis-typed entries."""
    problems = []
    for name, (dtype, shape) in _LAYOUT.items():
        t = state.get(name)
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name} is missing")
        elif t.dtype != dtype or t.dim() != 1 or (shape is not None and tuple(t.shape) != shape):
            want = f"{dtype} {list(shape) if shape else '[N]'}"
            problems.append(f"{name} is {t.dtype} {list(t.shape)}, expected {want}")
    for name, t in state.items():
        if name in _LAYOUT:
            continue
        if not (name.startswith("cuda") and (name[4:].isdigit() or name == "cuda")):
            problems.append(f"{name} is not an RNG state")
        elif not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            problems.append(f"{name} is not a uint8 vector")
    return problems


def seed_rng_state(seed: int, rank: int) -> None:
    """Seed this process's torch (CPU and every CUDA device), numpy and Python RNGs from ``(seed,
    rank)``: what a fresh run draws at random (dropout masks) then repeats run after run, and each
    rank draws its own numbers. torch seeds a new process at random, so without it no two runs of
    a job with dropout are the same."""
    value = derived_seed(f"{seed}/rank{rank}")
    torch.manual_seed(value)
    np.random.seed(value % 2**32)
    random.seed(value)


def restore_rng_state(state: dict[str, torch.Tensor], *, seed: int = 0, rank: int = 0) -> None:
    """Set this process's RNGs to ``state`` (from ``capture_rng_state``, possibly saved and loaded).
    An older checkpoint's CUDA states that name no device of this rank's leave its CUDA generator
    seeded from ``(seed, rank)`` as a fresh run's, with a warning."""
    problems = rng_state_problems(state)
    if problems:
        raise ValueError("cannot restore the RNG state: " + "; ".join(problems))
    numpy_ints, python_ints = state["numpy_ints"].tolist(), state["python_ints"].tolist()
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), numpy_ints[0],
                         numpy_ints[1], state["numpy_gauss"].item()))
    gauss_next = state["python_gauss"].item() if python_ints[1] else None
    random.setstate((python_ints[0], tuple(state["python_state"].tolist()), gauss_next))
    if torch.cuda.is_available() and any(name.startswith("cuda") for name in state):
        device = torch.cuda.current_device()
        cuda = own_cuda_state(state, device)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        else:
            log.warning("the checkpoint's CUDA RNG states (%s) name none of this rank's device (cuda:%d): it is "
                        "seeded as in a fresh run", sorted(n for n in state if n.startswith("cuda")), device)
            torch.cuda.manual_seed(derived_seed(f"{seed}/rank{rank}"))
