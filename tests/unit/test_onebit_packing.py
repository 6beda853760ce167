"""1-bit gradient compression, one process: sign packing, the chunk arithmetic and the packed
layout's index math, worked by hand."""

from __future__ import annotations

import torch

from moetrain.distributed.data_parallel.compression import (
    chunk_len,
    fp32_bytes,
    onebit_bytes,
    pack_signs,
    unpack_signs,
)
from moetrain.distributed.data_parallel.onebit_packing import PackedLayout, bit_weights, compress


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


def test_compress_sign_times_mean_over_real_elements_row_by_row():
    # Two segments: two rows of 8 (the first with 4 real elements), then one row of 16.
    x = torch.tensor([1.0, -3, 2, -2, 0, 0, 0, 0, 4, 4, -4, 4, 4, 4, 4, 4] + [-1.0] * 16)
    mask = torch.tensor([True] * 4 + [False] * 4 + [True] * 24)
    packed, scale, approx = compress(x, [(0, 16, 8), (16, 32, 16)], torch.tensor([4.0, 8, 16]), mask,
                                     bit_weights("cpu"))
    assert scale.tolist() == [2.0, 4.0, 1.0]  # mean |x| over the 4 real elements, not 8
    assert approx.tolist() == [2.0, -2, 2, -2, 0, 0, 0, 0, 4, 4, -4, 4, 4, 4, 4, 4] + [-1.0] * 16
    assert packed.tolist() == [1 + 4 + 16 + 32 + 64 + 128, 255 - 4, 0, 0]  # sign(0) = +1


def test_packed_layout_offsets_and_wire_order():
    # 3, 20 and 37 elements at W = 2, seen from rank 1: chunks of 8, 16 and 24.
    layout = PackedLayout([3, 20, 37], world=2, rank=1, device="cpu")
    assert layout.segments == [(0, 16, 8), (16, 48, 16), (48, 96, 24)]
    assert layout.chunk_segments == [(0, 8, 8), (8, 24, 16), (24, 48, 24)]
    # Real elements per chunk (tensor by tensor), at least 1: a chunk of padding only divides by 1.
    assert layout.counts.tolist() == [3, 1, 16, 4, 24, 13] and layout.own_counts.tolist() == [1, 4, 13]
    assert layout.mask.view(-1, 8).sum(dim=1).tolist() == [3, 0, 8, 8, 4, 0, 8, 8, 8, 8, 5, 0]
    assert layout.own_mask.sum().item() == 0 + 4 + 13
    # Tensor-major sign bytes 0..11 (t0: chunk 0 byte 0, chunk 1 byte 1; t1: 2 3 | 4 5; t2: 6 7 8 |
    # 9 10 11) and scales 0..5: row j of the wire holds chunk j's scales, then its signs.
    wire = layout.to_wire(torch.arange(12, dtype=torch.uint8), torch.arange(6.0))
    scale_WK, signs_WS = layout.from_wire(wire)
    assert scale_WK.tolist() == [[0.0, 2, 4], [1.0, 3, 5]]
    assert signs_WS.tolist() == [[0, 2, 3, 6, 7, 8], [1, 4, 5, 9, 10, 11]]
    assert layout.to_tensor_major(signs_WS).tolist() == list(range(12))
    # Flattening pads each tensor with zeros to W L; unflattening drops the padding.
    tensors = [torch.full((3,), 1.0), torch.full((4, 5), 2.0), torch.full((37,), 3.0)]
    flat = layout.flatten(tensors)
    assert flat.tolist() == [1.0] * 3 + [0.0] * 13 + [2.0] * 20 + [0.0] * 12 + [3.0] * 37 + [0.0] * 11
    out = [torch.zeros_like(t) for t in tensors]
    layout.unflatten_into(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))


def test_onebit_bytes_at_most_a_thirtieth():
    for world in (2, 4, 8):
        for numel in (480 * world, 1 << 16):
            assert onebit_bytes(numel, world) * 30 <= fp32_bytes(numel)
    assert onebit_bytes(1024, 2) * 30 <= fp32_bytes(1024)
