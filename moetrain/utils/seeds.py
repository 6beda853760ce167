"""Seeds derived from a string key (a run's seed plus what the numbers are for): the same key gives
the same numbers in every process and layout, different keys independent streams."""

from __future__ import annotations

import hashlib

import torch


def derived_seed(key: str) -> int:
    """A 63-bit seed from ``key`` (blake2b, so unrelated keys give unrelated seeds)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_generator(key: str) -> torch.Generator:
    """A CPU generator seeded from ``key``, independent of the global RNG."""
    return torch.Generator().manual_seed(derived_seed(key))
