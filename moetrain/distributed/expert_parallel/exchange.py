"""The exchanges of the expert-parallel dispatcher (``expert_parallel.dispatcher``): token rows,
integer metadata and all-gathers over the ep and data-parallel groups. Every exchange goes
through these methods and is counted by them in ``stats`` (``CommStats``), and timed by ``timer``
when it is enabled (``log.comm_timing``: "dispatch", "combine" and their backward, "routing" for
the metadata).

Token rows travel split into a launch and a wait, so that work that does not need them (the
shared experts, another chunk's experts) runs while they travel.

``launch_rows`` starts the exchange and returns at once; ``PendingRows.wait`` blocks until the
rows are here (on a GPU: makes the compute stream wait for the communication stream) and returns
them decoded to the compute dtype. Autograd sends the gradients back the same way. The wire
formats (``moe.dispatch_dtype``) and their numerics are those of
``moetrain.distributed.expert_parallel.wire``, op for op:

* ``"none"``: the rows as they are; backward in the same dtype.
* ``"bf16"``: rows cast to bf16 before and back after; the casts' backward puts the gradient in
  bf16 on the way back.
* ``"fp8_e4m3"``: rows quantised and packed with their scales (``pack_e4m3``) into one uint8 row,
  unpacked on arrival; the backward is straight-through, the gradient of the unpacked rows goes
  back in bf16.

The launch is a functional collective (``_c10d_functional.all_to_all_single``): the op returns a
tensor whose contents are valid only after ``_c10d_functional.wait_tensor``, which is what makes
the exchange asynchronous on every backend (gloo, NCCL) without touching streams here.

Shape legend: M rows sent, R rows received, D elements per row, X elements (or wire bytes) per row,
P ranks in the ep group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from moetrain.distributed.comm.collectives import all_gather_single
from moetrain.distributed.comm.stats import CommStats, CountedExchanges, row_bytes
from moetrain.distributed.comm.timer import CommTimer, timed_exchange
from moetrain.distributed.expert_parallel.wire import (
    DISPATCH_DTYPES,
    ints_from_bytes,
    ints_to_bytes,
    pack_e4m3,
    unpack_e4m3,
    wire_row_bytes,
)

_functional = torch.ops._c10d_functional


def _launch(x_MX: torch.Tensor, output_splits: list[int], input_splits: list[int],
            group: dist.ProcessGroup) -> torch.Tensor:
    """Start a variable-size all-to-all; the result must go through ``_wait`` before it is read.
    Differentiable: its backward is the reverse exchange (registered by torch)."""
    return _functional.all_to_all_single(x_MX.contiguous(), output_splits, input_splits, group.group_name)


def _wait(x_RX: torch.Tensor) -> torch.Tensor:
    """Block until a launched exchange has landed in ``x_RX`` (differentiable: identity backward)."""
    return _functional.wait_tensor(x_RX)


class _Fp8Arrival(torch.autograd.Function):
    """The unpacked fp8 rows as a function of the rows that were sent (straight-through): forward
    waits for the packed exchange and unpacks it; backward sends the gradient home in bf16."""

    @staticmethod
    def forward(ctx, x_MD, packed_RX, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        ctx.group, ctx.dtype = group, x_MD.dtype
        return unpack_e4m3(_wait(packed_RX), x_MD.shape[1], x_MD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        grad_MD = _wait(_launch(grad_RD.to(torch.bfloat16), ctx.input_splits, ctx.output_splits, ctx.group))
        return grad_MD.to(ctx.dtype), None, None, None, None


@dataclass
class PendingRows:
    """Rows on their way (see ``launch_rows``)."""

    x_MD: torch.Tensor
    """The rows sent (the straight-through input of the fp8 arrival)."""
    in_flight_RX: torch.Tensor
    """The launched exchange in wire format; not to be read before ``wait``."""
    wire: str
    output_splits: list[int]
    input_splits: list[int]
    group: dist.ProcessGroup

    def wait(self) -> torch.Tensor:
        """The received rows ``[R, D]`` in the dtype of the rows sent."""
        if self.wire == "fp8_e4m3":
            return _Fp8Arrival.apply(self.x_MD, self.in_flight_RX, self.output_splits, self.input_splits, self.group)
        return _wait(self.in_flight_RX).to(self.x_MD.dtype)


def launch_rows(x_MD: torch.Tensor, *, wire: str, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> PendingRows:
    """Start sending rows ``input_splits[p]`` of ``x_MD`` to rank p in ``wire`` format ("none",
    "bf16" or "fp8_e4m3"); returns at once."""
    if wire == "fp8_e4m3":
        # The packed bytes carry no autograd; _Fp8Arrival connects the arrival to x_MD.
        with torch.no_grad():
            in_flight = _launch(pack_e4m3(x_MD), output_splits, input_splits, group)
    else:
        in_flight = _launch(x_MD.to(torch.bfloat16) if wire == "bf16" else x_MD, output_splits, input_splits,
                            group)
    return PendingRows(x_MD, in_flight, wire, output_splits, input_splits, group)


class EpExchanges(CountedExchanges):
    """Counted exchanges over ``ep_group`` (None: ep=1, nothing travels) and all-gathers over
    ``dp_group``, token rows in the wire format ``dispatch_dtype`` (moe.dispatch_dtype).
    ``ep_nodes``/``dp_nodes``: the node of each ep / dp rank (``ParallelDims.ep_rank_nodes``,
    ``dp_rank_nodes``), which makes the bytes exchanged with other nodes count as inter-node too."""

    def __init__(self, *, ep_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                 dispatch_dtype: str, ep_nodes: Sequence[int] | None = None,
                 dp_nodes: Sequence[int] | None = None) -> None:
        assert dispatch_dtype in DISPATCH_DTYPES, dispatch_dtype  # MoEConfig validates it for the user
        self.dispatch_dtype = dispatch_dtype
        self.compact_ints = dispatch_dtype != "none" and ep_group is not None
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.dp_group = dp_group
        if dp_group is not None:
            self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.ep_nodes, self.dp_nodes = ep_nodes, dp_nodes
        self.stats = CommStats()
        self.timer = CommTimer()

    def _launch_all_to_all(self, x_MX: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                           payload: str | None = None) -> Callable[[], torch.Tensor]:
        """Start a variable-size all-to-all over ep of the rows of ``x_MX``; returns ``wait()``,
        which blocks until the rows are here and returns them. Autograd sends the gradients back
        the same way. ``payload`` "dispatch" or "combine" marks token rows, which travel in the wire
        format of ``dispatch_dtype`` (the combine in bf16 when it is not "none")."""
        if self.ep_group is None:
            return lambda: x_MX
        group = self.ep_group
        wire = "none" if payload is None else self.dispatch_dtype
        wire = "bf16" if wire == "fp8_e4m3" and payload == "combine" else wire
        dim = x_MX.shape[1] if payload is not None else None  # gate weights travel as a column
        self.stats.count_exchange(input_splits=input_splits, output_splits=output_splits, own=self.ep_rank,
                                  row_bytes=row_bytes(x_MX) if wire == "none" else wire_row_bytes(x_MX.shape[1], wire),
                                  dispatch_row_elements=dim if payload == "dispatch" else None,
                                  peer_nodes=self.ep_nodes, combine=payload == "combine")
        if self.timer.enabled:
            # Timed means waited for at once: the span is the exchange, not the work overlapping it.
            y_RX = timed_exchange(lambda t: launch_rows(t, wire=wire, output_splits=output_splits,
                                                        input_splits=input_splits, group=group).wait(),
                                  x_MX, self.timer, kind=payload or "routing")
            return lambda: y_RX
        return launch_rows(x_MX, wire=wire, output_splits=output_splits, input_splits=input_splits,
                           group=group).wait

    def _exchange_ints(self, x_MX: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                       bound: int) -> torch.Tensor:
        """All-to-all over ep of integer rows in ``[0, bound]`` (no autograd)."""
        if self.ep_group is None:
            return x_MX
        buffers = self._int_buffers(x_MX, bound, output_splits, input_splits, self.ep_rank, self.ep_nodes)
        with self.timer.span("routing"):
            dist.all_to_all_single(buffers.recv, buffers.send, output_split_sizes=output_splits,
                                   input_split_sizes=input_splits, group=self.ep_group)
        return ints_from_bytes(buffers.recv, bound, x_MX.shape[1:]) if self.compact_ints else buffers.recv

    def _exchange_counts(self, send_PX: torch.Tensor, *, bound: int) -> torch.Tensor:
        """Row p of ``send_PX`` (counts in ``[0, bound]``) to ep rank p; returns what each rank
        sent here (no autograd)."""
        if self.ep_group is None:
            return send_PX
        ones = [1] * self.ep_size
        buffers = self._int_buffers(send_PX, bound, ones, ones, self.ep_rank, self.ep_nodes)
        with self.timer.span("routing"):
            dist.all_to_all_single(buffers.recv, buffers.send, group=self.ep_group)
        return ints_from_bytes(buffers.recv, bound, send_PX.shape[1:]) if self.compact_ints else buffers.recv

    def _all_gather(self, x: torch.Tensor, *, bound: int | None = None) -> torch.Tensor:
        """Every data-parallel rank's ``x``, concatenated along dim 0 in rank order (no autograd);
        ``bound``: integers in ``[0, bound]``."""
        compact_bound = bound if self.compact_ints else None
        splits = [x.shape[0]] * self.dp_size
        buffers = self._int_buffers(x, compact_bound, splits, splits, self.dp_rank, self.dp_nodes)
        with self.timer.span("routing"):
            all_gather_single(buffers.recv, buffers.send, group=self.dp_group)  # gloo wants the output flat on dim 0
        return buffers.recv if compact_bound is None else ints_from_bytes(buffers.recv, compact_bound, x.shape[1:])

    def _int_buffers(self, x_MX: torch.Tensor, bound: int | None, output_splits: list[int], input_splits: list[int],
                     own: int, nodes: Sequence[int] | None) -> _Buffers:
        """Send and receive buffers of a no-autograd exchange, counted. With ``compact_ints`` (a
        dispatch_dtype under expert parallelism) integers in ``[0, bound]`` travel as the bytes
        of the smallest integer type that holds them; otherwise as they are."""
        wire_MX = ints_to_bytes(x_MX, bound) if bound is not None and self.compact_ints else x_MX.contiguous()
        self.stats.count_exchange(input_splits=input_splits, output_splits=output_splits, own=own,
                                  row_bytes=row_bytes(wire_MX), peer_nodes=nodes)
        return _Buffers(send=wire_MX, recv=wire_MX.new_empty(sum(output_splits), *wire_MX.shape[1:]))


class _Buffers(NamedTuple):
    """Send and receive buffers of a no-autograd exchange."""

    send: torch.Tensor
    recv: torch.Tensor
