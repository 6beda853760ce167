"""Expert parallelism: each rank of an ep group holds E/ep experts, and token copies travel to
them by all-to-all and come back.

``AllToAllDispatcher`` has the interface of ``LocalDispatcher`` (``dispatch``/``combine``), so the
MoE layer does not know where its experts live. ``apply_expert_parallel`` swaps it in, shards the
expert weights as DTensors over the ``ep`` mesh axis, and points the load-balancing loss at the
data-parallel group.

Equivalence with one process: the reference is one process holding the global batch (the ranks'
batches concatenated in rank order) and all experts. Dropless, every copy reaches the same expert
with the same input. With a capacity factor, capacity is ``ceil(f * T_global * K / E)`` and the
copies kept are exactly those the single process keeps ("position": earliest global position;
"score": highest router weight, ties by global position), which needs the per-rank routing
counts (and for "score" the router weights) of every data-parallel rank.

Shape legend: T tokens on this rank, D model dim, E experts, L = E/ep local experts, K experts
per token, N = T*K routed copies, M copies this rank sends (kept), R copies it receives,
P ranks in the ep group, W data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from moetrain.config.moe import MoEConfig
from moetrain.models.moe.dispatcher import (
    DispatchResult,
    LocalDispatcher,
    capacity_keep_mask,
    count_per_expert,
    expert_capacity,
    sort_by_expert,
)
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.layer import MoELayer
from moetrain.models.moe.token_bags import (
    TokenBags,
    bags_by_index,
    bags_from_copies,
    gather_rows,
    permute_rows,
    sum_rows,
    weighted_scatter,
)

_COUNT_BYTES = torch.empty((), dtype=torch.int64).element_size()
# torch 2.13 renamed all_gather_into_tensor (same arguments) and deprecates the old name.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


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

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received,
                         self.min_bytes + other.min_bytes)


@dataclass
class _A2AState:
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
    bags: TokenBags | None = None
    """Sent copies of each local token (None with dedup, whose state has its own)."""
    dedup: _DedupState | None = None


@dataclass
class _DedupState:
    """Once-per-rank sending: a token goes to a rank once, however many of its experts live there."""

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

    Expert ``e`` lives on ep rank ``e // L`` as its local expert ``e % L``. ``ep_group=None`` means
    ep=1 (used for data parallelism with a capacity factor, where only the global drops matter).
    ``dp_group`` (all data-parallel ranks, in global rank order) is needed in capacity mode only.
    """

    def __init__(self, num_experts: int, *, ep_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None = None, capacity_factor: float | None = None,
                 dedup: bool = False) -> None:
        self.num_experts = num_experts
        # Send a token once per destination rank (moe.dispatch_dedup); see _DedupState.
        self.dedup = dedup and ep_group is not None
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"parallel.ep ({self.ep_size}) must divide moe.num_experts ({num_experts})")
        self.num_local_experts = num_experts // self.ep_size
        self.capacity_factor = capacity_factor
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

    # ----- dispatch ------------------------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity: int | None = None, drop_policy: str = "position") -> DispatchResult:
        """Route copies to their experts' ranks; returns them grouped by local expert.

        ``capacity`` not None switches capacity mode on. Its value (the layer computes it from
        this rank's T) is replaced by the capacity of the global batch of W ranks,
        ``expert_capacity(T * W, ...)``, because drops are decided over the global batch, as one
        process would decide them. Capacity mode needs the same T on every rank.
        """
        num_tokens, top_k = idx_TK.shape
        E, P, L, j = self.num_experts, self.ep_size, self.num_local_experts, self.ep_rank
        idx_N = idx_TK.reshape(-1)
        row_bytes = x_TD.shape[1] * x_TD.element_size()

        # 1. Tokens per expert. Sorting by global expert id also orders the copies by destination
        #    rank, because rank s holds experts s*L .. s*L+L-1.
        num_routed_E = count_per_expert(idx_N, E)
        order_N = sort_by_expert(idx_TK, weights_TK, drop_policy=drop_policy)

        # 2. Exchange counts: how many copies each ep peer sends to each of my local experts.
        if capacity is None:
            num_send_E = num_routed_E
            num_recv_PL = self._exchange_counts(num_send_E.view(P, L))
            count_sent = count_received = (P - 1) * L * _COUNT_BYTES
        else:
            if self.dp_group is None or self.capacity_factor is None:
                raise ValueError("capacity mode under expert/data parallelism needs dp_group and "
                                 "capacity_factor on the AllToAllDispatcher")
            # Capacity of the global batch; every rank holds T tokens (ParallelDims.check_batch),
            # which the host sync below verifies.
            capacity = expert_capacity(num_tokens * self.dp_size, num_experts=E, top_k=top_k,
                                       capacity_factor=self.capacity_factor)
            num_routed_WE, kept_WE, count_sent, count_received = self._global_keep_counts(
                num_routed_E, idx_TK, weights_TK, capacity=capacity, drop_policy=drop_policy)
            num_send_E = kept_WE[self.dp_rank]
            # Every rank's kept counts are known after the all-gather: no second exchange needed.
            members_P = self._ep_members_in_dp.to(kept_WE.device)
            num_recv_PL = kept_WE.index_select(0, members_P)[:, j * L:(j + 1) * L]
        send_P = num_send_E.view(P, L).sum(dim=1)
        recv_P = num_recv_PL.sum(dim=1)
        # Minimum traffic: kept copies whose expert is on another rank. Dropless, counted from the
        # routing itself (independent of the split sizes that the exchange uses).
        if capacity is None:
            num_remote = (torch.div(idx_N, L, rounding_mode="floor") != j).sum()
        else:
            num_remote = num_send_E.sum() - num_send_E[j * L:(j + 1) * L].sum()
        if self.dedup:
            # (3a) Which tokens each rank must receive: (rank, token) pairs of the kept copies,
            #      found on the device so the host sync below stays the only one.
            present_PT, uniq_send_P, uniq_recv_P = self._unique_rows(idx_N, order_N, num_routed_E, num_send_E,
                                                                     num_tokens, top_k)
            count_sent, count_received = count_sent + (P - 1) * _COUNT_BYTES, count_received + (P - 1) * _COUNT_BYTES
        # The one host sync of the layer: all_to_all_single takes its split sizes as Python ints.
        to_host = [send_P, recv_P, num_remote.view(1)]
        if self.dedup:
            to_host += [uniq_send_P, uniq_recv_P]
        if capacity is not None:
            to_host.append(num_routed_WE.sum(dim=1))
        host = torch.cat(to_host).tolist()
        send_splits, recv_splits, num_send_remote = host[:P], host[P:2 * P], host[2 * P]
        rest = host[2 * P + 1:]
        if self.dedup:
            send_rows, recv_rows, rest = rest[:P], rest[P:2 * P], rest[2 * P:]
        if capacity is not None and any(n != num_tokens * top_k for n in rest):
            raise ValueError(f"capacity mode under data parallelism needs the same token count on every "
                             f"rank; routed copies per rank: {rest}")
        num_recv_remote = sum(recv_splits) - recv_splits[j]
        self.stats.bytes_sent += count_sent
        self.stats.bytes_received += count_received
        if self.dedup:
            # What must move when a token travels once per destination rank: its unique rows.
            rows_remote = sum(send_rows) - send_rows[j] + sum(recv_rows) - recv_rows[j]
            self.stats.min_bytes += 2 * rows_remote * row_bytes + 2 * (P - 1) * (L + 1) * _COUNT_BYTES
        else:
            self.stats.min_bytes += 2 * (num_send_remote + num_recv_remote) * row_bytes \
                + 2 * (P - 1) * L * _COUNT_BYTES

        # 3. Permute by destination rank and expert: keep the first kept_e copies of each expert's
        #    block (the sort put them in drop-priority order), gather their token rows.
        num_send = sum(send_splits)
        if capacity is None:
            order_M = order_N
        else:
            order_M = order_N.index_select(0, _kept_positions(num_routed_E, num_send_E, num_send))
        token_idx_M = torch.div(order_M, top_k, rounding_mode="floor")
        weights_M = weights_TK.reshape(-1).index_select(0, order_M)
        if self.dedup:
            return self._dispatch_dedup(x_TD, idx_N, order_M, token_idx_M, weights_M, present_PT,
                                        send_splits, recv_splits, send_rows, recv_rows, num_recv_PL,
                                        num_routed_E, num_send_E, num_tokens, row_bytes)
        bags = bags_from_copies(order_M, num_tokens, top_k)
        x_send_MD = gather_rows(x_TD, token_idx_M, bags)

        # 4. Variable-size all-to-all; autograd sends the gradients back the same way.
        x_recv_RD = self._all_to_all(x_send_MD, output_splits=recv_splits, input_splits=send_splits,
                                     row_bytes=row_bytes)

        # 5. Group the received rows by local expert: they arrive as [source rank][local expert]
        #    and the experts want [local expert][source rank].
        num_recv = sum(recv_splits)
        group_R = ungroup_R = None
        x_MD = x_recv_RD
        if P > 1:
            group_R = _group_by_local_expert(num_recv_PL, num_recv)
            ungroup_R = torch.empty_like(group_R).scatter_(
                0, group_R, torch.arange(num_recv, device=group_R.device))
            x_MD = permute_rows(x_recv_RD, group_R, ungroup_R)
        # (6. The experts run in the layer, between dispatch and combine.)
        return DispatchResult(
            x_MD=x_MD, num_tokens_per_expert=num_recv_PL.sum(dim=0),
            num_routed_per_expert=num_routed_E, num_dropped=(num_routed_E - num_send_E).sum(),
            state=_A2AState(token_idx_M, weights_M, num_tokens, group_R, ungroup_R, send_splits, recv_splits,
                            bags=bags))

    # ----- combine -------------------------------------------------------------------------------

    def combine(self, y_MD: torch.Tensor, state: _A2AState) -> torch.Tensor:
        if state.dedup is not None:
            return self._combine_dedup(y_MD, state)
        # 7. Reverse all-to-all: back to [source rank][local expert] order, then home.
        y_recv_RD = y_MD if state.ungroup_R is None else permute_rows(y_MD, state.ungroup_R, state.group_R)
        y_back_MD = self._all_to_all(y_recv_RD, output_splits=state.send_splits,
                                     input_splits=state.recv_splits,
                                     row_bytes=y_MD.shape[1] * y_MD.element_size())
        # 8. Unpermute and weighted combine: out[t] = sum over t's kept copies of w * y.
        return weighted_scatter(y_back_MD, state.weights_M, state.token_idx_M, state.num_tokens, state.bags)

    # ----- once-per-rank dispatch (moe.dispatch_dedup) ----------------------------------------------

    def _unique_rows(self, idx_N, order_N, num_routed_E, num_send_E, num_tokens: int, top_k: int):
        """[P, T] mask of the (destination rank, token) pairs of the kept copies, the unique rows
        this rank sends to each peer, and (exchanged) the unique rows it receives from each."""
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
        uniq_recv_P = torch.empty_like(uniq_send_P)
        dist.all_to_all_single(uniq_recv_P, uniq_send_P, group=self.ep_group)
        return present_PT, uniq_send_P, uniq_recv_P

    def _dispatch_dedup(self, x_TD, idx_N, order_M, token_idx_M, weights_M, present_PT, send_splits,
                        recv_splits, send_rows, recv_rows, num_recv_PL, num_routed_E, num_send_E,
                        num_tokens: int, row_bytes: int) -> DispatchResult:
        P, L, j = self.ep_size, self.num_local_experts, self.ep_rank
        dev = x_TD.device
        # 3b. Each unique row once, grouped by destination rank (token order inside a block), and
        #     for every copy the index of its row inside the destination's block.
        num_send_rows = sum(send_rows)
        send_token_U = torch.nonzero_static(present_PT.reshape(-1), size=num_send_rows).squeeze(1) % num_tokens
        row_in_block_PT = torch.cumsum(present_PT.long(), dim=1) - 1
        dest_M = torch.div(idx_N[order_M], L, rounding_mode="floor")
        rel_row_M = row_in_block_PT[dest_M, token_idx_M]
        # 4. Rows (autograd), gate weights (autograd: their gradient comes back) and row indices.
        token_bags = bags_by_index(send_token_U, num_tokens)
        x_recv_VD = self._all_to_all(gather_rows(x_TD, send_token_U, token_bags), output_splits=recv_rows,
                                     input_splits=send_rows, row_bytes=row_bytes)
        w_recv_R = self._all_to_all(weights_M.contiguous(), output_splits=recv_splits, input_splits=send_splits,
                                    row_bytes=weights_M.element_size())
        rel_row_R = rel_row_M.new_empty(sum(recv_splits))
        dist.all_to_all_single(rel_row_R, rel_row_M, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                               group=self.ep_group)
        remote_sent, remote_recv = sum(send_splits) - send_splits[j], sum(recv_splits) - recv_splits[j]
        self.stats.bytes_sent += remote_sent * rel_row_M.element_size()
        self.stats.bytes_received += remote_recv * rel_row_M.element_size()
        # 5. Copies arrive as [source rank][local expert]; point each at its row, group by expert.
        num_recv = sum(recv_splits)
        recv_rows_P = torch.tensor(recv_rows, device=dev)
        src_R = torch.repeat_interleave(torch.arange(P, device=dev), torch.tensor(recv_splits, device=dev),
                                        output_size=num_recv)
        row_R = rel_row_R + (torch.cumsum(recv_rows_P, dim=0) - recv_rows_P)[src_R]
        group_R = _group_by_local_expert(num_recv_PL, num_recv)
        row_M, w_M = row_R.index_select(0, group_R), w_recv_R.index_select(0, group_R)
        row_bags = bags_by_index(row_M, sum(recv_rows))
        x_MD = gather_rows(x_recv_VD, row_M, row_bags)
        dedup = _DedupState(row_M=row_M, weights_M=w_M, num_rows=sum(recv_rows), send_token_U=send_token_U,
                            send_rows=send_rows, recv_rows=recv_rows, row_bags=row_bags, token_bags=token_bags)
        return DispatchResult(
            x_MD=x_MD, num_tokens_per_expert=num_recv_PL.sum(dim=0),
            num_routed_per_expert=num_routed_E, num_dropped=(num_routed_E - num_send_E).sum(),
            state=_A2AState(token_idx_M, weights_M, num_tokens, None, None, send_splits, recv_splits,
                            dedup=dedup))

    def _combine_dedup(self, y_MD: torch.Tensor, state: _A2AState) -> torch.Tensor:
        d = state.dedup
        # 7. Weighted sum of a token's copies on this rank into its one row, then that row home.
        y_rows_VD = weighted_scatter(y_MD, d.weights_M, d.row_M, d.num_rows, d.row_bags)
        back_UD = self._all_to_all(y_rows_VD, output_splits=d.send_rows, input_splits=d.recv_rows,
                                   row_bytes=y_MD.shape[1] * y_MD.element_size())
        # 8. Sum the rows coming back from every rank into their tokens.
        return sum_rows(back_UD, d.send_token_U, d.token_bags)

    # ----- communication helpers -----------------------------------------------------------------

    def _all_to_all(self, x_MD: torch.Tensor, *, output_splits: list[int], input_splits: list[int],
                    row_bytes: int) -> torch.Tensor:
        if self.ep_group is None:
            return x_MD
        j = self.ep_rank
        self.stats.bytes_sent += (sum(input_splits) - input_splits[j]) * row_bytes
        self.stats.bytes_received += (sum(output_splits) - output_splits[j]) * row_bytes
        return all_to_all_single_autograd(x_MD.contiguous(), output_splits, input_splits, self.ep_group)

    def _exchange_counts(self, num_send_PL: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return num_send_PL
        num_recv_PL = torch.empty_like(num_send_PL)
        dist.all_to_all_single(num_recv_PL, num_send_PL.contiguous(), group=self.ep_group)
        return num_recv_PL

    def _global_keep_counts(self, num_routed_E: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor,
                            *, capacity: int, drop_policy: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Copies each data-parallel rank routes and keeps per expert, ``[W, E]`` each, with the
        copies kept exactly as one process holding the global batch (the ranks' batches
        concatenated in rank order) keeps them."""
        E, W, K = self.num_experts, self.dp_size, idx_TK.shape[1]
        num_routed_WE = num_routed_E.new_empty(W * E)  # gloo wants the output flat along dim 0
        _all_gather_single(num_routed_WE, num_routed_E, group=self.dp_group)
        num_routed_WE = num_routed_WE.view(W, E)
        sent = received = (W - 1) * E * _COUNT_BYTES
        if drop_policy == "position":
            # Earlier ranks' copies come first in the global batch and win capacity.
            earlier_WE = torch.cumsum(num_routed_WE, dim=0) - num_routed_WE
            kept_WE = torch.minimum(num_routed_WE, (capacity - earlier_WE).clamp(min=0))
            return num_routed_WE, kept_WE, sent, received
        # "score": the top-capacity copies of each expert by router weight over the global batch,
        # ties to the earlier global position. Gather every rank's (expert, weight) pairs, which
        # are D times smaller than the tokens, and replay the single-process selection.
        idx_WTK = idx_TK.new_empty(W * idx_TK.shape[0], K)
        weights_WTK = weights_TK.new_empty(W * weights_TK.shape[0], K)
        _all_gather_single(idx_WTK, idx_TK.contiguous(), group=self.dp_group)
        _all_gather_single(weights_WTK, weights_TK.detach().contiguous(), group=self.dp_group)
        per_rank = idx_TK.numel() * (idx_TK.element_size() + weights_TK.element_size())
        sent, received = sent + (W - 1) * per_rank, received + (W - 1) * per_rank
        order_G = sort_by_expert(idx_WTK, weights_WTK, drop_policy="score")
        idx_G = idx_WTK.reshape(-1)
        keep_G = capacity_keep_mask(idx_G[order_G], num_routed_WE.sum(dim=0), capacity)
        rank_G = torch.div(order_G, idx_TK.numel(), rounding_mode="floor")
        kept_WE = torch.zeros_like(num_routed_WE).index_put_(
            (rank_G, idx_G[order_G]), keep_G.long(), accumulate=True)
        return num_routed_WE, kept_WE, sent, received


def _group_by_local_expert(num_recv_PL: torch.Tensor, num_recv: int) -> torch.Tensor:
    """Order that turns rows received as [source rank][local expert] into [local expert][source
    rank] (stable: a rank's rows keep their order inside an expert's block)."""
    P, L = num_recv_PL.shape
    local_expert_R = torch.repeat_interleave(
        torch.arange(L, device=num_recv_PL.device).repeat(P), num_recv_PL.reshape(-1), output_size=num_recv)
    return torch.sort(local_expert_R, stable=True).indices


def _kept_positions(num_routed_E: torch.Tensor, num_kept_E: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Positions, in expert-sorted order, of the first ``num_kept_E[e]`` copies of each expert's
    block. ``num_kept`` (their total, known on the host) sizes the result without a host sync."""
    E = num_routed_E.numel()
    block_start_E = torch.cumsum(num_routed_E, dim=0) - num_routed_E
    kept_start_E = torch.cumsum(num_kept_E, dim=0) - num_kept_E
    expert_M = torch.repeat_interleave(torch.arange(E, device=num_routed_E.device), num_kept_E,
                                       output_size=num_kept)
    return block_start_E[expert_M] + torch.arange(num_kept, device=num_routed_E.device) - kept_start_E[expert_M]


# ----- applying expert parallelism to a model ------------------------------------------------------


def build_dispatcher(dims, moe: MoEConfig):
    """The dispatcher a layout needs: all-to-all when experts are split (ep > 1), or when data
    parallelism meets a capacity factor (drops are decided over the global batch); otherwise local."""
    if dims.ep > 1 or (dims.dp > 1 and moe.capacity_factor is not None):
        return AllToAllDispatcher(moe.num_experts, ep_group=dims.ep_group if dims.ep > 1 else None,
                                  dp_group=dims.dp_group if dims.dp > 1 else None,
                                  capacity_factor=moe.capacity_factor, dedup=moe.dispatch_dedup)
    return LocalDispatcher(moe.num_experts)


def shard_experts(experts: GroupedExperts, dims) -> None:
    """Replace the full ``[E, ...]`` expert weights by DTensors sharded ``Shard(0)`` over ``ep``.

    The model was built full-size with the same seed on every rank (experts initialised by global
    index), so each rank slices its own experts out: no communication, and the global model is
    the same for any ep. As DTensors, the shards carry their global shape and offsets into
    checkpoints, which therefore reshard across ep degrees.
    """
    for name in ("w1", "w2", "w3"):
        w = getattr(experts, name)
        if w is None or isinstance(w, DTensor):
            continue
        num_local = w.shape[0] // dims.ep
        lo = dims.ep_rank * num_local
        local = w.detach()[lo:lo + num_local].clone()
        shard = DTensor.from_local(local, dims.ep_mesh, [Shard(0)], run_check=False,
                                   shape=w.shape, stride=w.stride())
        setattr(experts, name, nn.Parameter(shard, requires_grad=w.requires_grad))


def is_expert_shard(p: torch.Tensor) -> bool:
    """True for expert weights sharded over the ``ep`` mesh axis by :func:`shard_experts`."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def apply_expert_parallel(model: nn.Module, dims) -> nn.Module:
    """For each ``MoELayer``: swap in the dispatcher the layout needs, shard the experts over ``ep``,
    and sum the load-balancing counts over all data-parallel ranks (so the mean of the per-rank
    aux losses is the single-process aux loss). In place; returns ``model``."""
    for name, layer in model.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        num_experts = layer.config.num_experts
        if num_experts % dims.ep != 0:
            raise ValueError(f"parallel.ep ({dims.ep}) must divide moe.num_experts ({num_experts}) "
                             f"of layer {name!r}")
        layer.dispatcher = dims.dispatcher(layer.config)
        if dims.ep > 1:
            shard_experts(layer.experts, dims)
        if dims.dp > 1:
            layer.balance_group = dims.dp_group
    return model


def collect_comm_stats(model: nn.Module, *, reset: bool = True) -> CommStats:
    """Sum of the all-to-all byte counters of every MoE layer of ``model`` on this rank."""
    total = CommStats()
    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        if isinstance(module, MoELayer) and isinstance(dispatcher, AllToAllDispatcher):
            total = total + dispatcher.read_comm_stats(reset=reset)
    return total
