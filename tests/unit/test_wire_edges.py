"""The fp8_e4m3 wire (``wire.pack_e4m3``/``unpack_e4m3``) on blocks whose scale ``amax / 448``
underflows fp32: no NaN, and each element back within e4m3's rounding of it, judged against the
fp32 input (a block's elements are at most amax, so a scale-1 block that rounds them to 0 is off by
less than 224 fp32 subnormal steps)."""

import pytest
import torch

from moetrain.distributed.expert_parallel.wire import pack_e4m3, unpack_e4m3

SUBNORMAL_STEP = 2.0**-149
"""The smallest positive fp32 value: ``amax / 448`` rounds to 0 below 224 of them (about 3.1e-43)."""


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    return unpack_e4m3(pack_e4m3(x), x.shape[1], torch.float32)


def _assert_within_rounding(x: torch.Tensor, y: torch.Tensor) -> None:
    """Every element back within 2^-4 of itself (3 mantissa bits) or, for elements too small for
    the block's scale, within the underflow bound; zeros back exactly."""
    assert not y.isnan().any(), y
    err = (y.double() - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0**-4, torch.full_like(err, 224 * SUBNORMAL_STEP))
    assert (err <= bound).all(), (x, y)
    assert (y[x == 0] == 0).all()


@pytest.mark.parametrize("amax", [1e-43, SUBNORMAL_STEP, 223 * SUBNORMAL_STEP])
def test_block_whose_scale_underflows_round_trips_without_nan(amax):
    x = torch.zeros(3, 8)
    x[0, 0], x[1, 3], x[1, 5] = amax, -amax, amax / 2
    x[2] = torch.tensor([1.0, -2.0, 3.0, 0.0, 0.5, 0.0, 7.0, -1.0])  # a normal row beside them
    y = _round_trip(x)
    _assert_within_rounding(x, y)
    assert torch.equal(y[2], x[2])  # exact in e4m3 at scale 7 / 448


def test_underflowing_block_leaves_the_row_s_other_blocks_alone():
    # D = 256: two scale blocks; the first underflows, the second is ordinary.
    x = torch.zeros(2, 256)
    x[:, 0] = 1e-43
    x[:, 128:] = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))
    y = _round_trip(x)
    _assert_within_rounding(x, y)
    assert (y[:, 128:] != 0).sum() > 200  # the ordinary block kept its own scale


def test_flushed_subnormal_scale_gives_no_nan():
    # With denormals flushed (torch.set_flush_denormal, on CPUs that support it) amax / 448 is 0
    # for any amax below 448 fp32 normals, ~5e-36: a row of 1e-37 must still come back without NaN.
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        x = torch.zeros(1, 8)
        x[0, :2] = torch.tensor([1e-37, -5e-38])
        y = _round_trip(x)
    finally:
        torch.set_flush_denormal(False)
    assert not y.isnan().any(), y
    assert (y.abs() <= 1e-37).all() and (y[0, 2:] == 0).all()
