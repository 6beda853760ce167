"""The packed buffers of the 1-bit all-reduce (``compression.OneBitReducer``): every tensor of one
exchange in one buffer, each still cut into its own W chunks with its own scales, so that a step
runs a few operations per chunk length (and views per tensor) instead of over a hundred per tensor,
with the bits that compressing each tensor on its own gives.

The same chunks in two layouts:

    tensor-major (fp32 elements; the worker stage and the final decompression): tensor after
        tensor, each padded with zeros to W * L and seen as W rows of L, one per chunk:
        [t0 chunk 0 | t0 chunk 1 | ... | t1 chunk 0 | ...];
    chunk-major (uint8, the wire): W rows, row j = the K scales of chunk j (fp32 bytes), then the
        signs of chunk j of every tensor; row j goes to rank j in the all-to-all, and rank j's
        server stage works on [t0 chunk j | t1 chunk j | ...] (its *chunk row*).

The tensors are ordered by chunk length, so tensors of equal L are neighbours and their rows form
one [rows, L] matrix (a *segment*). A chunk's scale is then the row sum that torch computes for one
tensor's [W, L] chunks: the same contiguous reduction over rows of the same length, each row by
itself (a ragged segmented sum would add in another order and change the last bits). Two limits:
on the CPU with several threads, torch splits the sum of a *single* row of >= 32768 elements over
them (its bits then depend on the thread count): the per-tensor server stage summed one row per
tensor, a segment of several rows sums each row whole, so the two agree at one thread. On a GPU the
reduction's strategy depends on the number of rows; agreement there is not checked.

The price of one buffer: the stages' temporaries (a few fp32 copies, a few bytes of masks and signs
per element) are those of all its tensors at once, not of the largest one; ``OneBitReducer`` bounds
them by exchanging a large model in buckets (``ONEBIT_BUCKET_ELEMENTS``).

Shape legend: W ranks, L chunk length, K tensors, R rows, E elements (tensor-major, padded),
C elements of a chunk row, S sign bytes of a chunk row (C / 8).
"""

from __future__ import annotations

import itertools
import math

import torch

_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)
SCALE_BYTES = 4

Segment = tuple[int, int, int]
"""(start, stop, L): elements start:stop of a flat buffer are rows of L elements."""


def chunk_len(numel: int, world: int) -> int:
    """Elements per chunk L: a tensor of ``numel`` split over ``world`` ranks, a multiple of 8."""
    return 8 * max(1, math.ceil(numel / (8 * world)))


def bit_weights(device: torch.device | str) -> torch.Tensor:
    return torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N / 8]``: bit i of byte k is ``bits[8 k + i]``. N must be a multiple of 8."""
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """bool ``[..., 8 * bytes]``: the inverse of ``pack_bits``."""
    return (packed.unsqueeze(-1) & weights).ne(0).flatten(-2)


def signs(bits: torch.Tensor) -> torch.Tensor:
    """fp32 +1 where a bit is set, -1 where not."""
    return bits.to(torch.float32) * 2 - 1


def row_sums(x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """``[R]``: the sum of each row of every segment of the flat ``x``, each row reduced by itself."""
    return torch.cat([x[start:stop].view(-1, length).sum(dim=1) for start, stop, length in segments])


def repeat_rows(values: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """``[..., R]`` (one value per row, rows in order) -> ``[..., E]``: each value over its row."""
    parts, row = [], 0
    for start, stop, length in segments:
        rows = (stop - start) // length
        per_row = values[..., row:row + rows]
        parts.append(per_row.unsqueeze(-1).expand(*per_row.shape, length).flatten(-2))
        row += rows
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def compress(x: torch.Tensor, segments: list[Segment], counts: torch.Tensor, mask: torch.Tensor,
             weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of the flat ``x`` (zero at padding) as sign x mean |x| over its real elements:
    packed signs uint8 ``[E / 8]``, the scales fp32 ``[R]``, and the decompressed ``x`` (zero at
    padding), as ``decompress`` of the first two gives it."""
    bits = x >= 0
    scale = row_sums(x.abs(), segments) / counts  # padding adds |0|: the sum over the real elements
    return pack_bits(bits, weights), scale, decompress(bits, repeat_rows(scale, segments), mask)


def decompress(bits: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sign x scale, zero at padding (``scale`` per element); in place on one fresh buffer, the
    same products as ``signs(bits) * scale * mask``."""
    return signs(bits).mul_(scale).mul_(mask)


def finite_or(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The new residual where finite, else the old one: an fp16 overflow step (skipped by the loss
    scaler) must not leave inf/nan in the residual for every later step. No host sync."""
    return torch.where(torch.isfinite(new), new, old)


class PackedLayout:
    """Where K tensors (ordered by chunk length) of ``numels`` elements lie in the packed buffers of
    a W-rank exchange, seen from ``rank``, and the constant tensors the stages use."""

    def __init__(self, numels: list[int], *, world: int, rank: int, device: torch.device | str) -> None:
        lengths = [chunk_len(n, world) for n in numels]
        assert numels and lengths == sorted(lengths), "tensors must come ordered by chunk length"
        self.world, self.num_tensors = world, len(numels)
        self.scale_bytes = SCALE_BYTES * self.num_tensors
        # Runs of equal L: the segments, in both layouts (W rows per tensor, or one).
        padded_at = [0, *itertools.accumulate(world * L for L in lengths)]
        chunk_at = [0, *itertools.accumulate(lengths)]
        self.segments: list[Segment] = []
        self.chunk_segments: list[Segment] = []
        first = 0
        for length, run in itertools.groupby(lengths):
            last = first + len(list(run))
            self.segments.append((padded_at[first], padded_at[last], length))
            self.chunk_segments.append((chunk_at[first], chunk_at[last], length))
            first = last
        pads = [world * L - n for n, L in zip(numels, lengths, strict=True)]
        zeros = torch.zeros(max(pads), device=device)
        # What follows each tensor in the tensor-major buffer; views of one zero tensor.
        self.pads = [zeros[:p] if p else None for p in pads]
        self.split_sizes = [s for n, p in zip(numels, pads, strict=True) for s in (n, p)]
        # Which positions are real, tensor-major [E] and in this rank's chunk row [C]; and how
        # many real elements each chunk has, at least 1 (a chunk past the end is all padding).
        sizes = list(zip(numels, lengths, strict=True))
        self.mask = torch.cat([torch.arange(world * L, device=device) < n for n, L in sizes])
        self.own_mask = torch.cat([torch.arange(rank * L, (rank + 1) * L, device=device) < n for n, L in sizes])
        counts_KW = torch.tensor([[min(max(n - j * L, 0), L) for j in range(world)] for n, L in sizes],
                                 dtype=torch.float32, device=device).clamp(min=1)
        self.counts = counts_KW.reshape(-1)
        self.own_counts = counts_KW[:, rank].contiguous()
        self.weights = bit_weights(device)

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """fp32 ``[E]``: the tensors, each followed by its zero padding (a fresh tensor)."""
        pieces: list[torch.Tensor] = []
        for t, pad in zip(tensors, self.pads, strict=True):
            pieces.append(t if t.dim() == 1 else t.reshape(-1))
            if pad is not None:
                pieces.append(pad)
        return torch.cat(pieces).float()

    def unflatten_into(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy the real elements of the tensor-major ``flat`` into ``tensors`` (cast to their dtype)."""
        parts = flat.split(self.split_sizes)[0::2]
        views = [p if t.dim() == 1 else p.view(t.shape) for p, t in zip(parts, tensors, strict=True)]
        torch._foreach_copy_(tensors, views)

    def to_wire(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """uint8 ``[W, 4 K + S]``, chunk-major, from tensor-major packed signs ``[E / 8]`` and scales
        ``[K * W]`` (tensor by tensor, chunk by chunk)."""
        w = self.world
        sign_rows = [packed[a // 8:b // 8].view(-1, w, L // 8).transpose(0, 1).reshape(w, -1)
                     for a, b, L in self.segments]
        # Flat before the dtype view: a [W, 1] transpose counts as contiguous with its stride of W.
        scale_bytes_WK4 = scale.view(self.num_tensors, w).t().contiguous().view(-1).view(torch.uint8).view(w, -1)
        return torch.cat([scale_bytes_WK4, *sign_rows], dim=1)

    def from_wire(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk-major ``[W, 4 K + S]`` rows -> their scales fp32 ``[W, K]`` and signs uint8 ``[W, S]``."""
        scale_WK = rows[:, :self.scale_bytes].contiguous().view(torch.float32)
        return scale_WK, rows[:, self.scale_bytes:]

    def to_tensor_major(self, signs_WS: torch.Tensor) -> torch.Tensor:
        """Chunk-major sign bytes ``[W, S]`` -> tensor-major ``[E / 8]``."""
        w = self.world
        parts = [signs_WS[:, a // 8:b // 8].reshape(w, -1, L // 8).transpose(0, 1).reshape(-1)
                 for a, b, L in self.chunk_segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
