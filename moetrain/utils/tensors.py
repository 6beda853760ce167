"""Tensor helpers shared by the model and the distributed code (the bottom layer: imports torch only)."""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor
    _HAS_DTENSOR = True
except ImportError:  # a torch build without distributed support has no DTensor to unwrap
    _HAS_DTENSOR = False


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (differentiable, as
    ``DTensor.to_local``), or ``t`` itself."""
    return t.to_local() if _HAS_DTENSOR and isinstance(t, DTensor) else t
