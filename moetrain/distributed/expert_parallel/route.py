"""The routing step of the all-to-all dispatchers (``AllToAllDispatcher`` and the hierarchical one):
which copies this rank keeps, where they go and what it receives, as a ``Route``, and the
``Exchange`` records that cut a route into the exchanges that send it (the whole batch, or one per
chunk with ``moe.dispatch_chunks``).

``AllToAllRouting.route`` is the only phase of a dispatch that exchanges routing counts: the count
exchange (dropless) or the all-gather of every data-parallel rank's counts (with a capacity
factor), the per-chunk and once-per-rank counts, then one host sync for every split size.

Chunks are ranges of this rank's tokens: chunk c holds tokens ``bounds[c]:bounds[c+1]`` and all
their kept copies, so a token's copies, its unique rows (once per rank) and its combine live in one
chunk. Drops are decided over the whole batch first; chunking only partitions the kept copies.
Inside a chunk the copies keep the order the whole batch would give them (by expert, then drop
priority), so each chunk is the unchunked dispatch restricted to its tokens.

Shape legend: T tokens on this rank, D model dim, E experts, L = E/ep local experts, K experts per
token, N = T*K routed copies, M copies this rank sends (kept), P ranks in the ep group, C chunks,
W data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise

import torch
import torch.distributed as dist

from moetrain.distributed.expert_parallel.exchange import EpExchanges
from moetrain.distributed.expert_parallel.index import (
    chunk_bounds,
    chunk_of_tokens,
    kept_mask,
    kept_per_chunk,
    kept_positions,
    to_host,
)
from moetrain.distributed.expert_parallel.wire import TOKEN_BOUND
from moetrain.models.moe.dispatcher import (
    capacity_keep_mask,
    count_per_expert,
    expert_capacity,
    sort_by_expert,
)


@dataclass
class UniqueRows:
    """Once per rank: the rows that travel when a token goes to a rank once, however many of its
    experts live there."""

    present_PT: torch.Tensor
    """(destination rank, token) pairs of the kept copies."""
    send_rows: list[int]
    """Unique rows sent to each ep peer."""
    recv_rows: list[int]


@dataclass
class ChunkCounts:
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
    send_rows: list[list[int]] | None
    """Once per rank: ``[c][p]`` unique rows sent to ep rank p in chunk c (None: per copy)."""
    recv_rows: list[list[int]] | None

    @property
    def sizes(self) -> list[int]:
        """Tokens of each chunk."""
        return [b - a for a, b in pairwise(self.bounds)]


@dataclass
class Exchange:
    """What one exchange sends and receives: the whole batch, or one chunk (whose token and copy
    ids then start at the chunk's first token)."""

    first_token: int
    """This exchange's first token among the rank's tokens."""
    num_tokens: int
    top_k: int
    idx_N: torch.Tensor
    order_M: torch.Tensor
    """Token-major id ``t * K + k`` of each kept copy, in send order (by expert, then priority)."""
    num_recv_PL: torch.Tensor
    """Copies each ep peer sends to each local expert of this rank."""
    send_splits: list[int]
    recv_splits: list[int]
    unique: UniqueRows | None
    """Once per rank: the unique rows of this exchange (None: one row per copy)."""
    all_kept: bool
    """Every copy of this rank's whole batch is kept. Per copy, a token's copies are then summed
    in top-k order (``bags_from_copies``), else in send order; a chunk follows its batch, so it
    adds the same terms in the same order (a fused multiply-add is not commutative)."""


@dataclass
class Route:
    """Steps 1-2 of a dispatch: which copies this rank keeps, where they go, what it receives."""

    num_tokens: int
    top_k: int
    idx_N: torch.Tensor
    order_N: torch.Tensor
    """Copies sorted by global expert (so by destination rank), each block in drop-priority order."""
    order_M: torch.Tensor
    """The kept copies of ``order_N``, in send order: the first ``num_send_E[e]`` of each block."""
    num_routed_E: torch.Tensor
    num_send_E: torch.Tensor
    """Copies of each global expert this rank keeps and sends (all of them when dropless)."""
    num_recv_PL: torch.Tensor
    """Copies each ep peer sends to each local expert of this rank."""
    send_splits: list[int]
    recv_splits: list[int]
    num_send_remote: int
    """Kept copies whose expert lives on another rank."""
    unique: UniqueRows | None
    """Once per rank (``moe.dispatch_dedup``, and the hierarchical exchange): the unique rows."""
    chunks: ChunkCounts | None
    """With ``moe.dispatch_chunks`` > 1: the per-chunk splits (None: one exchange)."""
    num_token_rank_sends: torch.Tensor | None
    """``DispatchResult.num_token_rank_sends`` (None at ep = 1)."""

    @property
    def num_dropped(self) -> torch.Tensor:
        """Copies dropped by capacity (0-dim, on the device)."""
        return (self.num_routed_E - self.num_send_E).sum()

    def exchanges(self) -> list[Exchange]:
        """The exchanges that send this route: the whole batch, or with chunks chunk c's kept
        copies, in the order the whole batch sends them (a stable sort by chunk keeps the
        expert-then-priority order inside each chunk). No communication here."""
        all_kept = sum(self.send_splits) == self.num_tokens * self.top_k
        if self.chunks is None:
            return [Exchange(0, self.num_tokens, self.top_k, self.idx_N, self.order_M, self.num_recv_PL,
                             self.send_splits, self.recv_splits, self.unique, all_kept)]
        ch, K = self.chunks, self.top_k
        chunk_M = ch.chunk_T[torch.div(self.order_M, K, rounding_mode="floor")]
        order_by_chunk_M = self.order_M.index_select(0, torch.sort(chunk_M, stable=True).indices)
        pieces = order_by_chunk_M.split([sum(s) for s in ch.send_splits])
        out = []
        for c, order_c in enumerate(pieces):
            t0, t1 = ch.bounds[c], ch.bounds[c + 1]
            unique = None
            if self.unique is not None:
                assert ch.send_rows is not None and ch.recv_rows is not None, "once per rank: rows per chunk"
                unique = UniqueRows(self.unique.present_PT[:, t0:t1], ch.send_rows[c], ch.recv_rows[c])
            out.append(Exchange(t0, t1 - t0, K, self.idx_N[t0 * K:t1 * K], order_c - t0 * K, ch.num_recv_CPL[c],
                                ch.send_splits[c], ch.recv_splits[c], unique, all_kept))
        return out


@dataclass
class _ChunkIndex:
    """The token ranges of the chunks (``moe.dispatch_chunks``)."""

    bounds: list[int]
    chunk_T: torch.Tensor
    num_chunks: int


@dataclass
class _LocalCounts:
    """Step 1 of the route, this rank's own routing (no communication)."""

    idx_N: torch.Tensor
    order_N: torch.Tensor
    num_routed_E: torch.Tensor
    chunks: _ChunkIndex | None


@dataclass
class _KeptCounts:
    """Step 2 of the route: the copies kept, and those received."""

    num_send_E: torch.Tensor
    num_recv_PL: torch.Tensor | None
    """None: dropless and chunked, where the per-chunk exchange tells it."""
    num_remote: torch.Tensor
    num_routed_W: torch.Tensor | None
    """With a capacity factor: the routed copies of every data-parallel rank."""


@dataclass
class _PerChunk:
    """Step 2b with chunks: kept copies per (chunk, ep peer, local expert), sent and received."""

    num_send_CPL: torch.Tensor
    num_recv_CPL: torch.Tensor


@dataclass
class _UniqueCounts:
    """Step 2b once per rank, on the device."""

    present_PT: torch.Tensor
    send_PC: torch.Tensor
    """Unique rows sent to each peer, per chunk (one column unchunked)."""
    recv_PC: torch.Tensor


class AllToAllRouting(EpExchanges):
    """The routing step shared by the flat and hierarchical all-to-all dispatchers.

    ``ep_group=None`` means ep=1 (data parallelism with a capacity factor, where only the global
    drops matter). ``dp_group`` (all data-parallel ranks, in global rank order) is needed with a
    capacity factor only. ``dedup`` sends a token once per destination rank (moe.dispatch_dedup);
    the route then finds those unique rows. Expert ``e`` lives on ep rank ``e // L`` as its local
    expert ``e % L``.
    """

    def __init__(self, num_experts: int, *, ep_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None = None, dedup: bool = False, dispatch_dtype: str = "none",
                 ep_nodes: Sequence[int] | None = None, dp_nodes: Sequence[int] | None = None) -> None:
        super().__init__(ep_group=ep_group, dp_group=dp_group, dispatch_dtype=dispatch_dtype, ep_nodes=ep_nodes,
                         dp_nodes=dp_nodes)
        self.num_experts = num_experts
        self.dedup = dedup and ep_group is not None
        # ParallelDims checks this rule for the user; here it is the invariant of the layout.
        assert num_experts % self.ep_size == 0, f"ep group of {self.ep_size} for {num_experts} experts"
        self.num_local_experts = num_experts // self.ep_size
        if dp_group is not None:
            dp_ranks = dist.get_process_group_ranks(dp_group)
            ep_ranks = [dist.get_rank()] if ep_group is None else dist.get_process_group_ranks(ep_group)
            # Row in the all-gathered [W, E] counts of each member of this ep group.
            self._ep_members_in_dp = torch.tensor([dp_ranks.index(r) for r in ep_ranks])

    def route(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
              capacity_factor: float | Fraction | None, drop_policy: str, num_chunks: int = 1) -> Route:
        """Steps 1-2 of a dispatch: count, exchange the counts (or decide the global drops), one
        host sync. Communicates routing counts only. Counts the minimum bytes of ``x_TD``'s rows
        in ``stats``."""
        num_tokens, top_k = idx_TK.shape
        P = self.ep_size
        # 1. Count and sort this rank's copies (no communication).
        local = self._count_copies(idx_TK, weights_TK, drop_policy=drop_policy, num_chunks=num_chunks)
        # 2. Exchange counts: how many copies each ep peer sends to each of my local experts; with a
        #    capacity factor, all-gather every data-parallel rank's counts and decide the drops.
        if capacity_factor is None:
            kept = self._dropless(local)
        else:
            kept = self._global_drops(local.num_routed_E, idx_TK, weights_TK, capacity_factor=capacity_factor,
                                      drop_policy=drop_policy)
        # 2b. With chunks, every chunk's counts in one more exchange; once per rank, the unique rows'.
        per_chunk = None if local.chunks is None else self._exchange_chunk_counts(local, kept.num_send_E, top_k)
        num_recv_PL = kept.num_recv_PL
        if num_recv_PL is None:
            assert per_chunk is not None, "dropless without chunks: the counts were exchanged in step 2"
            num_recv_PL = per_chunk.num_recv_CPL.sum(dim=0)
        unique = self._exchange_unique_rows(local, kept.num_send_E, top_k) if self.dedup else None
        # 2c. The one host sync of the layer: all_to_all_single takes its split sizes as Python ints.
        host = to_host(
            send_splits=kept.num_send_E.view(P, -1).sum(dim=1), recv_splits=num_recv_PL.sum(dim=1),
            num_send_remote=kept.num_remote, routed_W=kept.num_routed_W,
            send_rows=None if unique is None else unique.send_PC.reshape(P, -1).sum(dim=1),
            recv_rows=None if unique is None else unique.recv_PC.reshape(P, -1).sum(dim=1),
            chunk_send=None if per_chunk is None else per_chunk.num_send_CPL.sum(dim=2),
            chunk_recv=None if per_chunk is None else per_chunk.num_recv_CPL.sum(dim=2),
            chunk_send_rows=None if per_chunk is None or unique is None else unique.send_PC.t(),
            chunk_recv_rows=None if per_chunk is None or unique is None else unique.recv_PC.t())
        if "routed_W" in host and any(n != num_tokens * top_k for n in host["routed_W"]):
            raise ValueError(f"capacity mode under data parallelism needs the same token count on every "
                             f"rank; routed copies per rank: {host['routed_W']}")
        order_M = local.order_N
        if capacity_factor is not None:
            # The kept copies are the first num_send_E[e] of each block (the sort is in priority order).
            order_M = order_M.index_select(0, kept_positions(local.num_routed_E, kept.num_send_E,
                                                             sum(host["send_splits"])))
        # idx_TK.reshape(-1) again rather than local.idx_N: under train.compile this line runs after the
        # host read's graph break, and a view input there (idx_N of idx_TK) gets a size symbol that
        # dynamo cannot guard on when inductor adds a guard on it in a cold compile (torch 2.13).
        route = Route(
            num_tokens, top_k, idx_TK.reshape(-1), local.order_N, order_M, local.num_routed_E, kept.num_send_E,
            num_recv_PL,
            host["send_splits"], host["recv_splits"], host["num_send_remote"][0],
            unique=None if unique is None else UniqueRows(unique.present_PT, host["send_rows"], host["recv_rows"]),
            chunks=None if per_chunk is None else _chunk_counts(local, per_chunk, host, P),
            num_token_rank_sends=self._token_rank_sends(idx_TK) if self.ep_size > 1 else None)
        self._count_minimum(route, dim=x_TD.shape[1], element_bytes=x_TD.element_size())
        return route

    # ----- the steps of the route ------------------------------------------------------------------

    def _count_copies(self, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *, drop_policy: str,
                      num_chunks: int) -> _LocalCounts:
        """Step 1, no communication: copies per expert, sorted by global expert id, which also
        orders them by destination rank (rank s holds experts s*L .. s*L+L-1)."""
        idx_N = idx_TK.reshape(-1)
        num_routed_E = count_per_expert(idx_N, self.num_experts)
        order_N = sort_by_expert(idx_TK, weights_TK, drop_policy=drop_policy)
        if num_chunks == 1:
            return _LocalCounts(idx_N, order_N, num_routed_E, None)
        bounds = chunk_bounds(idx_TK.shape[0], num_chunks)
        return _LocalCounts(idx_N, order_N, num_routed_E, _ChunkIndex(bounds, chunk_of_tokens(bounds, idx_N.device),
                                                                      num_chunks))

    def _dropless(self, local: _LocalCounts) -> _KeptCounts:
        """Step 2 dropless: every copy is sent. The counts are exchanged here unless chunked (then
        the per-chunk exchange tells them)."""
        P, L = self.ep_size, self.num_local_experts
        num_send_E = local.num_routed_E
        num_recv_PL = None
        if local.chunks is None:
            num_recv_PL = self._exchange_counts(num_send_E.view(P, L), bound=TOKEN_BOUND)
        # Counted from the routing itself (independent of the split sizes that the exchange
        # uses), so the traffic ratio checks the splits.
        num_remote = (torch.div(local.idx_N, L, rounding_mode="floor") != self.ep_rank).sum()
        return _KeptCounts(num_send_E, num_recv_PL, num_remote, None)

    def _global_drops(self, num_routed_E: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                      capacity_factor: float | Fraction, drop_policy: str) -> _KeptCounts:
        """Step 2 with a capacity factor: the copies this rank keeps per global expert, those each
        ep peer sends to my local experts, and the routed copies of every data-parallel rank."""
        if self.dp_group is None:
            raise ValueError("a capacity factor under expert/data parallelism needs the AllToAllDispatcher's "
                             "dp_group")
        num_tokens, top_k = idx_TK.shape
        L, j = self.num_local_experts, self.ep_rank
        # Capacity of the global batch; every rank holds T tokens (TrainConfig.grad_accum_steps),
        # which the host sync verifies.
        capacity = expert_capacity(num_tokens * self.dp_size, num_experts=self.num_experts, top_k=top_k,
                                   capacity_factor=capacity_factor)
        num_routed_WE = self._all_gather(num_routed_E, bound=TOKEN_BOUND).view(self.dp_size, self.num_experts)
        kept_WE = self._global_keep_counts(num_routed_WE, idx_TK, weights_TK, capacity=capacity,
                                           drop_policy=drop_policy)
        # Every rank's kept counts are known after the all-gather: no second exchange needed.
        members_P = self._ep_members_in_dp.to(kept_WE.device)
        num_recv_PL = kept_WE.index_select(0, members_P)[:, j * L:(j + 1) * L]
        num_send_E = kept_WE[self.dp_rank]
        num_remote = num_send_E.sum() - num_send_E[j * L:(j + 1) * L].sum()
        return _KeptCounts(num_send_E, num_recv_PL, num_remote, num_routed_WE.sum(dim=1))

    def _global_keep_counts(self, num_routed_WE: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                            capacity: int, drop_policy: str) -> torch.Tensor:
        """Copies each data-parallel rank keeps per expert, ``[W, E]``, exactly as one process
        holding the global batch (the ranks' batches concatenated in rank order) keeps them."""
        if drop_policy == "position":
            # Earlier ranks' copies come first in the global batch and win capacity.
            earlier_WE = torch.cumsum(num_routed_WE, dim=0) - num_routed_WE
            return torch.minimum(num_routed_WE, (capacity - earlier_WE).clamp(min=0))
        # "score": the top-capacity copies of each expert by router weight over the global batch,
        # ties to the earlier global position. Gather every rank's (expert, weight) pairs, which
        # are D times smaller than the tokens, and replay the single-process selection.
        idx_WTK = self._all_gather(idx_TK, bound=self.num_experts - 1)
        weights_WTK = self._all_gather(weights_TK.detach())
        order_G = sort_by_expert(idx_WTK, weights_WTK, drop_policy="score")
        idx_G = idx_WTK.reshape(-1)
        keep_G = capacity_keep_mask(idx_G[order_G], num_routed_WE.sum(dim=0), capacity)
        rank_G = torch.div(order_G, idx_TK.numel(), rounding_mode="floor")
        return torch.zeros_like(num_routed_WE).index_put_((rank_G, idx_G[order_G]), keep_G.long(), accumulate=True)

    def _exchange_chunk_counts(self, local: _LocalCounts, num_send_E: torch.Tensor, top_k: int) -> _PerChunk:
        """Step 2b with chunks: the kept copies per (chunk, ep peer, local expert) this rank sends,
        and in one exchange those it receives (with a capacity factor the all-gather told the
        totals only, so this exchange is added)."""
        assert local.chunks is not None, "called for a chunked route"
        P, L, C = self.ep_size, self.num_local_experts, local.chunks.num_chunks
        num_send_CPL = kept_per_chunk(local.idx_N, local.order_N, local.num_routed_E, num_send_E,
                                      local.chunks.chunk_T, num_chunks=C, top_k=top_k).view(C, P, L)
        num_recv_CPL = self._exchange_counts(num_send_CPL.transpose(0, 1).reshape(P, C * L),
                                             bound=TOKEN_BOUND).view(P, C, L).transpose(0, 1)
        return _PerChunk(num_send_CPL, num_recv_CPL)

    def _exchange_unique_rows(self, local: _LocalCounts, num_send_E: torch.Tensor, top_k: int) -> _UniqueCounts:
        """Step 2b once per rank: the [P, T] mask of the (destination rank, token) pairs of the
        kept copies, the unique rows this rank sends to each peer ([P], or [P, C] per chunk) and,
        exchanged, those it receives. Found on the device, so the route's host sync stays the only
        one."""
        P, L = self.ep_size, self.num_local_experts
        num_tokens = local.idx_N.numel() // top_k
        keep_N = kept_mask(local.idx_N, local.order_N, local.num_routed_E, num_send_E)
        key_N = torch.div(local.idx_N[local.order_N], L, rounding_mode="floor") * num_tokens \
            + torch.div(local.order_N, top_k, rounding_mode="floor")
        hits_PT = torch.zeros(P * num_tokens, dtype=torch.int64, device=key_N.device)
        hits_PT.index_put_((key_N,), keep_N.long(), accumulate=True)
        present_PT = (hits_PT > 0).view(P, num_tokens)
        if local.chunks is None:
            send_PC = present_PT.sum(dim=1)
        else:
            send_PC = torch.zeros(P, local.chunks.num_chunks, dtype=torch.int64, device=key_N.device).index_add_(
                1, local.chunks.chunk_T, present_PT.long())
        return _UniqueCounts(present_PT, send_PC, self._exchange_counts(send_PC, bound=TOKEN_BOUND))

    def _token_rank_sends(self, idx_TK: torch.Tensor) -> torch.Tensor:
        """(token, other ep rank) pairs among the routed copies, before drops: the rows a
        once-per-destination-rank dispatch would send (``DispatchResult.num_token_rank_sends``)."""
        dest_TK = torch.div(idx_TK, self.num_local_experts, rounding_mode="floor")
        hit_TP = torch.zeros(idx_TK.shape[0], self.ep_size, dtype=torch.bool, device=idx_TK.device)
        hit_TP.scatter_(1, dest_TK, True)
        hit_TP[:, self.ep_rank] = False
        return hit_TP.sum()

    def _count_minimum(self, route: Route, *, dim: int, element_bytes: int) -> None:
        """``CommStats.min_bytes``: what must move uncompressed, each way there and back."""
        P, L, j = self.ep_size, self.num_local_experts, self.ep_rank
        if route.unique is not None:
            # Once per destination rank: the unique rows, and one more count per peer.
            send_rows, recv_rows = route.unique.send_rows, route.unique.recv_rows
            rows = sum(send_rows) - send_rows[j] + sum(recv_rows) - recv_rows[j]
            num_counts = (P - 1) * (L + 1)
        else:
            rows = route.num_send_remote + sum(route.recv_splits) - route.recv_splits[j]
            num_counts = (P - 1) * L
        self.stats.count_minimum(remote_rows=rows, dim=dim, element_bytes=element_bytes, num_counts=num_counts)


def _chunk_counts(local: _LocalCounts, per_chunk: _PerChunk, host: dict[str, list[int]],
                  num_ranks: int) -> ChunkCounts:
    """The per-chunk splits, ``[c][p]``, of the counts read from the host."""
    assert local.chunks is not None, "called for a chunked route"

    def split(flat_CP: list[int]) -> list[list[int]]:
        return [flat_CP[c:c + num_ranks] for c in range(0, len(flat_CP), num_ranks)]

    return ChunkCounts(local.chunks.bounds, local.chunks.chunk_T, split(host["chunk_send"]), split(host["chunk_recv"]),
                       per_chunk.num_recv_CPL,
                       split(host["chunk_send_rows"]) if "chunk_send_rows" in host else None,
                       split(host["chunk_recv_rows"]) if "chunk_recv_rows" in host else None)
