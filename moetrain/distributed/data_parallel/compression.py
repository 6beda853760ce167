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
continue bit for bit. They are cut per tensor, but they travel packed: the tensors of one call
go through each stage as one buffer (up to ``ONEBIT_BUCKET_ELEMENTS``, then in buckets) and through
one all-to-all and one all-gather per buffer (``onebit_packing``), with the bits of compressing
each tensor by itself.

Bytes per tensor of N elements at W ranks: the all-to-all's send buffer plus the all-gather's
output, W * (L / 8 + 4) each, with chunk length L = 8 * ceil(N / (8 W)): about 2 * (N / 8 + 4 W).
Against the 2 * 4 N of an fp32 ring all-reduce that is 1/32 + W / N, so <= 1/30 for N >= 480 W.

Shape legend: N elements of a tensor, W ranks of the group, L elements per chunk.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from moetrain.distributed.comm.collectives import all_gather_single
from moetrain.distributed.data_parallel.onebit_packing import (
    SCALE_BYTES,
    PackedLayout,
    bit_weights,
    chunk_len,
    compress,
    decompress,
    finite_or,
    pack_bits,
    repeat_rows,
    signs,
    unpack_bits,
)

ONEBIT_BUCKET_ELEMENTS = 1 << 26
"""Padded elements one packed exchange stages at most (a larger tensor goes alone). Its stages hold
a few fp32 copies of what they stage (about 1.3 GiB at 64 Mi elements), so a model of billions of
parameters is exchanged in buckets, two collectives each, not with temporaries of its size."""


def onebit_bytes(numel: int, world: int) -> int:
    """Bytes the 1-bit all-reduce of one ``numel``-element tensor moves at ``world`` ranks
    (all-to-all send buffer + all-gather output)."""
    return 2 * world * (chunk_len(numel, world) // 8 + SCALE_BYTES)


def fp32_bytes(numel: int) -> int:
    """Bytes of an fp32 ring all-reduce of ``numel`` elements: reduce-scatter + all-gather."""
    return 2 * 4 * numel


def bf16_bytes(numel: int) -> int:
    return 2 * 2 * numel


def pack_signs(x_N: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N / 8]``: bit i of byte k is 1 where ``x[8 k + i] >= 0``. N must be a multiple of 8."""
    return pack_bits(x_N >= 0, bit_weights(x_N.device))


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., 8 * bytes]`` of +1 / -1: the inverse of ``pack_signs`` (sign(0) = +1)."""
    return signs(unpack_bits(packed, bit_weights(packed.device)))


class OneBitReducer:
    """The 1-bit all-reduce over ``group`` with its residuals, per named tensor: the worker
    residual (the tensor's size) and the server residual (this rank's chunk, L elements).
    ``state_dict`` hands them to checkpoints (``MoEDataParallel`` restores or resets them).

    The residuals live in two flat buffers, in the packed layouts of ``onebit_packing`` for all
    the tensors (ordered by chunk length); ``worker`` and ``server`` hold views of them by name.
    The tensors of one call go in buckets of up to ``bucket_elements`` padded elements, in that
    order."""

    def __init__(self, group: dist.ProcessGroup | None, shapes: dict[str, int], *,
                 device: torch.device | str = "cpu", bucket_elements: int = ONEBIT_BUCKET_ELEMENTS) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device
        # A stable sort: any subset of the names comes in an order its layout accepts.
        self._order = tuple(sorted(shapes, key=lambda k: chunk_len(shapes[k], self.world)))
        self._index = {k: i for i, k in enumerate(self._order)}
        self._numels = [shapes[k] for k in self._order]
        self._layouts: dict[tuple[str, ...], PackedLayout] = {}
        self._bucket_elements = bucket_elements
        self._w_at = w_at = [0, *itertools.accumulate(self.world * chunk_len(n, self.world) for n in self._numels)]
        self._c_at = c_at = [0, *itertools.accumulate(chunk_len(n, self.world) for n in self._numels)]
        self._worker = torch.zeros(w_at[-1], device=device)  # tensor-major, zero at padding
        self._server = torch.zeros(c_at[-1], device=device)  # this rank's chunk row
        self._worker_padded: dict[str, torch.Tensor] = {}
        self.worker: dict[str, torch.Tensor] = {}
        self.server: dict[str, torch.Tensor] = {}
        for k, n in shapes.items():  # the checkpoint's names and shapes: [N] and [L] per tensor
            i = self._index[k]
            self._worker_padded[k] = self._worker[w_at[i]:w_at[i + 1]]
            self.worker[k] = self._worker[w_at[i]:w_at[i] + n]
            self.server[k] = self._server[c_at[i]:c_at[i + 1]]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**{f"worker.{k}": v for k, v in self.worker.items()},
                **{f"server.{k}": v for k, v in self.server.items()}}

    def reset(self) -> None:
        self._worker.zero_()
        self._server.zero_()

    def _layout(self, keys: tuple[str, ...]) -> PackedLayout:
        if keys not in self._layouts:
            numels = [self._numels[self._index[k]] for k in keys]
            self._layouts[keys] = PackedLayout(numels, world=self.world, rank=self.rank, device=self.device)
        return self._layouts[keys]

    def _buckets(self, order: tuple[str, ...]) -> list[tuple[str, ...]]:
        """``order`` cut into runs of at most ``bucket_elements`` padded elements (or one tensor)."""
        buckets: list[tuple[str, ...]] = []
        start, size = 0, 0
        for i, k in enumerate(order):
            n = self.world * chunk_len(self._numels[self._index[k]], self.world)
            if i > start and size + n > self._bucket_elements:
                buckets.append(order[start:i])
                start, size = i, 0
            size += n
        return [*buckets, order[start:]]

    @torch.no_grad()
    def all_reduce_sum(self, tensors: list[torch.Tensor], keys: list[str]) -> int:
        """Replace every tensor by the 1-bit compressed sum over the group (in place; collective,
        the same keys on every rank, in any order). Returns the bytes moved."""
        by_key = dict(zip(keys, tensors, strict=True))
        assert len(by_key) == len(keys), "a key was passed twice"
        order = tuple(sorted(keys, key=self._index.__getitem__))
        return sum(self._exchange(bucket, [by_key[k] for k in bucket]) for bucket in self._buckets(order))

    def _residuals(self, order: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The worker and server residuals of ``order`` in its packed layouts, and whether they are
        views of the buffers (the tensors are neighbours there) rather than copies."""
        first, last = self._index[order[0]], self._index[order[-1]]
        if last - first + 1 == len(order):  # sorted and distinct: a contiguous run
            return (self._worker[self._w_at[first]:self._w_at[last + 1]],
                    self._server[self._c_at[first]:self._c_at[last + 1]], True)
        return (torch.cat([self._worker_padded[k] for k in order]), torch.cat([self.server[k] for k in order]),
                False)

    def _exchange(self, order: tuple[str, ...], ts: list[torch.Tensor]) -> int:
        """Stages 1-4 of the module docstring for the tensors ``ts`` named ``order`` (ordered by
        chunk length), as one packed buffer. Returns the bytes moved."""
        layout = self._layout(order)
        worker, server, in_place = self._residuals(order)
        # 1. Worker compression of every chunk of every tensor, with the worker residual added.
        x = layout.flatten(ts).add_(worker)
        packed, scale, approx = compress(x, layout.segments, layout.counts, layout.mask, layout.weights)
        new_worker = finite_or(x - approx, worker)
        send = layout.to_wire(packed, scale)  # [W, 4 K + S]: row j goes to rank j
        # 2. All-to-all: rank j receives every rank's version of its chunks.
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group)
        # 3. Server (no communication here): decompress and sum this rank's chunks, add the server
        #    residual, compress again.
        mine, new_server = _server_stage(layout, recv, server)
        # 4. All-gather the compressed sums; every rank decompresses every chunk.
        gathered = mine.new_empty(self.world * mine.numel())
        all_gather_single(gathered, mine, group=self.group)
        scale_WK, signs_WS = layout.from_wire(gathered.view(self.world, -1))
        bits = unpack_bits(layout.to_tensor_major(signs_WS), layout.weights)
        scale_R = scale_WK.t().reshape(-1)  # tensor by tensor, chunk by chunk
        layout.unflatten_into(decompress(bits, repeat_rows(scale_R, layout.segments), layout.mask), ts)
        if in_place:
            worker.copy_(new_worker)
            server.copy_(new_server)
        else:
            self._store(order, new_worker, new_server)
        return send.numel() + gathered.numel()

    def _store(self, order: tuple[str, ...], worker: torch.Tensor, server: torch.Tensor) -> None:
        """Write the new residuals of the tensors ``order`` names into the buffers."""
        worker_views, server_views = [self._worker_padded[k] for k in order], [self.server[k] for k in order]
        torch._foreach_copy_(worker_views, worker.split([v.numel() for v in worker_views]))
        torch._foreach_copy_(server_views, server.split([v.numel() for v in server_views]))


def _server_stage(layout: PackedLayout, recv: torch.Tensor, server: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's chunk of every tensor from the W received rows ``[W, 4 K + S]``: their sum plus
    the server residual ``[C]``, compressed. Returns this rank's wire row ``[4 K + S]`` and the new
    server residual."""
    scale_WK, signs_WS = layout.from_wire(recv)
    bits_WC = unpack_bits(signs_WS, layout.weights)
    y = decompress(bits_WC, repeat_rows(scale_WK, layout.chunk_segments), layout.own_mask).sum(dim=0) + server
    packed, scale, approx = compress(y, layout.chunk_segments, layout.own_counts, layout.own_mask, layout.weights)
    return torch.cat([scale.view(torch.uint8), packed]), finite_or(y - approx, server)


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
