"""The expert-parallel token dispatcher: routed token copies travel by all-to-all to the ranks
that hold their experts, and the expert outputs come back the same way.

``AllToAllDispatcher`` has the interface of ``LocalDispatcher`` (``dispatch``/``combine``/
``run_experts``, the ``Dispatcher`` protocol of ``moetrain.models.moe.dispatcher``), so the MoE
layer does not know where its experts live. Expert ``e`` lives on ep rank ``e // L`` as its local
expert ``e % L``.

A dispatch runs in named phases, Megatron-Core's ``MoEAlltoAllTokenDispatcher`` shape; only
``route``, ``token_dispatch`` and ``token_combine`` communicate:

    route                 1.-2. count, exchange counts (or decide the global drops), one host sync
                          (``moetrain.distributed.expert_parallel.route``)
    dispatch_preprocess   3. the rows that leave, in send order (no communication)
    token_dispatch        4. launch the all-to-all
    dispatch_postprocess  5. wait for the rows, group them by local expert (no communication)
                          6. the experts run (in the layer between ``dispatch`` and ``combine``)
    combine_preprocess    7a. the outputs in the order they go home (no communication)
    token_combine         7b. launch the all-to-all home
    combine_postprocess   8. wait, sum each token's outputs (no communication)

Equivalence with one process: the reference is one process holding the global batch (the ranks'
batches concatenated in rank order) and all experts. Dropless, every copy reaches the same expert
with the same input. With a capacity factor, capacity is ``ceil(f * T_global * K / E)`` and the
copies kept are exactly those the single process keeps ("position": earliest global position;
"score": highest router weight, ties by global position), which needs the per-rank routing
counts (and for "score" the router weights) of every data-parallel rank.

Two ways to send, chosen by ``moe.dispatch_dedup``:

* per copy: each kept copy is one row to its expert's rank;
* once per rank: a token goes to a rank once, however many of its experts live there; the
  receiving rank fans the row out to its experts and sums their weighted outputs before the
  row goes home.

``moe.dispatch_dtype`` picks the wire format (``moetrain.distributed.expert_parallel.wire``): "none"
sends the compute dtype; "bf16" and "fp8_e4m3" compress the forward dispatch rows (and send the
combine and every backward in bf16) and the routing metadata (smallest integer type).

Overlap (``run_experts``, what the MoE layer calls): token rows are launched
(``moetrain.distributed.expert_parallel.exchange``) and waited for only when read, so the layer's
``in_flight`` work (its shared experts) runs while the dispatch travels. With
``moe.dispatch_chunks`` C > 1 this rank's kept copies are cut into C token ranges (``Route.exchanges``)
and the exchanges pipeline against the experts: chunk c+1's dispatch leaves before chunk c's
experts run, chunk c's combine before chunk c+1's. Each chunk is the unchunked dispatch restricted
to its tokens, so every row, gather and weighted sum is the same; only the expert GEMMs see other
row counts. ``dispatch`` sends the whole batch at once (the experts run outside it).

Shape legend: T tokens on this rank, D model dim, E experts, L = E/ep local experts, K experts
per token, N = T*K routed copies, M copies this rank sends (kept), R copies it receives,
U unique rows it sends, V unique rows it receives, X rows that travel (M or U), P ranks in the ep
group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from moetrain.distributed.expert_parallel.index import group_by_local_expert
from moetrain.distributed.expert_parallel.route import AllToAllRouting, Exchange
from moetrain.distributed.expert_parallel.wire import TOKEN_BOUND
from moetrain.models.moe.dispatcher import DispatchResult, ExpertsFn, RoutedOutput
from moetrain.models.moe.token_bags import (
    TokenBags,
    bags_by_index,
    bags_from_copies,
    gather_rows,
    permute_rows,
    sum_rows,
    weighted_scatter,
)


@dataclass
class UniqueSend:
    """Once per rank: the token of each unique row sent, and where each copy finds its row."""

    send_token_U: torch.Tensor
    """Local token of each unique row, in send order (by destination rank, then token)."""
    rel_row_M: torch.Tensor
    """Index of each kept copy's row inside its destination rank's block."""


@dataclass
class Outbound:
    """One exchange's rows, ready to leave (``dispatch_preprocess``)."""

    exchange: Exchange
    token_idx_M: torch.Tensor
    """Local token of each kept copy, in send order."""
    weights_M: torch.Tensor
    """Gate weight of each kept copy, in send order."""
    x_XD: torch.Tensor
    """The rows that leave: one per kept copy (X = M), or once per rank one per unique row (X = U)."""
    bags: TokenBags
    """The rows of ``x_XD`` of each local token."""
    unique: UniqueSend | None = None


@dataclass
class UniqueArrival:
    """Once per rank: the copies' gate weights (launched) and their rows' indices (arrived)."""

    weights: Callable[[], torch.Tensor]
    """Waits for the gate weights of the copies received, ``[R]``."""
    rel_row_R: torch.Tensor


@dataclass
class InFlight:
    """Rows on their way (``token_dispatch``)."""

    outbound: Outbound
    rows: Callable[[], torch.Tensor]
    """Waits for the rows received, ``[R, D]`` (once per rank ``[V, D]``)."""
    unique: UniqueArrival | None = None


@dataclass
class LocalExpertOrder:
    """Received rows between [source rank][local expert] and [local expert][source rank] order."""

    group_R: torch.Tensor
    """Received row at each expert-grouped position."""
    ungroup_R: torch.Tensor
    """Expert-grouped position of each received row (the inverse of group_R)."""


@dataclass
class PerCopyState:
    """What the combine of a per-copy dispatch needs."""

    token_idx_M: torch.Tensor
    """Local token of each sent copy, in send order."""
    weights_M: torch.Tensor
    num_tokens: int
    order: LocalExpertOrder | None
    """None: already grouped (ep=1)."""
    send_splits: list[int]
    recv_splits: list[int]
    bags: TokenBags
    """Sent copies of each local token."""


@dataclass
class OncePerRankState:
    """What the combine of a once-per-rank dispatch needs."""

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


AllToAllState = PerCopyState | OncePerRankState


@dataclass
class Arrival:
    """The rows grouped by local expert (``dispatch_postprocess``): what the experts take."""

    x_MD: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    token_idx_M: torch.Tensor
    """Local token of each copy this rank sent (``DispatchResult.token_idx_M``)."""
    state: AllToAllState


@dataclass
class Homeward:
    """Expert outputs on their way home (``token_combine``)."""

    rows: Callable[[], torch.Tensor]
    """Waits for this rank's rows to come back: one per sent copy, or once per rank per unique row."""
    state: AllToAllState


class AllToAllDispatcher(AllToAllRouting):
    """Sends routed token copies to the ranks that hold their experts and brings the outputs back.

    ``ep_group=None`` means ep=1 (data parallelism with a capacity factor, where only the global
    drops matter). ``dp_group`` (all data-parallel ranks, in global rank order) is needed with a
    capacity factor only. ``dedup`` sends a token once per destination rank (moe.dispatch_dedup);
    ``dispatch_dtype`` is the wire format (moe.dispatch_dtype); ``num_chunks`` the pipeline depth
    of ``run_experts`` (moe.dispatch_chunks; with ``ep_group=None`` nothing travels and it is 1).
    """

    def __init__(self, num_experts: int, *, ep_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None = None, dedup: bool = False,
                 dispatch_dtype: str = "none", num_chunks: int = 1, ep_nodes: Sequence[int] | None = None,
                 dp_nodes: Sequence[int] | None = None) -> None:
        assert num_chunks >= 1, num_chunks  # MoEConfig validates it for the user
        super().__init__(num_experts, ep_group=ep_group, dp_group=dp_group, dedup=dedup,
                         dispatch_dtype=dispatch_dtype, ep_nodes=ep_nodes, dp_nodes=dp_nodes)
        self.num_chunks = num_chunks if ep_group is not None else 1

    # ----- the Dispatcher interface ----------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity_factor: float | Fraction | None = None,
                 drop_policy: str = "position") -> DispatchResult[AllToAllState]:
        """Route copies to their experts' ranks; returns them grouped by local expert.

        With ``capacity_factor`` the capacity is that of the global batch of W data-parallel
        ranks, ``expert_capacity(T * W, ...)``: drops are decided over the global batch, as one
        process would decide them, which needs the same T on every rank.
        """
        # 1.-2. Count, exchange counts (or decide the global drops), one host sync.
        route = self.route(x_TD, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
        [batch] = route.exchanges()
        # 3.-4. Permute and launch the all-to-all; 5. wait for it and group by local expert.
        arrival = self.dispatch_postprocess(self.token_dispatch(self.dispatch_preprocess(x_TD, weights_TK, batch)))
        # (6. The experts run in the layer, between dispatch and combine.)
        return DispatchResult(
            x_MD=arrival.x_MD, num_tokens_per_expert=arrival.num_tokens_per_expert,
            num_routed_per_expert=route.num_routed_E, num_dropped=route.num_dropped, token_idx_M=arrival.token_idx_M,
            state=arrival.state, num_token_rank_sends=route.num_token_rank_sends)

    def combine(self, y_MD: torch.Tensor, state: AllToAllState) -> torch.Tensor:
        """7. The expert outputs home; 8. each token's weighted sum."""
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(y_MD, state), state))

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn, *,
                    capacity_factor: float | Fraction | None = None, drop_policy: str = "position",
                    in_flight: Callable[[], torch.Tensor] | None = None) -> RoutedOutput:
        """Dispatch, ``experts``, combine, with ``in_flight()`` run while the first dispatch
        travels and, with C = num_chunks > 1, chunk c's exchanges overlapping the experts of its
        neighbours. Drops and capacity as in ``dispatch``."""
        # 1.-2. Count every chunk, exchange all their counts at once, one host sync.
        route = self.route(x_TD, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy,
                           num_chunks=self.num_chunks)
        exchanges = route.exchanges()
        if route.chunks is None:
            x_CTD, w_CTK = [x_TD], [weights_TK]
        else:
            x_CTD, w_CTK = list(x_TD.split(route.chunks.sizes)), list(weights_TK.split(route.chunks.sizes))
        # 3.-4. Chunk 0 leaves; the in-flight work runs while it travels.
        flights = [self.token_dispatch(self.dispatch_preprocess(x_CTD[0], w_CTK[0], exchanges[0]))]
        overlapped = in_flight() if in_flight is not None else None
        homeward, token_idx = [], []
        for c, exchange in enumerate(exchanges):
            if c + 1 < len(exchanges):  # chunk c+1 travels while chunk c's experts run
                flights.append(self.token_dispatch(self.dispatch_preprocess(x_CTD[c + 1], w_CTK[c + 1],
                                                                            exchanges[c + 1])))
            # 5.-6. Wait for chunk c, run its experts; 7. its outputs travel during chunk c+1's.
            arrival = self.dispatch_postprocess(flights[c])
            y_MD = experts(arrival.x_MD, arrival.num_tokens_per_expert)
            homeward.append(self.token_combine(self.combine_preprocess(y_MD, arrival.state), arrival.state))
            token_idx.append(arrival.token_idx_M + exchange.first_token)
        # 8. Weighted sums, chunk by chunk (a token's copies all live in its chunk).
        outs = [self.combine_postprocess(home) for home in homeward]
        return RoutedOutput(
            out_TD=outs[0] if len(outs) == 1 else torch.cat(outs), overlapped=overlapped,
            num_routed_per_expert=route.num_routed_E, num_dropped=route.num_dropped,
            token_idx_M=token_idx[0] if len(token_idx) == 1 else torch.cat(token_idx),
            num_token_rank_sends=route.num_token_rank_sends)

    # ----- steps 3-5: the way there --------------------------------------------------------------

    def dispatch_preprocess(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, exchange: Exchange) -> Outbound:
        """3. The rows that leave, in send order: one per kept copy, or once per rank one per
        (token, destination rank). No communication here."""
        token_idx_M = torch.div(exchange.order_M, exchange.top_k, rounding_mode="floor")
        weights_M = weights_TK.reshape(-1).index_select(0, exchange.order_M)
        if exchange.unique is None:
            bags = (bags_from_copies(exchange.order_M, exchange.num_tokens, exchange.top_k) if exchange.all_kept
                    else bags_by_index(token_idx_M, exchange.num_tokens))
            return Outbound(exchange, token_idx_M, weights_M, gather_rows(x_TD, token_idx_M, bags), bags)
        # Each unique row once, grouped by destination rank (token order inside a block), and for
        # every copy the index of its row inside the destination's block.
        present_PT, num_tokens = exchange.unique.present_PT, exchange.num_tokens
        send_token_U = torch.nonzero_static(present_PT.reshape(-1), size=sum(exchange.unique.send_rows)).squeeze(1)
        send_token_U = send_token_U % max(num_tokens, 1)
        row_in_block_PT = torch.cumsum(present_PT.long(), dim=1) - 1
        dest_M = torch.div(exchange.idx_N[exchange.order_M], self.num_local_experts, rounding_mode="floor")
        rel_row_M = row_in_block_PT[dest_M, token_idx_M]
        token_bags = bags_by_index(send_token_U, num_tokens)
        return Outbound(exchange, token_idx_M, weights_M, gather_rows(x_TD, send_token_U, token_bags), token_bags,
                        UniqueSend(send_token_U, rel_row_M))

    def token_dispatch(self, outbound: Outbound) -> InFlight:
        """4. Launch the variable-size all-to-all of the rows (autograd sends the gradients back the
        same way); returns at once. Once per rank, the copies' gate weights (fp32 both ways, like
        the router's scores; their gradient comes back) and row indices travel too."""
        exchange = outbound.exchange
        if outbound.unique is None:
            rows = self._launch_all_to_all(outbound.x_XD, output_splits=exchange.recv_splits,
                                           input_splits=exchange.send_splits, payload="dispatch")
            return InFlight(outbound, rows)
        assert exchange.unique is not None, "once per rank: the route found the unique rows"
        rows = self._launch_all_to_all(outbound.x_XD, output_splits=exchange.unique.recv_rows,
                                       input_splits=exchange.unique.send_rows, payload="dispatch")
        weights = self._launch_all_to_all(outbound.weights_M, output_splits=exchange.recv_splits,
                                          input_splits=exchange.send_splits)
        rel_row_R = self._exchange_ints(outbound.unique.rel_row_M, output_splits=exchange.recv_splits,
                                        input_splits=exchange.send_splits, bound=TOKEN_BOUND)
        return InFlight(outbound, rows, UniqueArrival(weights, rel_row_R))

    def dispatch_postprocess(self, flight: InFlight) -> Arrival:
        """5. Wait for the rows ``token_dispatch`` launched and group them by local expert: they
        arrive as [source rank][local expert] and the experts want [local expert][source rank].
        No communication here."""
        outbound, exchange = flight.outbound, flight.outbound.exchange
        num_recv = sum(exchange.recv_splits)
        if flight.unique is not None:
            return self._fan_out(flight, num_recv)
        order = None
        x_MD = flight.rows()
        if self.ep_size > 1:
            group_R = group_by_local_expert(exchange.num_recv_PL, num_recv)
            ungroup_R = torch.empty_like(group_R).scatter_(0, group_R, torch.arange(num_recv, device=group_R.device))
            x_MD = permute_rows(x_MD, group_R, ungroup_R)
            order = LocalExpertOrder(group_R, ungroup_R)
        state = PerCopyState(outbound.token_idx_M, outbound.weights_M, exchange.num_tokens, order,
                             exchange.send_splits, exchange.recv_splits, outbound.bags)
        return Arrival(x_MD, exchange.num_recv_PL.sum(dim=0), outbound.token_idx_M, state)

    def _fan_out(self, flight: InFlight, num_recv: int) -> Arrival:
        """Step 5 once per rank: each received copy points at its unique row, grouped by local
        expert. No communication here."""
        outbound, exchange, arrived = flight.outbound, flight.outbound.exchange, flight.unique
        assert outbound.unique is not None and exchange.unique is not None and arrived is not None, "once per rank"
        P, dev = self.ep_size, arrived.rel_row_R.device
        send_rows, recv_rows = exchange.unique.send_rows, exchange.unique.recv_rows
        recv_rows_P = torch.tensor(recv_rows, device=dev)
        src_R = torch.repeat_interleave(torch.arange(P, device=dev), torch.tensor(exchange.recv_splits, device=dev),
                                        output_size=num_recv)
        row_R = arrived.rel_row_R + (torch.cumsum(recv_rows_P, dim=0) - recv_rows_P)[src_R]
        group_R = group_by_local_expert(exchange.num_recv_PL, num_recv)
        row_M, w_M = row_R.index_select(0, group_R), arrived.weights().index_select(0, group_R)
        row_bags = bags_by_index(row_M, sum(recv_rows))
        x_MD = gather_rows(flight.rows(), row_M, row_bags)
        state = OncePerRankState(row_M=row_M, weights_M=w_M, num_rows=sum(recv_rows),
                                 send_token_U=outbound.unique.send_token_U, send_rows=send_rows, recv_rows=recv_rows,
                                 row_bags=row_bags, token_bags=outbound.bags)
        return Arrival(x_MD, exchange.num_recv_PL.sum(dim=0), outbound.token_idx_M, state)

    # ----- steps 7-8: the way home ---------------------------------------------------------------

    def combine_preprocess(self, y_MD: torch.Tensor, state: AllToAllState) -> torch.Tensor:
        """7a. The expert outputs in the order they go home: per copy, back to [source rank][local
        expert] order; once per rank, the weighted sum of a row's copies on this rank into that
        one row. No communication here."""
        if isinstance(state, OncePerRankState):
            return weighted_scatter(y_MD, state.weights_M, state.row_M, state.num_rows, state.row_bags)
        return y_MD if state.order is None else permute_rows(y_MD, state.order.ungroup_R, state.order.group_R)

    def token_combine(self, y_XD: torch.Tensor, state: AllToAllState) -> Homeward:
        """7b. Launch the all-to-all home (the dispatch's splits reversed); returns at once."""
        if isinstance(state, OncePerRankState):
            output_splits, input_splits = state.send_rows, state.recv_rows
        else:
            output_splits, input_splits = state.send_splits, state.recv_splits
        rows = self._launch_all_to_all(y_XD, output_splits=output_splits, input_splits=input_splits,
                                       payload="combine")
        return Homeward(rows, state)

    def combine_postprocess(self, home: Homeward) -> torch.Tensor:
        """8. Wait for the rows ``token_combine`` launched and sum them into their tokens: per copy
        ``out[t]`` = the sum over t's kept copies of ``w * y``; once per rank the sum of t's rows
        from every rank. No communication here."""
        state = home.state
        if isinstance(state, OncePerRankState):
            return sum_rows(home.rows(), state.send_token_U, state.token_bags)
        return weighted_scatter(home.rows(), state.weights_M, state.token_idx_M, state.num_tokens, state.bags)
