"""moe.dispatch_dtype without processes: e4m3 quantisation against fp32 on hand-checked values
and within the bound of its 3 mantissa bits, the wire sizes, the integer metadata encoding, the
byte counters, the config check, and the measured e4m3-vs-bf16 error on a backward payload.

The bound: a normal e4m3 value 2^e * 1.m has 3 mantissa bits, so neighbours are 2^(e-3) apart and
rounding to nearest moves a value by at most 2^(e-4) <= 2^-4 of itself. Below e4m3's smallest
normal (2^-6, scaled: 2^-6 * amax / 448) the spacing is the subnormal step 2^-9: the absolute
error is at most 2^-10 * scale.
"""

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.distributed.comm.stats import CommStats
from moetrain.distributed.expert_parallel.wire import (
    E4M3_MAX,
    dequantize_e4m3,
    int_wire_dtype,
    ints_from_bytes,
    ints_to_bytes,
    num_scale_blocks,
    pack_e4m3,
    quantize_e4m3,
    unpack_e4m3,
    wire_row_bytes,
)
from moetrain.models.moe import MoELayer


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    return unpack_e4m3(pack_e4m3(x), x.shape[1], torch.float32)


def test_amax_maps_to_448_and_representable_values_survive_exactly():
    # e4m3 values: 448 = 1.75 * 2^8, 1.125 = 1.001b, 2^-9 is the smallest subnormal.
    exact = torch.tensor([[448.0, -448.0, 1.0, -1.125, 0.5, 240.0, 2.0**-6, 2.0**-9]])
    q, scale = quantize_e4m3(exact)
    assert scale.tolist() == [[1.0]]
    assert torch.equal(q.float(), exact)
    assert torch.equal(_round_trip(exact), exact)
    # A power-of-two multiple keeps the scale exact (56 / 448 = 2^-3), so the values survive too.
    small = exact * 2.0**-3
    assert quantize_e4m3(small)[1].tolist() == [[2.0**-3]]
    assert torch.equal(_round_trip(small), small)
    # Any amax maps to 448: the largest element comes back to within fp32 rounding.
    row = torch.tensor([[3.0, -1.0, 0.25]])
    q, scale = quantize_e4m3(row)
    assert q.float()[0, 0].item() == E4M3_MAX and scale.item() == pytest.approx(3.0 / 448, rel=1e-7)
    assert _round_trip(row)[0, 0].item() == pytest.approx(3.0, rel=1e-6)


def test_rounding_to_nearest_even_by_hand():
    # Scale 1 (amax 448). In [256, 448) the step is 32: 300 -> 288. In [16, 32) the step is 2:
    # 17 and 19 are ties and go to the even mantissa (16 = 1.000b, 20 = 1.010b); 17.5 -> 18.
    row = torch.tensor([[448.0, 300.0, 17.0, 19.0, 17.5, 2.0**-10, 3 * 2.0**-10]])
    assert _round_trip(row).tolist() == [[448.0, 288.0, 16.0, 20.0, 18.0, 0.0, 2.0**-8]]


@pytest.mark.parametrize("dim", [16, 64, 128, 300])
def test_random_rows_within_the_mantissa_bound(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(64, dim, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q, scale_MB = quantize_e4m3(x)
    assert scale_MB.shape == (64, num_scale_blocks(dim))
    y = dequantize_e4m3(q, scale_MB, torch.float32)
    # The scale of each element's block, broadcast back over the row.
    scale_MD = scale_MB.repeat_interleave(min(dim, 128), dim=1)[:, :dim]
    normal = x.abs() >= 2.0**-6 * scale_MD
    err = (y - x).abs()
    slack = 1e-6 * x.abs()  # fp32 rounding of x / scale and q * scale
    assert (err[normal] <= 2.0**-4 * x.abs()[normal] + slack[normal]).all()
    assert (err[~normal] <= 2.0**-10 * scale_MD[~normal] * (1 + 1e-6)).all()
    # The bound is reached, not only respected: the worst normal element is near 2^-4.
    assert (err[normal] / x.abs()[normal]).max() > 2.0**-5


def test_blocks_of_128_keep_an_outlier_block_from_blurring_the_others():
    x = torch.cat([torch.full((1, 128), 1000.0), torch.full((1, 172), 1.0e-3)], dim=1)
    x[0, 200] = 1.1e-3
    _, scale = quantize_e4m3(x)
    assert scale.shape == (1, 3) and scale[0, 0] > 1e5 * scale[0, 1]
    y = _round_trip(x)
    assert ((y - x).abs() <= 2.0**-4 * x.abs()).all()
    # One scale for the whole row would flush the small values to zero.
    assert (x[:, 128:] * (448 / 1000.0)).abs().max() < 2.0**-9


def test_zero_empty_and_non_finite_rows():
    zero = torch.zeros(2, 8)
    assert quantize_e4m3(zero)[1].tolist() == [[1.0], [1.0]]
    assert torch.equal(_round_trip(zero), zero)
    assert _round_trip(torch.empty(0, 8)).shape == (0, 8)
    # A non-finite row stays non-finite, so the trainer still sees and skips the step.
    bad = torch.tensor([[1.0, float("inf")], [float("nan"), 1.0]])
    assert (~torch.isfinite(_round_trip(bad))).any(dim=1).tolist() == [True, True]


def test_wire_row_bytes_and_the_fp32_ratio():
    assert wire_row_bytes(64, "fp8_e4m3") == 64 + 4
    assert wire_row_bytes(128, "fp8_e4m3") == 128 + 4
    assert wire_row_bytes(300, "fp8_e4m3") == 300 + 3 * 4
    assert wire_row_bytes(64, "bf16") == 128
    packed = pack_e4m3(torch.randn(5, 300))
    assert packed.dtype == torch.uint8 and packed.shape == (5, wire_row_bytes(300, "fp8_e4m3"))
    for dim in (64, 96, 128, 256, 1000, 4096):
        assert wire_row_bytes(dim, "fp8_e4m3") / (4 * dim) <= 0.27, dim


def test_integer_metadata_in_the_smallest_type():
    assert [int_wire_dtype(b) for b in (0, 127, 128, 32767, 32768, 2**31 - 1, 2**31)] == [
        torch.int8, torch.int8, torch.int16, torch.int16, torch.int32, torch.int32, torch.int64]
    for bound in (100, 30000, 70000):
        counts_PL = torch.tensor([[0, bound], [bound // 2, 1]])
        wire = ints_to_bytes(counts_PL, bound)
        assert wire.dtype == torch.uint8
        assert wire.shape == (2, 2 * int_wire_dtype(bound).itemsize)
        assert torch.equal(ints_from_bytes(wire, bound, counts_PL.shape[1:]), counts_PL)
    rows_M = torch.tensor([3, 0, 15])
    wire = ints_to_bytes(rows_M, 15)
    assert wire.shape == (3, 1)
    back = ints_from_bytes(wire, 15, rows_M.shape[1:])
    assert back.dtype == torch.int64 and torch.equal(back, rows_M)


def test_comm_stats_counts_the_dispatch_and_the_fp32_reference():
    s = CommStats()
    # 3 rows to the peer and 5 from it, D = 64 in fp8 (68 bytes a row); then a bf16 combine.
    s.count_exchange(input_splits=[2, 3], output_splits=[4, 5], own=0, row_bytes=68, dispatch_row_elements=64)
    s.count_exchange(input_splits=[4, 5], output_splits=[2, 3], own=0, row_bytes=128)
    s.count_minimum(remote_rows=8, dim=64, element_bytes=4, num_counts=2)
    assert (s.bytes_sent, s.bytes_received) == (3 * 68 + 5 * 128, 5 * 68 + 3 * 128)
    assert (s.dispatch_bytes, s.dispatch_min_bytes_fp32) == (8 * 68, 8 * 256)
    assert s.dispatch_ratio_vs_fp32 == 68 / 256
    assert s.min_bytes == s.min_bytes_fp32 == 2 * 8 * 256 + 2 * 2 * 8
    assert s.ratio == s.ratio_vs_fp32 == (8 * 68 + 8 * 128) / s.min_bytes
    # Under bf16 compute the uncompressed minimum halves, the fp32 reference does not.
    b = CommStats()
    b.count_minimum(remote_rows=8, dim=64, element_bytes=2, num_counts=2)
    assert b.min_bytes == 2 * 8 * 128 + 32 and b.min_bytes_fp32 == s.min_bytes_fp32
    total = s + b
    assert total.min_bytes_fp32 == 2 * s.min_bytes_fp32 and total.dispatch_bytes == s.dispatch_bytes
    assert total.as_metrics()["a2a_dispatch_ratio_vs_fp32"] == 68 / 256
    assert CommStats().ratio_vs_fp32 == 1.0


def test_dispatch_dtype_is_validated():
    assert MoEConfig().dispatch_dtype == "none"
    for ok in ("none", "bf16", "fp8_e4m3"):
        MoEConfig(dispatch_dtype=ok)
    with pytest.raises(ValueError, match=r"moe\.dispatch_dtype \('fp8'\) must be one of 'none', 'bf16', 'fp8_e4m3'"):
        MoEConfig(dispatch_dtype="fp8")


def _backward_payload(seed: int) -> torch.Tensor:
    """The gradient w.r.t. the rows an MoE layer's experts received: what the backward of the
    dispatch sends back, under a regression loss."""
    torch.manual_seed(seed)
    layer = MoELayer(64, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=128))
    rows = []
    layer.experts.register_forward_pre_hook(lambda mod, args: rows.append(args[0]) or args[0].retain_grad())
    x_TD = torch.randn(256, 64, requires_grad=True)
    y_TD, aux = layer(x_TD)
    ((y_TD - torch.randn(256, 64)).square().mean() + aux.loss).backward()
    return rows[0].grad


def test_gradients_lose_15x_more_in_e4m3_than_in_bf16():
    """Why the backward travels in bf16: on a real backward payload (per-row scales) e4m3 loses
    ~2.5% norm-wise, bf16 ~0.17%."""
    for seed in range(3):
        g_MD = _backward_payload(seed)
        scale = g_MD.norm()
        e4m3 = ((_round_trip(g_MD) - g_MD).norm() / scale).item()
        bf16 = ((g_MD.to(torch.bfloat16).float() - g_MD).norm() / scale).item()
        assert 0.015 < e4m3 < 2.0**-4, e4m3
        assert bf16 < 2.0**-9, bf16
        assert e4m3 > 10 * bf16, (e4m3, bf16)
