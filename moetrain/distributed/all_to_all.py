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

``moe.dispatch_dtype`` picks the wire format (``moetrain.distributed.compressed_exchange``): "none"
sends the compute dtype; "bf16" and "fp8_e4m3" compress the forward dispatch rows (and send the
combine and every backward in bf16) and the routing metadata (smallest integer type).

Shape legend: T tokens on this rank, D model dim, E experts, L = E/ep local experts, K experts
per token, N = T*K routed copies, M copies this rank sends (kept), R copies it receives,
U unique rows it sends, V unique rows it receives, P ranks in the ep group, W data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moetrain.distributed.comm_stats import CommStats, row_bytes
from moetrain.distributed.compressed_exchange import (
    DISPATCH_DTYPES,
    exchange_rows,
    ints_from_bytes,
    ints_to_bytes,
    wire_row_bytes,
)
from moetrain.distributed.dispatch_index import group_by_local_expert, kept_positions, to_host
from moetrain.distributed.utils import all_gather_single
from moetrain.models.moe.dispatcher import (
    DispatchResult,
    capacity_keep_mask,
    count_per_expert,
    expert_capacity,
    sort_by_expert,
)
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


class AllToAllDispatcher:
    """Sends routed token copies to the ranks that hold their experts and brings the outputs back.

    ``ep_group=None`` means ep=1 (data parallelism with a capacity factor, where only the global
    drops matter). ``dp_group`` (all data-parallel ranks, in global rank order) is needed with a
    capacity factor only. ``dedup`` sends a token once per destination rank (moe.dispatch_dedup);
    ``dispatch_dtype`` is the wire format (moe.dispatch_dtype).
    """

    def __init__(self, num_experts: int, *, ep_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None = None, dedup: bool = False,
                 dispatch_dtype: str = "none") -> None:
        assert dispatch_dtype in DISPATCH_DTYPES, dispatch_dtype  # MoEConfig validates it for the user
        self.num_experts = num_experts
        self.dedup = dedup and ep_group is not None
        self.dispatch_dtype = dispatch_dtype
        self.compact_ints = dispatch_dtype != "none" and ep_group is not None
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        # ParallelDims checks this rule for the user; here it is the invariant of the layout.
        assert num_experts % self.ep_size == 0, f"ep group of {self.ep_size} for {num_experts} experts"
        self.num_local_experts = num_experts // self.ep_size
        self.dp_group = dp_group
        if dp_group is not None:
            self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
            dp_ranks = dist.get_process_group_ranks(dp_group)
            ep_ranks = [dist.get_rank()] if ep_group is None else dist.get_process_group_ranks(ep_group)
            # Row in the all-gathered [W, E] counts of each member of this ep group.
            self._ep_members_in_dp = torch.tensor([dp_ranks.index(r) for r in ep_ranks])
        self.stats = CommStats()

    def read_comm_stats(self, *, reset: bool = True) -> CommStats:
        stats = self.stats
        if reset:
            self.stats = CommStats()
        return stats

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
        # 3. Permute by destination rank and expert: keep the first kept_e copies of each expert's
        #    block (the sort put them in drop-priority order).
        order_M = route.order_N
        if capacity_factor is not None:
            order_M = order_M.index_select(0, kept_positions(route.num_routed_E, route.num_send_E,
                                                              sum(route.send_splits)))
        token_idx_M = torch.div(order_M, route.top_k, rounding_mode="floor")
        weights_M = weights_TK.reshape(-1).index_select(0, order_M)
        # 4.-5. All-to-all, then group the received copies by local expert.
        send = self._send_once_per_rank if self.dedup else self._send_per_copy
        x_MD, state = send(x_TD, route, order_M, token_idx_M, weights_M)
        # (6. The experts run in the layer, between dispatch and combine.)
        return DispatchResult(
            x_MD=x_MD, num_tokens_per_expert=route.num_recv_PL.sum(dim=0), num_routed_per_expert=route.num_routed_E,
            num_dropped=(route.num_routed_E - route.num_send_E).sum(), token_idx_M=token_idx_M, state=state,
            num_token_rank_sends=self._token_rank_sends(idx_TK) if self.ep_size > 1 else None)

    def combine(self, y_MD: torch.Tensor, state: _PerCopyState | _OncePerRankState) -> torch.Tensor:
        if self.dedup:
            return self._combine_once_per_rank(y_MD, state)
        # 7. Reverse all-to-all: back to [source rank][local expert] order, then home.
        y_recv_RD = y_MD if state.ungroup_R is None else permute_rows(y_MD, state.ungroup_R, state.group_R)
        y_back_MD = self._all_to_all(y_recv_RD, output_splits=state.send_splits, input_splits=state.recv_splits,
                                     payload="combine")
        # 8. Unpermute and weighted combine: out[t] = sum over t's kept copies of w * y.
        return weighted_scatter(y_back_MD, state.weights_M, state.token_idx_M, state.num_tokens, state.bags)

    # ----- steps 1-2: counts, drops, splits -------------------------------------------------------

    def _route(self, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
               capacity_factor: float | Fraction | None, drop_policy: str) -> _Route:
        num_tokens, top_k = idx_TK.shape
        P, L, j = self.ep_size, self.num_local_experts, self.ep_rank
        idx_N = idx_TK.reshape(-1)
        # 1. Copies per expert. Sorting by global expert id also orders the copies by destination
        #    rank, because rank s holds experts s*L .. s*L+L-1.
        num_routed_E = count_per_expert(idx_N, self.num_experts)
        order_N = sort_by_expert(idx_TK, weights_TK, drop_policy=drop_policy)
        # 2. Exchange counts: how many copies each ep peer sends to each of my local experts.
        num_routed_W = None
        if capacity_factor is None:
            num_send_E = num_routed_E
            num_recv_PL = self._exchange_counts(num_send_E.view(P, L), bound=num_tokens * top_k)
            # Dropless, counted from the routing itself (independent of the split sizes that the
            # exchange uses), so the traffic ratio checks the splits.
            num_remote = (torch.div(idx_N, L, rounding_mode="floor") != j).sum()
        else:
            num_send_E, num_recv_PL, num_routed_W = self._global_drops(
                num_routed_E, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
            num_remote = num_send_E.sum() - num_send_E[j * L:(j + 1) * L].sum()
        present_PT = uniq_send_P = uniq_recv_P = None
        if self.dedup:
            present_PT, uniq_send_P, uniq_recv_P = self._unique_rows(idx_N, order_N, num_routed_E, num_send_E,
                                                                     num_tokens, top_k)
        # The one host sync of the layer: all_to_all_single takes its split sizes as Python ints.
        send_splits, recv_splits, [num_send_remote], send_rows, recv_rows, routed_W = to_host(
            num_send_E.view(P, L).sum(dim=1), num_recv_PL.sum(dim=1), num_remote, uniq_send_P, uniq_recv_P,
            num_routed_W)
        if routed_W is not None and any(n != num_tokens * top_k for n in routed_W):
            raise ValueError(f"capacity mode under data parallelism needs the same token count on every "
                             f"rank; routed copies per rank: {routed_W}")
        return _Route(num_tokens, top_k, idx_N, order_N, num_routed_E, num_send_E, num_recv_PL, send_splits,
                      recv_splits, num_send_remote, present_PT, send_rows, recv_rows)

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

    def _unique_rows(self, idx_N, order_N, num_routed_E, num_send_E, num_tokens: int, top_k: int):
        """Once per rank: the [P, T] mask of the (destination rank, token) pairs of the kept
        copies, the unique rows this rank sends to each peer, and (exchanged) those it receives.
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
        uniq_send_P = present_PT.sum(dim=1)
        return present_PT, uniq_send_P, self._exchange_counts(uniq_send_P, bound=num_tokens)

    def _token_rank_sends(self, idx_TK: torch.Tensor) -> torch.Tensor:
        """(token, other ep rank) pairs among the routed copies, before drops: the rows a
        once-per-destination-rank dispatch would send (``DispatchResult.num_token_rank_sends``)."""
        dest_TK = torch.div(idx_TK, self.num_local_experts, rounding_mode="floor")
        hit_TP = torch.zeros(idx_TK.shape[0], self.ep_size, dtype=torch.bool, device=idx_TK.device)
        hit_TP.scatter_(1, dest_TK, True)
        hit_TP[:, self.ep_rank] = False
        return hit_TP.sum()

    # ----- steps 3-8 per copy ---------------------------------------------------------------------

    def _send_per_copy(self, x_TD, route: _Route, order_M, token_idx_M, weights_M):
        bags = bags_from_copies(order_M, route.num_tokens, route.top_k)
        x_send_MD = gather_rows(x_TD, token_idx_M, bags)
        # 4. Variable-size all-to-all; autograd sends the gradients back the same way.
        x_recv_RD = self._all_to_all(x_send_MD, output_splits=route.recv_splits, input_splits=route.send_splits,
                                     payload="dispatch")
        # 5. Group the received rows by local expert: they arrive as [source rank][local expert]
        #    and the experts want [local expert][source rank].
        num_recv = sum(route.recv_splits)
        group_R = ungroup_R = None
        x_MD = x_recv_RD
        if self.ep_size > 1:
            group_R = group_by_local_expert(route.num_recv_PL, num_recv)
            ungroup_R = torch.empty_like(group_R).scatter_(0, group_R, torch.arange(num_recv, device=group_R.device))
            x_MD = permute_rows(x_recv_RD, group_R, ungroup_R)
        return x_MD, _PerCopyState(token_idx_M, weights_M, route.num_tokens, group_R, ungroup_R,
                                   route.send_splits, route.recv_splits, bags)

    # ----- steps 3-8 once per rank (moe.dispatch_dedup) -------------------------------------------

    def _send_once_per_rank(self, x_TD, route: _Route, order_M, token_idx_M, weights_M):
        P, L, dev = self.ep_size, self.num_local_experts, x_TD.device
        num_tokens, send_splits, recv_splits = route.num_tokens, route.send_splits, route.recv_splits
        send_rows, recv_rows = route.send_rows, route.recv_rows
        # 3b. Each unique row once, grouped by destination rank (token order inside a block), and
        #     for every copy the index of its row inside the destination's block.
        present_PT = route.present_PT
        send_token_U = torch.nonzero_static(present_PT.reshape(-1), size=sum(send_rows)).squeeze(1) % num_tokens
        row_in_block_PT = torch.cumsum(present_PT.long(), dim=1) - 1
        dest_M = torch.div(route.idx_N[order_M], L, rounding_mode="floor")
        rel_row_M = row_in_block_PT[dest_M, token_idx_M]
        # 4. Rows (autograd), gate weights (autograd: their gradient comes back) and row indices.
        token_bags = bags_by_index(send_token_U, num_tokens)
        x_recv_VD = self._all_to_all(gather_rows(x_TD, send_token_U, token_bags), output_splits=recv_rows,
                                     input_splits=send_rows, payload="dispatch")
        # Gate weights stay fp32 both ways, like the router's scores.
        w_recv_R = self._all_to_all(weights_M, output_splits=recv_splits, input_splits=send_splits)
        rel_row_R = self._exchange_ints(rel_row_M, output_splits=recv_splits, input_splits=send_splits,
                                        bound=num_tokens - 1)
        # 5. Copies arrive as [source rank][local expert]; point each at its row, group by expert.
        num_recv = sum(recv_splits)
        recv_rows_P = torch.tensor(recv_rows, device=dev)
        src_R = torch.repeat_interleave(torch.arange(P, device=dev), torch.tensor(recv_splits, device=dev),
                                        output_size=num_recv)
        row_R = rel_row_R + (torch.cumsum(recv_rows_P, dim=0) - recv_rows_P)[src_R]
        group_R = group_by_local_expert(route.num_recv_PL, num_recv)
        row_M, w_M = row_R.index_select(0, group_R), w_recv_R.index_select(0, group_R)
        row_bags = bags_by_index(row_M, sum(recv_rows))
        x_MD = gather_rows(x_recv_VD, row_M, row_bags)
        return x_MD, _OncePerRankState(row_M=row_M, weights_M=w_M, num_rows=sum(recv_rows),
                                       send_token_U=send_token_U, send_rows=send_rows, recv_rows=recv_rows,
                                       row_bags=row_bags, token_bags=token_bags)

    def _combine_once_per_rank(self, y_MD: torch.Tensor, state: _OncePerRankState) -> torch.Tensor:
        # 7. Weighted sum of a token's copies on this rank into its one row, then that row home.
        y_rows_VD = weighted_scatter(y_MD, state.weights_M, state.row_M, state.num_rows, state.row_bags)
        back_UD = self._all_to_all(y_rows_VD, output_splits=state.send_rows, input_splits=state.recv_rows,
                                   payload="combine")
        # 8. Sum the rows coming back from every rank into their tokens.
        return sum_rows(back_UD, state.send_token_U, state.token_bags)

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

    def _all_to_all(self, x_MX: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                    payload: str | None = None) -> torch.Tensor:
        """Variable-size all-to-all over ep of the rows of ``x_MX``; autograd sends the gradients
        back the same way. ``payload`` "dispatch" or "combine" marks token rows, which travel in
        the wire format of ``dispatch_dtype`` (the combine in bf16 when it is not "none")."""
        if self.ep_group is None:
            return x_MX
        wire = "none" if payload is None else self.dispatch_dtype
        wire = "bf16" if wire == "fp8_e4m3" and payload == "combine" else wire
        dim = x_MX.shape[1] if payload is not None else None
        self.stats.count_exchange(input_splits=input_splits, output_splits=output_splits, own=self.ep_rank,
                                  row_bytes=row_bytes(x_MX) if wire == "none" else wire_row_bytes(dim, wire),
                                  dispatch_row_elements=dim if payload == "dispatch" else None)
        if wire != "none":
            return exchange_rows(x_MX, wire=wire, output_splits=output_splits, input_splits=input_splits,
                                 group=self.ep_group)
        return all_to_all_single_autograd(x_MX.contiguous(), output_splits, input_splits, self.ep_group)

    def _exchange_ints(self, x_MX: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                       bound: int) -> torch.Tensor:
        """All-to-all over ep of integer rows in ``[0, bound]`` (no autograd)."""
        if self.ep_group is None:
            return x_MX
        wire_MX, out_RX = self._int_buffers(x_MX, bound, output_splits, input_splits, self.ep_rank)
        dist.all_to_all_single(out_RX, wire_MX, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=self.ep_group)
        return ints_from_bytes(out_RX, bound, x_MX.shape[1:]) if self.compact_ints else out_RX

    def _exchange_counts(self, send_PX: torch.Tensor, *, bound: int) -> torch.Tensor:
        """Row p of ``send_PX`` (counts in ``[0, bound]``) to ep rank p; returns what each rank
        sent here (no autograd)."""
        if self.ep_group is None:
            return send_PX
        ones = [1] * self.ep_size
        wire_PX, recv_PX = self._int_buffers(send_PX, bound, ones, ones, self.ep_rank)
        dist.all_to_all_single(recv_PX, wire_PX, group=self.ep_group)
        return ints_from_bytes(recv_PX, bound, send_PX.shape[1:]) if self.compact_ints else recv_PX

    def _all_gather(self, x: torch.Tensor, *, bound: int | None = None) -> torch.Tensor:
        """Every data-parallel rank's ``x``, concatenated along dim 0 in rank order (no autograd);
        ``bound``: integers in ``[0, bound]``."""
        compact = bound is not None and self.compact_ints
        splits = [x.shape[0]] * self.dp_size
        wire, out = self._int_buffers(x, bound if compact else None, splits, splits, self.dp_rank)
        all_gather_single(out, wire, group=self.dp_group)  # gloo wants the output flat along dim 0
        return ints_from_bytes(out, bound, x.shape[1:]) if compact else out

    def _int_buffers(self, x_MX: torch.Tensor, bound: int | None, output_splits: list[int], input_splits: list[int],
                     own: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Send and receive buffers of a no-autograd exchange, counted. With ``compact_ints`` (a
        dispatch_dtype under expert parallelism) integers in ``[0, bound]`` travel as the bytes
        of the smallest integer type that holds them; otherwise as they are."""
        wire_MX = ints_to_bytes(x_MX, bound) if bound is not None and self.compact_ints else x_MX.contiguous()
        self.stats.count_exchange(input_splits=input_splits, output_splits=output_splits, own=own,
                                  row_bytes=row_bytes(wire_MX))
        return wire_MX, wire_MX.new_empty(sum(output_splits), *wire_MX.shape[1:])
