"""Traffic counters of the expert-parallel exchanges (``AllToAllDispatcher.stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommStats:
    """Bytes moved by the expert-parallel exchanges of this rank since the last reset.

    Token exchanges are counted in the forward pass only; backward repeats each of them in reverse
    with the same sizes, so the ratio is the same with or without it. Under activation
    checkpointing the recomputed forward counts again, actual and minimum alike.
    """

    bytes_sent: int = 0
    """Token rows and routing counts sent to other ranks (a rank's chunk to itself is not sent)."""
    bytes_received: int = 0
    min_bytes: int = 0
    """What must move, sent plus received: every kept routed copy whose expert lives on another
    rank goes there and comes back (D * bytes per element each way), plus the dropless count
    exchange. Summed over ranks this is ``2 * remote copies * D * bytes_per_element`` each way."""

    @property
    def ratio(self) -> float:
        """Actual / minimum traffic; 1.0 when nothing was exchanged."""
        if self.min_bytes == 0:
            return 1.0 if self.bytes_sent + self.bytes_received == 0 else float("inf")
        return (self.bytes_sent + self.bytes_received) / self.min_bytes

    def count_exchange(self, *, input_splits: list[int], output_splits: list[int], own: int,
                       row_bytes: int) -> None:
        """Add one exchange: ``input_splits[p]`` rows of ``row_bytes`` to rank p, ``output_splits[p]``
        from it. The one place traffic is counted; a rank's chunk to itself does not move."""
        self.bytes_sent += (sum(input_splits) - input_splits[own]) * row_bytes
        self.bytes_received += (sum(output_splits) - output_splits[own]) * row_bytes

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received,
                         self.min_bytes + other.min_bytes)
