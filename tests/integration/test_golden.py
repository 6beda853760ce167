"""A change that is not about numerics leaves the loss curve of a deterministic run bit for bit
unchanged (STYLE habit 10). If this fails after a change that is meant to alter numerics,
regenerate with `python -m tests.integration.golden --write` and say so in the commit."""

from __future__ import annotations

import json

import pytest

from tests.integration.golden import GOLDEN, golden_run


@pytest.mark.slow
def test_golden_loss_curve_bit_for_bit(shakespeare_cached):
    expected = json.loads(GOLDEN.read_text())["losses_hex"]
    got = golden_run()
    assert got == expected, [(float.fromhex(a), float.fromhex(b)) for a, b in zip(expected, got)]
