"""The expert-parallel token dispatcher: routed token copies travel by all-to-all to the ranks
that hold their experts, and the expert outputs come back the same way.

``AllToAllDispatcher`` has the interface of ``LocalDispatcher`` (``dispatch``/``combine``, the
``Dispatcher`` protocol of ``moetrain.models.moe.dispatcher``), so the MoE layer does not know
where its experts live. Expert ``e`` lives on ep rank ``e // L`` as its local expert ``e % L``.

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
``moe.dispatch_chunks`` C > 1 this rank's kept copies are cut into C token ranges
(``moetrain.distributed.expert_parallel.route``) and the exchanges pipeline against the experts:
chunk c+1's dispatch leaves before chunk c's experts run, chunk c's combine before chunk c+1's.
Each chunk is the unchunked dispatch restricted to its tokens, so every row, gather and weighted
sum is the same; only the expert GEMMs see other row counts.

Shape legend: T tokens on this rank, D model dim, E experts, L = E/ep local experts, K experts
per token, N = T*K routed copies, M copies this rank sends (kept), R copies it receives,
U unique rows it sends, V unique rows it receives, P ranks in the ep group, W data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from itertools import pairwise

import torch
import torch.distributed as dist

from moetrain.distributed.expert_parallel.exchange import EpExchanges
from moetrain.distributed.expert_parallel.index import group_by_local_expert, kept_positions, to_host
from moetrain.distributed.expert_parallel.route import (
    _ChunkCounts,
    _OncePerRankState,
    _PerCopyState,
    _Route,
    _Sends,
    chunk_bounds,
    chunk_of_tokens,
    kept_per_chunk,
    split_into_chunks,
    whole_batch,
)
from moetrain.models.moe.dispatcher import (
    DispatchResult,
    ExpertsFn,
    RoutedOutput,
    capacity_keep_mask,
    count_per_expert,
    expert_capacity,
    sort_by_expert,
)
from moetrain.models.moe.token_bags import (
    bags_by_index,
    bags_from_copies,
    gather_rows,
    permute_rows,
    sum_rows,
    weighted_scatter,
)


class AllToAllDispatcher(EpExchanges):
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
        super().__init__(ep_group=ep_group, dp_group=dp_group, dispatch_dtype=dispatch_dtype, ep_nodes=ep_nodes,
                         dp_nodes=dp_nodes)
        assert num_chunks >= 1, num_chunks  # MoEConfig validates it for the user
        self.num_experts = num_experts
        self.dedup = dedup and ep_group is not None
        self.num_chunks = num_chunks if ep_group is not None else 1
        # ParallelDims checks this rule for the user; here it is the invariant of the layout.
        assert num_experts % self.ep_size == 0, f"ep group of {self.ep_size} for {num_experts} experts"
        self.num_local_experts = num_experts // self.ep_size
        if dp_group is not None:
            dp_ranks = dist.get_process_group_ranks(dp_group)
            ep_ranks = [dist.get_rank()] if ep_group is None else dist.get_process_group_ranks(ep_group)
            # Row in the all-gathered [W, E] counts of each member of this ep group.
            self._ep_members_in_dp = torch.tensor([dp_ranks.index(r) for r in ep_ranks])

    # ----- dispatch and combine ------------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity_factor: float | Fraction | None = None, drop_policy: str = "position") -> DispatchResult:
        """Route copies to their experts' ranks; returns them grouped by local expert.

        With ``capacity_factor`` the capacity is that of the global batch of W data-parallel
        ranks, ``expert_capacity(T * W, ...)``: drops are decided over the global batch, as one
        process would decide them, which needs the same T on every rank.
        """
        # 1.-2. Count, exchange counts (or decide the global drops), one host sync.
        route = self._route(idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
        self._count_minimum(route, dim=x_TD.shape[1], element_bytes=x_TD.element_size())
        # 3.-4. Permute and launch the all-to-all; 5. wait for it and group by local expert.
        token_idx_M, receive = self._send(x_TD, weights_TK, whole_batch(route, self._kept_order(route, dropless=capacity_factor is None)))
        x_MD, state = receive()
        # (6. The experts run in the layer, between dispatch and combine.)
        return DispatchResult(
            x_MD=x_MD, num_tokens_per_expert=route.num_recv_PL.sum(dim=0), num_routed_per_expert=route.num_routed_E,
            num_dropped=(route.num_routed_E - route.num_send_E).sum(), token_idx_M=token_idx_M, state=state,
            num_token_rank_sends=self._token_rank_sends(idx_TK) if self.ep_size > 1 else None)

    def combine(self, y_MD: torch.Tensor, state: _PerCopyState | _OncePerRankState) -> torch.Tensor:
        return self._launch_combine(y_MD, state)()

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn, *,
                    capacity_factor: float | Fraction | None = None, drop_policy: str = "position",
                    in_flight: Callable[[], torch.Tensor] | None = None) -> RoutedOutput:
        """Dispatch, ``experts``, combine, with ``in_flight()`` run while the first dispatch
        travels and, with C = num_chunks > 1, chunk c's exchanges overlapping the experts of its
        neighbours. Drops and capacity as in ``dispatch``."""
        # 1.-2. Count every chunk, exchange all their counts at once, one host sync.
        route = self._route(idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy,
                            num_chunks=self.num_chunks)
        self._count_minimum(route, dim=x_TD.shape[1], element_bytes=x_TD.element_size())
        order_M = self._kept_order(route, dropless=capacity_factor is None)
        if route.chunks is None:
            bounds, sends, x_CTD, w_CTK = [0, route.num_tokens], [whole_batch(route, order_M)], [x_TD], [weights_TK]
        else:
            bounds, sends = route.chunks.bounds, split_into_chunks(route, order_M)
            sizes = [b - a for a, b in pairwise(bounds)]
            x_CTD, w_CTK = x_TD.split(sizes), weights_TK.split(sizes)
        # 3.-4. Chunk 0 leaves; the in-flight work runs while it travels.
        launched = self._send(x_CTD[0], w_CTK[0], sends[0])
        overlapped = in_flight() if in_flight is not None else None
        finishes, token_idx = [], []
        for c, chunk in enumerate(sends):
            token_idx_M, receive = launched
            if c + 1 < len(sends):  # chunk c+1 travels while chunk c's experts run
                launched = self._send(x_CTD[c + 1], w_CTK[c + 1], sends[c + 1])
            # 5.-6. Wait for chunk c, run its experts; 7. its outputs travel during chunk c+1's.
            x_MD, state = receive()
            finishes.append(self._launch_combine(experts(x_MD, chunk.num_recv_PL.sum(dim=0)), state))
            token_idx.append(token_idx_M + bounds[c])
        # 8. Weighted sums, chunk by chunk (a token's copies all live in its chunk).
        outs = [finish() for finish in finishes]
        return RoutedOutput(
            out_TD=outs[0] if len(outs) == 1 else torch.cat(outs), overlapped=overlapped,
            num_routed_per_expert=route.num_routed_E, num_dropped=(route.num_routed_E - route.num_send_E).sum(),
            token_idx_M=token_idx[0] if len(token_idx) == 1 else torch.cat(token_idx),
            num_token_rank_sends=self._token_rank_sends(idx_TK) if self.ep_size > 1 else None)

    # ----- steps 1-2: counts, drops, splits -------------------------------------------------------

    def _route(self, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
               capacity_factor: float | Fraction | None, drop_policy: str, num_chunks: int = 1) -> _Route:
        num_tokens, top_k = idx_TK.shape
        P, L, j = self.ep_size, self.num_local_experts, self.ep_rank
        idx_N = idx_TK.reshape(-1)
        # 1. Copies per expert. Sorting by global expert id also orders the copies by destination
        #    rank, because rank s holds experts s*L .. s*L+L-1.
        num_routed_E = count_per_expert(idx_N, self.num_experts)
        order_N = sort_by_expert(idx_TK, weights_TK, drop_policy=drop_policy)
        # 2. Exchange counts: how many copies each ep peer sends to each of my local experts.
        num_routed_W = chunk_T = None
        if num_chunks > 1:
            bounds = chunk_bounds(num_tokens, num_chunks)
            chunk_T = chunk_of_tokens(bounds, idx_N.device)
        if capacity_factor is None:
            num_send_E = num_routed_E
            if chunk_T is None:
                num_recv_PL = self._exchange_counts(num_send_E.view(P, L), bound=num_tokens * top_k)
            # Dropless, counted from the routing itself (independent of the split sizes that the
            # exchange uses), so the traffic ratio checks the splits.
            num_remote = (torch.div(idx_N, L, rounding_mode="floor") != j).sum()
        else:
            num_send_E, num_recv_PL, num_routed_W = self._global_drops(
                num_routed_E, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
            num_remote = num_send_E.sum() - num_send_E[j * L:(j + 1) * L].sum()
        num_send_CP = num_recv_CPL = None
        if chunk_T is not None:
            # Chunks: every chunk's counts in the one exchange (with a capacity factor the
            # all-gather told the totals only, so this exchange is added).
            num_send_CPL = kept_per_chunk(idx_N, order_N, num_routed_E, num_send_E, chunk_T, num_chunks=num_chunks,
                                          top_k=top_k).view(num_chunks, P, L)
            num_recv_CPL = self._exchange_counts(num_send_CPL.transpose(0, 1).reshape(P, num_chunks * L),
                                                 bound=num_tokens * top_k).view(P, num_chunks, L).transpose(0, 1)
            num_send_CP = num_send_CPL.sum(dim=2)
            num_recv_PL = num_recv_CPL.sum(dim=0) if capacity_factor is None else num_recv_PL
        present_PT = uniq_send_P = uniq_recv_P = uniq_send_CP = uniq_recv_CP = None
        if self.dedup:
            present_PT, uniq_send_PC, uniq_recv_PC = self._unique_rows(
                idx_N, order_N, num_routed_E, num_send_E, num_tokens, top_k, chunk_T=chunk_T, num_chunks=num_chunks)
            uniq_send_P, uniq_recv_P = uniq_send_PC.reshape(P, -1).sum(dim=1), uniq_recv_PC.reshape(P, -1).sum(dim=1)
            if chunk_T is not None:
                uniq_send_CP, uniq_recv_CP = uniq_send_PC.t(), uniq_recv_PC.t()
        # The one host sync of the layer: all_to_all_single takes its split sizes as Python ints.
        host = to_host(num_send_E.view(P, L).sum(dim=1), num_recv_PL.sum(dim=1), num_remote, uniq_send_P,
                       uniq_recv_P, num_routed_W, num_send_CP, None if chunk_T is None else num_recv_CPL.sum(dim=2),
                       uniq_send_CP, uniq_recv_CP)
        send_splits, recv_splits, [num_send_remote], send_rows, recv_rows, routed_W = host[:6]
        if routed_W is not None and any(n != num_tokens * top_k for n in routed_W):
            raise ValueError(f"capacity mode under data parallelism needs the same token count on every "
                             f"rank; routed copies per rank: {routed_W}")
        chunks = None
        if chunk_T is not None:
            per_chunk = [None if v is None else [v[c * P:(c + 1) * P] for c in range(num_chunks)] for v in host[6:]]
            chunks = _ChunkCounts(bounds, chunk_T, per_chunk[0], per_chunk[1], num_recv_CPL, per_chunk[2],
                                  per_chunk[3])
        return _Route(num_tokens, top_k, idx_N, order_N, num_routed_E, num_send_E, num_recv_PL, send_splits,
                      recv_splits, num_send_remote, present_PT, send_rows, recv_rows, chunks)

    def _kept_order(self, route: _Route, *, dropless: bool) -> torch.Tensor:
        """3. The copies this rank sends, by destination rank and expert: the first kept_e copies
        of each expert's block (the sort put them in drop-priority order)."""
        if dropless:
            return route.order_N
        return route.order_N.index_select(0, kept_positions(route.num_routed_E, route.num_send_E,
                                                             sum(route.send_splits)))

    def _global_drops(self, num_routed_E: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                      capacity_factor: float | Fraction,
                      drop_policy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Capacity mode's step 2: the copies this rank keeps per global expert, those each ep peer
        sends to my local experts, and the routed copies of every data-parallel rank."""
        if self.dp_group is None:
            raise ValueError("a capacity factor under expert/data parallelism needs the AllToAllDispatcher's "
                             "dp_group")
        num_tokens, top_k = idx_TK.shape
        L, j = self.num_local_experts, self.ep_rank
        # Capacity of the global batch; every rank holds T tokens (TrainConfig.grad_accum_steps),
        # which the host sync verifies.
        capacity = expert_capacity(num_tokens * self.dp_size, num_experts=self.num_experts, top_k=top_k,
                                   capacity_factor=capacity_factor)
        num_routed_WE, kept_WE = self._global_keep_counts(num_routed_E, idx_TK, weights_TK, capacity=capacity,
                                                          drop_policy=drop_policy)
        # Every rank's kept counts are known after the all-gather: no second exchange needed.
        members_P = self._ep_members_in_dp.to(kept_WE.device)
        num_recv_PL = kept_WE.index_select(0, members_P)[:, j * L:(j + 1) * L]
        return kept_WE[self.dp_rank], num_recv_PL, num_routed_WE.sum(dim=1)

    def _global_keep_counts(self, num_routed_E: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor,
                            *, capacity: int, drop_policy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies each data-parallel rank routes and keeps per expert, ``[W, E]`` each, with the
        copies kept exactly as one process holding the global batch (the ranks' batches
        concatenated in rank order) keeps them."""
        num_routed_WE = self._all_gather(num_routed_E, bound=idx_TK.numel()).view(self.dp_size, self.num_experts)
        if drop_policy == "position":
            # Earlier ranks' copies come first in the global batch and win capacity.
            earlier_WE = torch.cumsum(num_routed_WE, dim=0) - num_routed_WE
            kept_WE = torch.minimum(num_routed_WE, (capacity - earlier_WE).clamp(min=0))
            return num_routed_WE, kept_WE
        # "score": the top-capacity copies of each expert by router weight over the global batch,
        # ties to the earlier global position. Gather every rank's (expert, weight) pairs, which
        # are D times smaller than the tokens, and replay the single-process selection.
        idx_WTK = self._all_gather(idx_TK, bound=self.num_experts - 1)
        weights_WTK = self._all_gather(weights_TK.detach())
        order_G = sort_by_expert(idx_WTK, weights_WTK, drop_policy="score")
        idx_G = idx_WTK.reshape(-1)
        keep_G = capacity_keep_mask(idx_G[order_G], num_routed_WE.sum(dim=0), capacity)
        rank_G = torch.div(order_G, idx_TK.numel(), rounding_mode="floor")
        kept_WE = torch.zeros_like(num_routed_WE).index_put_(
            (rank_G, idx_G[order_G]), keep_G.long(), accumulate=True)
        return num_routed_WE, kept_WE

    def _unique_rows(self, idx_N, order_N, num_routed_E, num_send_E, num_tokens: int, top_k: int, *,
                     chunk_T: torch.Tensor | None = None, num_chunks: int = 1):
        """Once per rank: the [P, T] mask of the (destination rank, token) pairs of the kept
        copies, the unique rows this rank sends to each peer, and (exchanged) those it receives;
        with ``chunk_T`` (the chunk of each token) the rows per peer and chunk, ``[P, C]``.
        Found on the device, so the dispatch's host sync stays the only one."""
        P, L = self.ep_size, self.num_local_experts
        expert_N = idx_N[order_N]
        # Kept copies are the first num_send_E[e] of each expert's block (the sort is in priority order).
        block_start_E = torch.cumsum(num_routed_E, dim=0) - num_routed_E
        rank_in_expert_N = torch.arange(expert_N.numel(), device=idx_N.device) - block_start_E[expert_N]
        keep_N = rank_in_expert_N < num_send_E[expert_N]
        key_N = torch.div(expert_N, L, rounding_mode="floor") * num_tokens \
            + torch.div(order_N, top_k, rounding_mode="floor")
        hits_PT = torch.zeros(P * num_tokens, dtype=torch.int64, device=idx_N.device)
        hits_PT.index_put_((key_N,), keep_N.long(), accumulate=True)
        present_PT = (hits_PT > 0).view(P, num_tokens)
        if chunk_T is None:
            uniq_send_P = present_PT.sum(dim=1)
        else:
            uniq_send_P = torch.zeros(P, num_chunks, dtype=torch.int64, device=idx_N.device).index_add_(
                1, chunk_T, present_PT.long())
        return present_PT, uniq_send_P, self._exchange_counts(uniq_send_P, bound=num_tokens)

    def _token_rank_sends(self, idx_TK: torch.Tensor) -> torch.Tensor:
        """(token, other ep rank) pairs among the routed copies, before drops: the rows a
        once-per-destination-rank dispatch would send (``DispatchResult.num_token_rank_sends``)."""
        dest_TK = torch.div(idx_TK, self.num_local_experts, rounding_mode="floor")
        hit_TP = torch.zeros(idx_TK.shape[0], self.ep_size, dtype=torch.bool, device=idx_TK.device)
        hit_TP.scatter_(1, dest_TK, True)
        hit_TP[:, self.ep_rank] = False
        return hit_TP.sum()

    # ----- steps 3-8: launch, receive, combine ------------------------------------------------------

    def _send(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, sends: _Sends):
        """3.-4. Launch one exchange; returns the local token of each sent copy and ``receive()``,
        which waits for the rows (5.) and returns ``(x_MD grouped by local expert, combine state)``."""
        token_idx_M = torch.div(sends.order_M, sends.top_k, rounding_mode="floor")
        weights_M = weights_TK.reshape(-1).index_select(0, sends.order_M)
        send = self._send_once_per_rank if self.dedup else self._send_per_copy
        return token_idx_M, send(x_TD, sends, token_idx_M, weights_M)

    def _launch_combine(self, y_MD: torch.Tensor, state: _PerCopyState | _OncePerRankState) -> Callable[[], torch.Tensor]:
        """7. Launch the way home of the expert outputs; returns ``finish()``, which waits and
        returns the combined ``[T, D]`` (8.)."""
        if self.dedup:
            # Weighted sum of a token's copies on this rank into its one row, then that row home.
            y_rows_VD = weighted_scatter(y_MD, state.weights_M, state.row_M, state.num_rows, state.row_bags)
            back = self._launch_all_to_all(y_rows_VD, output_splits=state.send_rows, input_splits=state.recv_rows,
                                           payload="combine")
            # 8. Sum the rows coming back from every rank into their tokens.
            return lambda: sum_rows(back(), state.send_token_U, state.token_bags)
        # Back to [source rank][local expert] order, then home.
        y_recv_RD = y_MD if state.ungroup_R is None else permute_rows(y_MD, state.ungroup_R, state.group_R)
        back = self._launch_all_to_all(y_recv_RD, output_splits=state.send_splits, input_splits=state.recv_splits,
                                       payload="combine")
        # 8. Unpermute and weighted combine: out[t] = sum over t's kept copies of w * y.
        return lambda: weighted_scatter(back(), state.weights_M, state.token_idx_M, state.num_tokens, state.bags)

    def _send_per_copy(self, x_TD, sends: _Sends, token_idx_M, weights_M):
        bags = (bags_from_copies(sends.order_M, sends.num_tokens, sends.top_k) if sends.all_kept
                else bags_by_index(token_idx_M, sends.num_tokens))
        x_send_MD = gather_rows(x_TD, token_idx_M, bags)
        # 4. Variable-size all-to-all; autograd sends the gradients back the same way.
        arrived = self._launch_all_to_all(x_send_MD, output_splits=sends.recv_splits, input_splits=sends.send_splits,
                                          payload="dispatch")

        def receive():
            # 5. Group the received rows by local expert: they arrive as [source rank][local
            #    expert] and the experts want [local expert][source rank].
            num_recv = sum(sends.recv_splits)
            group_R = ungroup_R = None
            x_MD = arrived()
            if self.ep_size > 1:
                group_R = group_by_local_expert(sends.num_recv_PL, num_recv)
                ungroup_R = torch.empty_like(group_R).scatter_(0, group_R, torch.arange(num_recv, device=group_R.device))
                x_MD = permute_rows(x_MD, group_R, ungroup_R)
            return x_MD, _PerCopyState(token_idx_M, weights_M, sends.num_tokens, group_R, ungroup_R,
                                       sends.send_splits, sends.recv_splits, bags)
        return receive

    def _send_once_per_rank(self, x_TD, sends: _Sends, token_idx_M, weights_M):
        P, L, dev = self.ep_size, self.num_local_experts, x_TD.device
        num_tokens, send_splits, recv_splits = sends.num_tokens, sends.send_splits, sends.recv_splits
        send_rows, recv_rows = sends.send_rows, sends.recv_rows
        # 3b. Each unique row once, grouped by destination rank (token order inside a block), and
        #     for every copy the index of its row inside the destination's block.
        present_PT = sends.present_PT
        send_token_U = torch.nonzero_static(present_PT.reshape(-1), size=sum(send_rows)).squeeze(1) % max(num_tokens, 1)
        row_in_block_PT = torch.cumsum(present_PT.long(), dim=1) - 1
        dest_M = torch.div(sends.idx_N[sends.order_M], L, rounding_mode="floor")
        rel_row_M = row_in_block_PT[dest_M, token_idx_M]
        # 4. Rows (autograd), gate weights (autograd: their gradient comes back) and row indices.
        token_bags = bags_by_index(send_token_U, num_tokens)
        rows_arrived = self._launch_all_to_all(gather_rows(x_TD, send_token_U, token_bags), output_splits=recv_rows,
                                               input_splits=send_rows, payload="dispatch")
        # Gate weights stay fp32 both ways, like the router's scores.
        w_arrived = self._launch_all_to_all(weights_M, output_splits=recv_splits, input_splits=send_splits)
        rel_row_R = self._exchange_ints(rel_row_M, output_splits=recv_splits, input_splits=send_splits,
                                        bound=num_tokens - 1)

        def receive():
            # 5. Copies arrive as [source rank][local expert]; point each at its row, group by expert.
            num_recv = sum(recv_splits)
            recv_rows_P = torch.tensor(recv_rows, device=dev)
            src_R = torch.repeat_interleave(torch.arange(P, device=dev), torch.tensor(recv_splits, device=dev),
                                            output_size=num_recv)
            row_R = rel_row_R + (torch.cumsum(recv_rows_P, dim=0) - recv_rows_P)[src_R]
            group_R = group_by_local_expert(sends.num_recv_PL, num_recv)
            row_M, w_M = row_R.index_select(0, group_R), w_arrived().index_select(0, group_R)
            row_bags = bags_by_index(row_M, sum(recv_rows))
            x_MD = gather_rows(rows_arrived(), row_M, row_bags)
            return x_MD, _OncePerRankState(row_M=row_M, weights_M=w_M, num_rows=sum(recv_rows),
                                           send_token_U=send_token_U, send_rows=send_rows, recv_rows=recv_rows,
                                           row_bags=row_bags, token_bags=token_bags)
        return receive

    # ----- communication: every exchange goes through these, and is counted by them -----------------

    def _count_minimum(self, route: _Route, *, dim: int, element_bytes: int) -> None:
        """``CommStats.min_bytes``: what must move uncompressed, each way there and back."""
        P, L, j = self.ep_size, self.num_local_experts, self.ep_rank
        if self.dedup:
            # Once per destination rank: the unique rows, and one more count per peer.
            rows = sum(route.send_rows) - route.send_rows[j] + sum(route.recv_rows) - route.recv_rows[j]
            num_counts = (P - 1) * (L + 1)
        else:
            rows = route.num_send_remote + sum(route.recv_splits) - route.recv_splits[j]
            num_counts = (P - 1) * L
        self.stats.count_minimum(remote_rows=rows, dim=dim, element_bytes=element_bytes, num_counts=num_counts)
