"""Compressed wire formats of the expert-parallel all-to-all (``moe.dispatch_dtype``).

Token rows (``exchange_rows``), by wire format:

* ``"bf16"``: rows cast to bf16, back to the compute dtype on arrival.
* ``"fp8_e4m3"``: each row quantised per block of up to 128 elements (DeepSeek-V3's 1 x 128
  activation tiles; one block per row when D <= 128) to ``float8_e4m3fn`` with an fp32 scale
  ``amax / 448``, so the largest element of a block maps to e4m3's largest finite value.
  Quantised rows and their scales travel as one uint8 row of ``D + 4 * B`` bytes: gloo refuses
  fp8 dtypes, and one exchange instead of two keeps the scales on the same splits for free.
  Dequantised to the compute dtype on arrival.

The backward of either sends the gradient back in bf16 (never fp8: a gradient's few large
entries would set the scale and e4m3's 3 mantissa bits would blur the rest). For fp8 the
backward is straight-through: the gradient w.r.t. the sent rows is that of the dequantised rows.

Routing metadata (``ints_to_bytes``/``ints_from_bytes``): integers travel as the bytes of the
smallest integer type that holds their range, int8/int16/int32 (as uint8, since gloo refuses int16).

Shape legend: M rows sent, R rows received, D elements per row, B = ceil(D / block) scale
blocks per row, C elements per block, X bytes per wire row.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
SCALE_BLOCK = 128
DISPATCH_DTYPES = ("none", "bf16", "fp8_e4m3")


def num_scale_blocks(dim: int) -> int:
    """Scale blocks per row: one per 128 elements (one for D <= 128)."""
    return math.ceil(dim / SCALE_BLOCK)


def wire_row_bytes(dim: int, wire: str) -> int:
    """Bytes of one row of ``dim`` elements on the wire: bf16 2 * D, fp8 D + 4 per scale block."""
    if wire == "bf16":
        return 2 * dim
    assert wire == "fp8_e4m3", wire
    return dim + 4 * num_scale_blocks(dim)


def quantize_e4m3(x_MD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_MD float8_e4m3fn, scale_MB fp32)`` with ``x ~= q * scale`` blockwise. An all-zero
    block gets scale 1 (its elements are exactly 0 either way), and so does a block whose
    ``amax / 448`` underflows to 0 (amax below 224 fp32 subnormal steps, ~3e-43, or any subnormal
    scale where denormals are flushed): a zero scale would make ``0 / 0`` NaN, and elements that
    small round to 0 at scale 1."""
    M, D = x_MD.shape
    B = num_scale_blocks(D)
    C = min(D, SCALE_BLOCK)
    x_MBC = torch.nn.functional.pad(x_MD.float(), (0, B * C - D)).view(M, B, C)  # zero padding: amax unchanged
    amax_MB = x_MBC.abs().amax(dim=2)
    scale_MB = amax_MB / E4M3_MAX
    scale_MB = torch.where(scale_MB > 0, scale_MB, torch.ones_like(scale_MB))  # not amax > 0: it may underflow
    # The clamp keeps amax / (amax / 448), which fp32 may round a hair above 448, finite on
    # back ends whose cast does not saturate.
    q_MBC = (x_MBC / scale_MB.unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q_MBC.view(M, B * C)[:, :D], scale_MB


def dequantize_e4m3(q_MD: torch.Tensor, scale_MB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    M, D = q_MD.shape
    B = scale_MB.shape[1]
    C = min(D, SCALE_BLOCK)
    q_MBC = torch.nn.functional.pad(q_MD.float(), (0, B * C - D)).view(M, B, C)
    return (q_MBC * scale_MB.unsqueeze(2)).view(M, B * C)[:, :D].to(dtype)


def pack_e4m3(x_MD: torch.Tensor) -> torch.Tensor:
    """Quantised rows and their scales as one uint8 ``[M, D + 4 * B]`` tensor."""
    q_MD, scale_MB = quantize_e4m3(x_MD)
    return torch.cat([q_MD.view(torch.uint8), scale_MB.view(torch.uint8)], dim=1)


def unpack_e4m3(packed_MX: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    q_MD = packed_MX[:, :dim].view(torch.float8_e4m3fn)
    # A fresh flat buffer: viewing bytes as float32 needs a 4-byte aligned offset and stride.
    scale_MB = packed_MX[:, dim:].flatten().clone().view(torch.float32).view(packed_MX.shape[0],
                                                                              (packed_MX.shape[1] - dim) // 4)
    return dequantize_e4m3(q_MD, scale_MB, dtype)


def _encode(x_MD: torch.Tensor, wire: str) -> torch.Tensor:
    return pack_e4m3(x_MD) if wire == "fp8_e4m3" else x_MD.to(torch.bfloat16).contiguous()


def _decode(recv_RX: torch.Tensor, wire: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return unpack_e4m3(recv_RX, dim, dtype) if wire == "fp8_e4m3" else recv_RX.to(dtype)


def _all_to_all(x_MX: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    out_RX = x_MX.new_empty(sum(output_splits), *x_MX.shape[1:])
    dist.all_to_all_single(out_RX, x_MX.contiguous(), output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out_RX


class _CompressedAllToAll(torch.autograd.Function):
    """Rows there in ``wire`` format, gradients back in bf16 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_MD, wire, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        ctx.group, ctx.dtype = group, x_MD.dtype
        # 1. Encode (cast, or quantise and pack the scales), 2. exchange, 3. decode.
        recv_RX = _all_to_all(_encode(x_MD, wire), output_splits, input_splits, group)
        return _decode(recv_RX, wire, x_MD.shape[1], x_MD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        # Straight-through: the gradient of the decoded rows goes back as that of the sent ones.
        grad_MD = _all_to_all(grad_RD.to(torch.bfloat16), ctx.input_splits, ctx.output_splits, ctx.group)
        return grad_MD.to(ctx.dtype), None, None, None, None


def exchange_rows(x_MD: torch.Tensor, *, wire: str, output_splits: list[int], input_splits: list[int],
                  group: dist.ProcessGroup) -> torch.Tensor:
    """Variable-size all-to-all of the rows of ``x_MD`` in ``wire`` format ("bf16" or
    "fp8_e4m3"), returned in ``x_MD``'s dtype; autograd sends the gradients back in bf16."""
    return _CompressedAllToAll.apply(x_MD, wire, output_splits, input_splits, group)


# ----- integer metadata -----------------------------------------------------------------------------


TOKEN_BOUND = torch.iinfo(torch.int32).max
"""The bound of integers that count or index a rank's tokens or routed copies on the wire. Both
ends of an exchange must decode with the width the sender encoded with, and token counts differ
between ranks (a classifier routes its real tokens only; under tp with MTP the last tp rank holds
the padded positions), so such integers take a width every rank agrees on: int32."""


def int_wire_dtype(bound: int) -> torch.dtype:
    """Smallest signed integer type holding every value in ``[0, bound]``."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def ints_to_bytes(x_MX: torch.Tensor, bound: int) -> torch.Tensor:
    """Integers in ``[0, bound]`` as the uint8 bytes of ``int_wire_dtype(bound)``, one row per row
    of ``x_MX`` (a 1-D tensor is a column)."""
    return x_MX.to(int_wire_dtype(bound)).reshape(x_MX.shape[0], math.prod(x_MX.shape[1:])).view(torch.uint8)


def ints_from_bytes(u8_RY: torch.Tensor, bound: int, tail_shape: torch.Size) -> torch.Tensor:
    """Inverse of ``ints_to_bytes``: int64 ``[R, *tail_shape]``."""
    return u8_RY.view(int_wire_dtype(bound)).reshape(u8_RY.shape[0], *tail_shape).long()
