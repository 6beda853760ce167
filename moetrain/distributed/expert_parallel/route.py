"""Records of the all-to-all dispatcher (``moetrain.distributed.expert_parallel.dispatcher``): the route of one
dispatch, what one exchange sends (the whole batch, or one chunk of it), the state its combine
needs, and the index math that cuts a route into chunks (``moe.dispatch_chunks``).

Chunks are ranges of this rank's tokens: chunk c holds tokens ``bounds[c]:bounds[c+1]`` and all
their kept copies, so a token's copies, its unique rows (once per rank) and its combine live in one
chunk. Drops are decided over the whole batch first; chunking only partitions the kept copies.
Inside a chunk the copies keep the order the whole batch would give them (by expert, then drop
priority), so each chunk is the unchunked dispatch restricted to its tokens.

Shape legend: T tokens on this rank, E experts, L local experts, K experts per token, N = T*K
routed copies, M copies this rank sends (kept), P ranks in the ep group, C chunks,
S copies sorted by expert (S = N).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from moetrain.models.moe.token_bags import TokenBags


@dataclass
class _ChunkCounts:
    """Per-chunk split sizes of a chunked route (host ints) and receive counts (device)."""

    bounds: list[int]
    """Token range of chunk c: ``bounds[c]:bounds[c + 1]``."""
    chunk_T: torch.Tensor
    """Chunk of each local token."""
    send_splits: list[list[int]]
    """``[c][p]``: copies this rank sends to ep rank p in chunk c."""
    recv_splits: list[list[int]]
    num_recv_CPL: torch.Tensor
    """Copies each ep peer sends to each local expert of this rank, per chunk."""
    send_rows: list[list[int]] | None = None
    """Once per rank: ``[c][p]`` unique rows sent to ep rank p in chunk c."""
    recv_rows: list[list[int]] | None = None


@dataclass
class _Route:
    """Steps 1-2 of a dispatch: which copies this rank keeps, where they go, what it receives."""

    num_tokens: int
    top_k: int
    idx_N: torch.Tensor
    order_N: torch.Tensor
    """Copies sorted by global expert (so by destination rank), each block in drop-priority order."""
    num_routed_E: torch.Tensor
    num_send_E: torch.Tensor
    """Copies of each global expert this rank keeps and sends (all of them when dropless)."""
    num_recv_PL: torch.Tensor
    """Copies each ep peer sends to each local expert of this rank."""
    send_splits: list[int]
    recv_splits: list[int]
    num_send_remote: int
    """Kept copies whose expert lives on another rank."""
    present_PT: torch.Tensor | None = None
    """Once per rank: (destination rank, token) pairs of the kept copies."""
    send_rows: list[int] | None = None
    """Once per rank: unique rows sent to each peer."""
    recv_rows: list[int] | None = None
    chunks: _ChunkCounts | None = None
    """With ``moe.dispatch_chunks`` > 1: the per-chunk splits (None: one exchange)."""


@dataclass
class _Sends:
    """What one exchange sends and receives: the whole batch, or one chunk (whose token and copy
    ids then start at the chunk's first token)."""

    num_tokens: int
    top_k: int
    idx_N: torch.Tensor
    order_M: torch.Tensor
    """Token-major id ``t * K + k`` of each kept copy, in send order (by expert, then priority)."""
    num_recv_PL: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    present_PT: torch.Tensor | None = None
    send_rows: list[int] | None = None
    recv_rows: list[int] | None = None
    all_kept: bool = True
    """Every copy of this rank's whole batch is kept. Per copy, a token's copies are then summed
    in top-k order (``bags_from_copies``), else in send order; a chunk follows its batch, so it
    adds the same terms in the same order (a fused multiply-add is not commutative)."""


@dataclass
class _PerCopyState:
    token_idx_M: torch.Tensor
    """Local token of each sent copy, in send order."""
    weights_M: torch.Tensor
    num_tokens: int
    group_R: torch.Tensor | None
    """Received row at each expert-grouped position (None: already grouped, ep=1)."""
    ungroup_R: torch.Tensor | None
    """Position in expert-grouped order of each received row (the inverse of group_R)."""
    send_splits: list[int]
    recv_splits: list[int]
    bags: TokenBags
    """Sent copies of each local token."""


@dataclass
class _OncePerRankState:
    row_M: torch.Tensor
    """Received unique row of each expert-grouped copy on this rank."""
    weights_M: torch.Tensor
    """Gate weight of each expert-grouped copy on this rank (applied here, before the way back)."""
    num_rows: int
    """Unique rows this rank received."""
    send_token_U: torch.Tensor
    """Local token of each unique row this rank sent, in send order."""
    send_rows: list[int]
    recv_rows: list[int]
    row_bags: TokenBags
    """Copies of each received unique row."""
    token_bags: TokenBags
    """Sent unique rows of each local token."""


def whole_batch(route: _Route, order_M: torch.Tensor) -> _Sends:
    """The one exchange of an unchunked dispatch."""
    return _Sends(route.num_tokens, route.top_k, route.idx_N, order_M, route.num_recv_PL, route.send_splits,
                  route.recv_splits, route.present_PT, route.send_rows, route.recv_rows, _all_kept(route))


def _all_kept(route: _Route) -> bool:
    return sum(route.send_splits) == route.num_tokens * route.top_k


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[int]:
    """Token boundaries of ``num_chunks`` contiguous chunks whose sizes differ by at most one, the
    larger first; with fewer tokens than chunks the last chunks are empty. ``[0, ..., T]``."""
    base, extra = divmod(num_tokens, num_chunks)
    bounds = [0]
    for c in range(num_chunks):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def chunk_of_tokens(bounds: list[int], device: torch.device) -> torch.Tensor:
    """Chunk of each token, ``[T]``."""
    sizes = torch.tensor([b - a for a, b in pairwise(bounds)], device=device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes, output_size=bounds[-1])


def kept_per_chunk(idx_N: torch.Tensor, order_N: torch.Tensor, num_routed_E: torch.Tensor,
                   num_send_E: torch.Tensor, chunk_T: torch.Tensor, *, num_chunks: int, top_k: int) -> torch.Tensor:
    """Kept copies per (chunk, global expert), ``[C, E]``: the kept copies of expert e are the
    first ``num_send_E[e]`` of its block of ``order_N`` (the sort is in drop-priority order)."""
    E = num_routed_E.numel()
    expert_S = idx_N[order_N]
    block_start_E = torch.cumsum(num_routed_E, dim=0) - num_routed_E
    rank_in_expert_S = torch.arange(expert_S.numel(), device=idx_N.device) - block_start_E[expert_S]
    keep_S = rank_in_expert_S < num_send_E[expert_S]
    chunk_S = chunk_T[torch.div(order_N, top_k, rounding_mode="floor")]
    counts_CE = torch.zeros(num_chunks * E, dtype=torch.int64, device=idx_N.device)
    return counts_CE.index_put_((chunk_S * E + expert_S,), keep_S.long(), accumulate=True).view(num_chunks, E)


def split_into_chunks(route: _Route, order_M: torch.Tensor) -> list[_Sends]:
    """The exchanges of a chunked dispatch: chunk c's kept copies, in the order the whole batch
    sends them (a stable sort by chunk keeps the expert-then-priority order inside each chunk)."""
    ch, K = route.chunks, route.top_k
    chunk_M = ch.chunk_T[torch.div(order_M, K, rounding_mode="floor")]
    order_by_chunk_M = order_M.index_select(0, torch.sort(chunk_M, stable=True).indices)
    pieces = order_by_chunk_M.split([sum(s) for s in ch.send_splits])
    sends = []
    for c, order_c in enumerate(pieces):
        t0, t1 = ch.bounds[c], ch.bounds[c + 1]
        dedup = route.present_PT is not None
        sends.append(_Sends(
            t1 - t0, K, route.idx_N[t0 * K:t1 * K], order_c - t0 * K, ch.num_recv_CPL[c], ch.send_splits[c],
            ch.recv_splits[c], route.present_PT[:, t0:t1] if dedup else None,
            ch.send_rows[c] if dedup else None, ch.recv_rows[c] if dedup else None, _all_kept(route)))
    return sends
