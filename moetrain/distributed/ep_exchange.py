"""The exchanges of the expert-parallel dispatcher (``moetrain.distributed.all_to_all``): token
rows, integer metadata and all-gathers over the ep and data-parallel groups. Every exchange goes
through these methods and is counted by them in ``stats`` (``CommStats``), and timed by ``timer``
when it is enabled (``log.comm_timing``: "dispatch", "combine" and their backward, "routing" for
the metadata).

Shape legend: M rows sent, R rows received, X elements per row, P ranks in the ep group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from moetrain.distributed.async_exchange import launch_rows
from moetrain.distributed.comm_stats import CommStats, CountedExchanges, row_bytes
from moetrain.distributed.comm_timer import CommTimer, timed_exchange
from moetrain.distributed.compressed_exchange import (
    DISPATCH_DTYPES,
    ints_from_bytes,
    ints_to_bytes,
    wire_row_bytes,
)
from moetrain.distributed.utils import all_gather_single


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

    def _all_to_all(self, x_MX: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                    payload: str | None = None) -> torch.Tensor:
        """Variable-size all-to-all over ep of the rows of ``x_MX``, waited for; see
        ``_launch_all_to_all``."""
        return self._launch_all_to_all(x_MX, output_splits=output_splits, input_splits=input_splits,
                                       payload=payload)()

    def _launch_all_to_all(self, x_MX: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                           payload: str | None = None) -> Callable[[], torch.Tensor]:
        """Start a variable-size all-to-all over ep of the rows of ``x_MX``; returns ``wait()``,
        which blocks until the rows are here and returns them. Autograd sends the gradients back
        the same way. ``payload`` "dispatch" or "combine" marks token rows, which travel in the wire
        format of ``dispatch_dtype`` (the combine in bf16 when it is not "none")."""
        if self.ep_group is None:
            return lambda: x_MX
        wire = "none" if payload is None else self.dispatch_dtype
        wire = "bf16" if wire == "fp8_e4m3" and payload == "combine" else wire
        dim = x_MX.shape[1] if payload is not None else None
        self.stats.count_exchange(input_splits=input_splits, output_splits=output_splits, own=self.ep_rank,
                                  row_bytes=row_bytes(x_MX) if wire == "none" else wire_row_bytes(dim, wire),
                                  dispatch_row_elements=dim if payload == "dispatch" else None,
                                  peer_nodes=self.ep_nodes, combine=payload == "combine")
        if self.timer.enabled:
            # Timed means waited for at once: the span is the exchange, not the work overlapping it.
            y_RX = timed_exchange(lambda t: launch_rows(t, wire=wire, output_splits=output_splits,
                                                        input_splits=input_splits, group=self.ep_group).wait(),
                                  x_MX, self.timer, kind=payload or "routing")
            return lambda: y_RX
        return launch_rows(x_MX, wire=wire, output_splits=output_splits, input_splits=input_splits,
                           group=self.ep_group).wait

    def _exchange_ints(self, x_MX: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                       bound: int) -> torch.Tensor:
        """All-to-all over ep of integer rows in ``[0, bound]`` (no autograd)."""
        if self.ep_group is None:
            return x_MX
        wire_MX, out_RX = self._int_buffers(x_MX, bound, output_splits, input_splits, self.ep_rank,
                                           self.ep_nodes)
        with self.timer.span("routing"):
            dist.all_to_all_single(out_RX, wire_MX, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                   group=self.ep_group)
        return ints_from_bytes(out_RX, bound, x_MX.shape[1:]) if self.compact_ints else out_RX

    def _exchange_counts(self, send_PX: torch.Tensor, *, bound: int) -> torch.Tensor:
        """Row p of ``send_PX`` (counts in ``[0, bound]``) to ep rank p; returns what each rank
        sent here (no autograd)."""
        if self.ep_group is None:
            return send_PX
        ones = [1] * self.ep_size
        wire_PX, recv_PX = self._int_buffers(send_PX, bound, ones, ones, self.ep_rank, self.ep_nodes)
        with self.timer.span("routing"):
            dist.all_to_all_single(recv_PX, wire_PX, group=self.ep_group)
        return ints_from_bytes(recv_PX, bound, send_PX.shape[1:]) if self.compact_ints else recv_PX

    def _all_gather(self, x: torch.Tensor, *, bound: int | None = None) -> torch.Tensor:
        """Every data-parallel rank's ``x``, concatenated along dim 0 in rank order (no autograd);
        ``bound``: integers in ``[0, bound]``."""
        compact = bound is not None and self.compact_ints
        splits = [x.shape[0]] * self.dp_size
        wire, out = self._int_buffers(x, bound if compact else None, splits, splits, self.dp_rank, self.dp_nodes)
        with self.timer.span("routing"):
            all_gather_single(out, wire, group=self.dp_group)  # gloo wants the output flat along dim 0
        return ints_from_bytes(out, bound, x.shape[1:]) if compact else out

    def _int_buffers(self, x_MX: torch.Tensor, bound: int | None, output_splits: list[int], input_splits: list[int],
                     own: int, nodes: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Send and receive buffers of a no-autograd exchange, counted. With ``compact_ints`` (a
        dispatch_dtype under expert parallelism) integers in ``[0, bound]`` travel as the bytes
        of the smallest integer type that holds them; otherwise as they are."""
        wire_MX = ints_to_bytes(x_MX, bound) if bound is not None and self.compact_ints else x_MX.contiguous()
        self.stats.count_exchange(input_splits=input_splits, output_splits=output_splits, own=own,
                                  row_bytes=row_bytes(wire_MX), peer_nodes=nodes)
        return wire_MX, wire_MX.new_empty(sum(output_splits), *wire_MX.shape[1:])
