"""Traffic counters of the expert-parallel exchanges (``AllToAllDispatcher.stats``, and the
expert-tensor-parallel gathers around them)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_COUNT_BYTES = 8
"""An int64 routing count: the uncompressed minimum counts them at this size."""


@dataclass
class CommStats:
    """Bytes moved by the expert-parallel exchanges of this rank since the last reset.

    Token exchanges are counted in the forward pass only. Backward repeats each differentiable
    one in reverse with the same rows: in the payload dtype with ``moe.dispatch_dtype`` "none"
    (so the ratios are the same with or without it), in bf16 (2 bytes per element, no scales)
    with "bf16" and "fp8_e4m3". Under activation checkpointing the recomputed forward counts
    again, actual and minimum alike. Compiled (``train.compile``), the traced code adds to these
    Python ints as symbols (``parallelize.compile_dynamic``), so a step with other split sizes
    reuses the compiled code.
    """

    bytes_sent: int = 0
    """Token rows (as they travel: compressed ones with their scales) and routing metadata sent to
    other ranks (a rank's chunk to itself is not sent)."""
    bytes_received: int = 0
    min_bytes: int = 0
    """What must move uncompressed, sent plus received: every kept routed copy whose expert lives
    on another rank goes there and comes back (D * bytes of the compute dtype each way), plus the
    int64 dropless count exchange. Summed over ranks this is ``2 * remote copies * D *
    bytes_per_element`` each way. Compression (moe.dispatch_dtype) can take the ratio below 1."""
    min_bytes_fp32: int = 0
    """``min_bytes`` with fp32 token rows (4 bytes per element): the reference of ``ratio_vs_fp32``."""
    dispatch_bytes: int = 0
    """Of bytes_sent + bytes_received, the forward dispatch payload (token rows there, with their
    fp8 scales; not the combine, not the metadata)."""
    dispatch_min_bytes_fp32: int = 0
    """The bytes those same dispatch rows take as fp32 (sent plus received)."""
    combine_bytes: int = 0
    """Of bytes_sent + bytes_received, the forward combine payload (expert outputs going home); the
    rest besides the dispatch is routing metadata (counts, row indices, gate weights, all-gathers)."""
    inter_node_bytes: int = 0
    """Of bytes_sent + bytes_received, those exchanged with ranks on other nodes (the slow link).
    Counted for the exchanges told the node of each peer (``ParallelDims.ranks_per_node``); the
    rest, ``intra_node_bytes``, stays inside the node."""
    inter_node_dispatch_bytes: int = 0
    """Of inter_node_bytes, the forward dispatch payload (token rows, with their fp8 scales)."""
    etp_bytes: int = 0
    """Outside the counters above: the expert-tensor-parallel collectives (``parallel.etp``), sent
    plus received, forward only: the all-gather of the group's tokens, chosen experts and gate
    weights (and token counts when the ranks' differ) and the reduce-scatter of the partial outputs,
    each ``etp - 1`` chunks out and ``etp - 1`` in (padding rows included)."""

    @property
    def ratio(self) -> float:
        """Actual / minimum traffic; 1.0 when nothing was exchanged."""
        return _ratio(self.bytes_sent + self.bytes_received, self.min_bytes)

    @property
    def ratio_vs_fp32(self) -> float:
        """Actual traffic / the uncompressed minimum with fp32 rows."""
        return _ratio(self.bytes_sent + self.bytes_received, self.min_bytes_fp32)

    @property
    def dispatch_ratio_vs_fp32(self) -> float:
        """Forward dispatch payload / the same rows in fp32: (D + 4 * ceil(D / 128)) / (4 * D) for fp8."""
        return _ratio(self.dispatch_bytes, self.dispatch_min_bytes_fp32)

    @property
    def intra_node_bytes(self) -> int:
        """Bytes exchanged with ranks on this rank's node (all of them without a node layout)."""
        return self.bytes_sent + self.bytes_received - self.inter_node_bytes

    def count_exchange(self, *, input_splits: list[int], output_splits: list[int], own: int,
                       row_bytes: int, dispatch_row_elements: int | None = None,
                       peer_nodes: Sequence[int] | None = None, combine: bool = False) -> None:
        """Add one exchange: ``input_splits[p]`` rows of ``row_bytes`` to rank p, ``output_splits[p]``
        from it. The one place traffic is counted; a rank's chunk to itself does not move.
        ``dispatch_row_elements`` (D) marks the forward dispatch payload, ``combine`` the forward
        combine payload. ``peer_nodes[p]``, the
        node of group rank p, makes the rows of peers on another node than ``own``'s inter-node."""
        rows_sent = sum(input_splits) - input_splits[own]
        rows_received = sum(output_splits) - output_splits[own]
        self.bytes_sent += rows_sent * row_bytes
        self.bytes_received += rows_received * row_bytes
        if dispatch_row_elements is not None:
            self.dispatch_bytes += (rows_sent + rows_received) * row_bytes
            self.dispatch_min_bytes_fp32 += (rows_sent + rows_received) * dispatch_row_elements * 4
        if combine:
            self.combine_bytes += (rows_sent + rows_received) * row_bytes
        if peer_nodes is not None:
            assert len(peer_nodes) == len(input_splits), (peer_nodes, input_splits)
            far = sum(i + o for i, o, node in zip(input_splits, output_splits, peer_nodes, strict=True)
                      if node != peer_nodes[own])
            self.inter_node_bytes += far * row_bytes
            if dispatch_row_elements is not None:
                self.inter_node_dispatch_bytes += far * row_bytes

    def count_group_collective(self, *, chunk_bytes: int, group_size: int) -> None:
        """Add one etp all-gather or reduce-scatter of ``chunk_bytes`` per rank (see ``etp_bytes``)."""
        self.etp_bytes += 2 * (group_size - 1) * chunk_bytes

    def count_minimum(self, *, remote_rows: int, dim: int, element_bytes: int, num_counts: int) -> None:
        """Add the minimum of one dispatch: ``remote_rows`` rows (sent plus received) of ``dim``
        elements there and back, and ``num_counts`` routing counts each way."""
        counts = 2 * num_counts * _COUNT_BYTES
        self.min_bytes += 2 * remote_rows * dim * element_bytes + counts
        self.min_bytes_fp32 += 2 * remote_rows * dim * 4 + counts

    def as_metrics(self) -> dict[str, float]:
        """The counters as ``metrics.jsonl`` keys."""
        return {"a2a_bytes": self.bytes_sent + self.bytes_received, "a2a_bytes_ratio": self.ratio,
                "a2a_bytes_ratio_vs_fp32": self.ratio_vs_fp32, "a2a_dispatch_bytes": self.dispatch_bytes,
                "a2a_combine_bytes": self.combine_bytes,
                "a2a_routing_bytes": self.bytes_sent + self.bytes_received - self.dispatch_bytes - self.combine_bytes,
                "a2a_dispatch_ratio_vs_fp32": self.dispatch_ratio_vs_fp32,
                "a2a_inter_node_bytes": self.inter_node_bytes, "a2a_intra_node_bytes": self.intra_node_bytes,
                "a2a_inter_node_dispatch_bytes": self.inter_node_dispatch_bytes, "etp_bytes": self.etp_bytes}

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


class CountedExchanges:
    """Holds the ``stats`` (``CommStats``) of an object's exchanges and hands them out."""

    stats: CommStats

    def read_comm_stats(self, *, reset: bool = True) -> CommStats:
        """The counters since the last reset (started again when ``reset``)."""
        stats = self.stats
        if reset:
            self.stats = CommStats()
        return stats


def _ratio(actual: int, reference: int) -> float:
    """``actual / reference``; 1.0 when nothing moved, inf when something moved that needed not."""
    if reference == 0:
        return 1.0 if actual == 0 else float("inf")
    return actual / reference


def row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row (dim-0 slice) of ``x``."""
    return math.prod(x.shape[1:]) * x.element_size()
