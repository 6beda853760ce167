"""Compressed all-reduces: bf16 (of gradients), and 1-bit (sign x mean |x|) with error feedback
(of 1-bit Adam's momenta, ``moetrain.distributed.data_parallel.onebit_adam``).

The 1-bit reduction is the two-phase compressed all-reduce of 1-bit Adam (Tang et al. 2021).
Packed signs cannot be summed by an all-reduce, so each rank owns one chunk of every tensor:

    1. every rank adds its worker residual to its gradient, splits each tensor into W chunks and
       compresses each chunk (8 signs per uint8 plus one fp32 scale, mean |x| of the chunk); the
       worker residual becomes x - decompress(x);
    2. all-to-all: rank j receives the W compressed versions of chunk j;
    3. rank j decompresses and sums them, adds its server residual, compresses again; the server
       residual becomes y - decompress(y);
    4. all-gather of the compressed chunks; every rank decompresses all of them, so the replicas
       get bit-identical results.

Chunks are cut per tensor, keyed by parameter name, not per DDP bucket: buckets change (DDP
rebuilds them after the first step and after a resume), and per-tensor chunks keep the numerics,
and the residuals, the same whatever grouping carried a tensor. That is what makes a resumed run
continue bit for bit.

Bytes per tensor of N elements at W ranks: the all-to-all's send buffer plus the all-gather's
output, W * (L / 8 + 4) each, with chunk length L = 8 * ceil(N / (8 W)): about 2 * (N / 8 + 4 W).
Against the 2 * 4 N of an fp32 ring all-reduce that is 1/32 + W / N, so <= 1/30 for N >= 480 W.

Shape legend: N elements of a tensor, W ranks of the group, L elements per chunk.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moetrain.distributed.comm.collectives import all_gather_single

_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)
_SCALE_BYTES = 4


def chunk_len(numel: int, world: int) -> int:
    """Elements per chunk L: a tensor of ``numel`` split over ``world`` ranks, a multiple of 8."""
    return 8 * max(1, math.ceil(numel / (8 * world)))


def onebit_bytes(numel: int, world: int) -> int:
    """Bytes the 1-bit all-reduce of one ``numel``-element tensor moves at ``world`` ranks
    (all-to-all send buffer + all-gather output)."""
    return 2 * world * (chunk_len(numel, world) // 8 + _SCALE_BYTES)


def fp32_bytes(numel: int) -> int:
    """Bytes of an fp32 ring all-reduce of ``numel`` elements: reduce-scatter + all-gather."""
    return 2 * 4 * numel


def bf16_bytes(numel: int) -> int:
    return 2 * 2 * numel


def pack_signs(x_N: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N / 8]``: bit i of byte k is 1 where ``x[8 k + i] >= 0``. N must be a multiple of 8."""
    bits_N8 = (x_N >= 0).view(-1, 8).to(torch.uint8)
    return (bits_N8 * _bit_weights(x_N.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., 8 * bytes]`` of +1 / -1: the inverse of ``pack_signs`` (sign(0) = +1)."""
    bits = (packed.unsqueeze(-1) & _bit_weights(packed.device)).ne(0)
    return (bits.to(torch.float32) * 2 - 1).flatten(-2)


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=device)


def _real_mask(numel: int, world: int, device: torch.device | str) -> torch.Tensor:
    """bool ``[W, L]``: which positions of the padded chunks hold elements of the tensor."""
    length = chunk_len(numel, world)
    return (torch.arange(world * length, device=device) < numel).view(world, length)


def compress_rows(x_WL: torch.Tensor, mask_WL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: packed signs uint8 ``[W, L / 8]``, scale mean |x| over the real elements fp32
    ``[W]``, and the decompressed rows ``[W, L]`` (zero at padding)."""
    num_real_W = mask_WL.sum(dim=1).clamp(min=1)
    scale_W = x_WL.abs().mul(mask_WL).sum(dim=1) / num_real_W
    packed = pack_signs(x_WL.reshape(-1)).view(x_WL.shape[0], -1)
    return packed, scale_W, decompress_rows(packed, scale_W, mask_WL)


def decompress_rows(packed: torch.Tensor, scale_W: torch.Tensor, mask_WL: torch.Tensor) -> torch.Tensor:
    return unpack_signs(packed) * scale_W.unsqueeze(1) * mask_WL


def _rows_to_bytes(packed: torch.Tensor, scale_W: torch.Tensor) -> torch.Tensor:
    """uint8 ``[W, L / 8 + 4]``: each row's signs followed by its scale's bytes."""
    return torch.cat([packed, scale_W.contiguous().view(torch.uint8).view(-1, _SCALE_BYTES)], dim=1)


def _bytes_to_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rows[:, :-_SCALE_BYTES], rows[:, -_SCALE_BYTES:].contiguous().view(torch.float32).view(-1)


class OneBitReducer:
    """The 1-bit all-reduce over ``group`` with its residuals, per named tensor: the worker
    residual (the tensor's size) and the server residual (this rank's chunk, L elements).
    ``state_dict`` hands them to checkpoints (``MoEDataParallel`` restores or resets them)."""

    def __init__(self, group: dist.ProcessGroup | None, shapes: dict[str, int], *,
                 device: torch.device | str = "cpu") -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.worker = {k: torch.zeros(n, device=device) for k, n in shapes.items()}
        self.server = {k: torch.zeros(chunk_len(n, self.world), device=device) for k, n in shapes.items()}
        # Which positions of each tensor's padded chunks are real: fixed by the shapes, built once.
        self.masks = {k: _real_mask(n, self.world, device) for k, n in shapes.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**{f"worker.{k}": v for k, v in self.worker.items()},
                **{f"server.{k}": v for k, v in self.server.items()}}

    def reset(self) -> None:
        for t in (*self.worker.values(), *self.server.values()):
            t.zero_()

    def all_reduce_sum(self, tensors: list[torch.Tensor], keys: list[str]) -> int:
        """Replace every tensor by the 1-bit compressed sum over the group (in place; collective,
        same keys in the same order on every rank). Returns the bytes moved."""
        world, rank = self.world, self.rank
        # 1. Worker compression: every chunk of every tensor, with the worker residual added.
        masks, rows = [], []
        for t, key in zip(tensors, keys, strict=True):
            n, length = t.numel(), chunk_len(t.numel(), world)
            x_WL = torch.zeros(world * length, device=t.device)
            x_WL[:n] = t.detach().reshape(-1).float() + self.worker[key]
            x_WL = x_WL.view(world, length)
            mask_WL = self.masks[key]
            packed, scale_W, approx_WL = compress_rows(x_WL, mask_WL)
            self.worker[key] = _finite_or(x_WL - approx_WL, self.worker[key], n)
            masks.append(mask_WL)
            rows.append(_rows_to_bytes(packed, scale_W))
        send = torch.cat(rows, dim=1)  # [W, bytes]: row j goes to rank j
        # 2. All-to-all: rank j receives every rank's version of its chunks.
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group)
        # 3. Server: decompress and sum this rank's chunk, add the server residual, compress again.
        own_rows, offset = [], 0
        for t, mask_WL, key in zip(tensors, masks, keys, strict=True):
            width = own_width(t.numel(), world)
            packed, scale_W = _bytes_to_rows(recv[:, offset:offset + width])
            own_mask_1L = mask_WL[rank].expand(world, -1)
            y_1L = (decompress_rows(packed, scale_W, own_mask_1L).sum(dim=0) + self.server[key]).unsqueeze(0)
            packed2, scale2, approx_1L = compress_rows(y_1L, mask_WL[rank:rank + 1])
            self.server[key] = _finite_or(y_1L - approx_1L, self.server[key], y_1L.numel())
            own_rows.append(_rows_to_bytes(packed2, scale2))
            offset += width
        mine = torch.cat(own_rows, dim=1).reshape(-1)
        # 4. All-gather the compressed sums; every rank decompresses every chunk.
        gathered = mine.new_empty(world * mine.numel())
        all_gather_single(gathered, mine, group=self.group)
        gathered = gathered.view(world, -1)
        offset = 0
        for t, mask_WL in zip(tensors, masks, strict=True):
            width = own_width(t.numel(), world)
            packed, scale_W = _bytes_to_rows(gathered[:, offset:offset + width])
            t.copy_(decompress_rows(packed, scale_W, mask_WL).reshape(-1)[:t.numel()].view_as(t))
            offset += width
        return send.numel() + gathered.numel()


def _finite_or(new: torch.Tensor, old: torch.Tensor, numel: int) -> torch.Tensor:
    """The new residual where finite, else the old one: an fp16 overflow step (skipped by the loss
    scaler) must not leave inf/nan in the residual for every later step. No host sync."""
    new = new.reshape(-1)[:numel]
    return torch.where(torch.isfinite(new), new, old)


def own_width(numel: int, world: int) -> int:
    """Bytes of one compressed chunk: its signs and its scale."""
    return chunk_len(numel, world) // 8 + _SCALE_BYTES


class Bf16AllReduce:
    """The sum of ``tensors`` over ``group`` through one bf16 all-reduce, launched asynchronously
    by the constructor. ``wait`` (or the callback of ``future``) writes the sums back into
    ``tensors``, cast to their own dtype. ``num_bytes``: what it moves (ring all-reduce).

    Each element is cast, summed and cast back the same way whether tensors travel together or
    one per reduction; only the reduction order of a ring over more than two ranks may differ."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.tensors = tensors
        parts = [t.reshape(-1).to(torch.bfloat16) for t in tensors]
        self.flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.num_bytes = bf16_bytes(self.flat.numel())
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)
        self._written = False

    def _write_back(self) -> None:
        if self._written:
            return
        offset = 0
        for t in self.tensors:
            t.copy_(self.flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        self._written = True

    def wait(self) -> None:
        """Wait for the sum (on a GPU the current stream waits, not the host), then write it back."""
        self.work.wait()
        self._write_back()

    def future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future of ``tensors``, completed once the sums are written back into them; the
        caller does not block."""

        def write_back(fut: torch.futures.Future) -> list[torch.Tensor]:
            fut.value()  # raises if the all-reduce failed
            self._write_back()
            return self.tensors

        return self.work.get_future().then(write_back)
