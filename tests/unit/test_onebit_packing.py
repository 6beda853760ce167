"""1-bit gradient compression, one process: sign packing and the chunk arithmetic."""

from __future__ import annotations

import torch

from moetrain.distributed.data_parallel.compression import (
    chunk_len,
    compress_rows,
    decompress_rows,
    fp32_bytes,
    onebit_bytes,
    pack_signs,
    unpack_signs,
)


def test_pack_round_trip_exact():
    x = torch.randn(8 * 129, generator=torch.Generator().manual_seed(0))
    x[:5] = 0.0  # sign(0) = +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 129
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_pack_bit_order():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1, -1, -1, -1, -1])
    assert pack_signs(x).tolist() == [1 + 128, 2]
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_signs(unpack_signs(every).reshape(-1)), every)


def test_chunk_len():
    assert chunk_len(1024, 2) == 512 and chunk_len(1024, 4) == 256
    assert chunk_len(37, 2) == 24 and chunk_len(3, 4) == 8 and chunk_len(1, 1) == 8
    for n in (1, 7, 8, 9, 1000, 1025):
        for w in (1, 2, 3, 4, 8):
            assert chunk_len(n, w) % 8 == 0 and w * chunk_len(n, w) >= n > w * (chunk_len(n, w) - 8) - 8 * w


def test_compress_rows_sign_times_mean_over_real_elements():
    x_WL = torch.tensor([[1.0, -3, 2, -2, 0, 0, 0, 0], [4.0, 4, -4, 4, 4, 4, 4, 4]])
    mask_WL = torch.tensor([[True] * 4 + [False] * 4, [True] * 8])
    packed, scale_W, approx = compress_rows(x_WL, mask_WL)
    assert scale_W.tolist() == [2.0, 4.0]  # mean |x| over the 4 real elements, not 8
    assert approx.tolist() == [[2.0, -2, 2, -2, 0, 0, 0, 0], [4.0, 4, -4, 4, 4, 4, 4, 4]]
    assert torch.equal(decompress_rows(packed, scale_W, mask_WL), approx)


def test_onebit_bytes_at_most_a_thirtieth():
    for world in (2, 4, 8):
        for numel in (480 * world, 1 << 16):
            assert onebit_bytes(numel, world) * 30 <= fp32_bytes(numel)
    assert onebit_bytes(1024, 2) * 30 <= fp32_bytes(1024)
