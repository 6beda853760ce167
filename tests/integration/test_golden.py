"""A change that is not about numerics leaves the loss curve of a deterministic run bit for bit
unchanged (STYLE habit 10).

The run and what it pins (the job's config, seed 1234, one process, one thread, and the
environment: torch 2.13.0+cpu, MKL, an x86-64 CPU with AVX-512) are described in
``tests/helpers/golden.py``. On a failure the message lists each step's golden and new loss in
decimal, both environments, and the command that regenerates the goldens
(``python -m tests.helpers.golden --write``), for a change that is meant to alter numerics.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.golden import GOLDEN, REGENERATE, golden_run, mismatch_report


@pytest.mark.slow
def test_golden_loss_curve_bit_for_bit(shakespeare_cached):
    golden = json.loads(GOLDEN.read_text())
    report = mismatch_report(golden, golden_run())
    if report is not None:
        pytest.fail(report, pytrace=False)


def test_mismatch_report_names_the_step_and_the_regenerate_command():
    golden = {"losses_hex": [(5.5).hex(), (5.25).hex()]}
    assert mismatch_report(golden, [(5.5).hex(), (5.25).hex()]) is None
    report = mismatch_report(golden, [(5.5).hex(), (5.2500001).hex()])
    assert "step 2: golden 5.250000000  this run 5.250000100   <- differs by +1.000e-07" in report
    assert "step 1: golden 5.500000000  this run 5.500000000\n" in report
    assert f"`{REGENERATE}`" in report and "0x" not in report
    assert "goldens written with: torch 2.13.0+cpu" in report
