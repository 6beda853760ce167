"""Node-aware expert all-to-all (``parallel.ep_hierarchical``) for ep groups that span nodes.

The flat exchange (``moetrain.distributed.expert_parallel.dispatcher``) sends a token's row to every rank holding
one of its experts, so a token whose K experts sit on two ranks of one remote node crosses the
slow inter-node link twice. Here, as in DeepEP, the ep group's P ranks are Q nodes of G ranks,
ep rank ``q * G + g`` being rank g of node q, and a row travels in two stages:

1. across nodes, once per destination node, to the rank with the same local index g there (the
   ``ep_inter`` group: one rank per node, a "rail");
2. inside that node, from this relay to each rank holding one of the token's experts (the
   ``ep_intra`` group), once per rank; the rank fans the row out to its experts.

The combine reverses both: each rank sums the weighted outputs of a row's experts, the relay sums
the partial outputs of its node's ranks, and one row per token and node crosses back, where the
home rank sums the nodes. Example, P=4 on Q=2 nodes of G=2, E=8 (experts 2p, 2p+1 on rank p): a
token of rank 0 routed to experts 4 and 6 (ranks 2 and 3, both on node 1) crosses once, to rank 2,
which keeps it for expert 4 and forwards it to rank 3 for expert 6; flat, it would cross twice.

Routing and drops are the flat dispatcher's own (``_route`` with the once-per-rank presence), so
the kept copies, and every expert input, are those of the flat exchange. Each row carries its K
slots along, the node-local (stage 1) then rank-local (stage 2) expert of each kept copy there
(0: none; the smallest integer type with a compressed ``dispatch_dtype``) and the K gate weights
(fp32, with autograd). Token rows travel in the ``moe.dispatch_dtype`` wire format: compressed once
at the source and forwarded as they arrived (an fp8 row is not re-quantised at the relay), decoded
at the expert's rank; the combine and the backward travel in bf16, summed at the relay in the
compute dtype. Two host syncs per dispatch: the routing step's, and the stage splits' (a relay's
forward counts come from its peers, after the first).

Shape legend: T tokens on this rank, D model dim, K experts per token, E experts, L local experts
per rank, P ep ranks = Q nodes x G ranks per node, U rows this rank sends across (one per token and
destination node), V rows it relays, S rows it forwards inside the node, R rows it receives for
its experts, M copies its experts compute (grouped by local expert).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moetrain.config.moe import MoEConfig
from moetrain.distributed.comm.stats import row_bytes
from moetrain.distributed.comm.timer import timed_exchange
from moetrain.distributed.expert_parallel.dispatcher import AllToAllDispatcher
from moetrain.distributed.expert_parallel.index import kept_positions, to_host
from moetrain.distributed.expert_parallel.wire import (
    exchange_rows,
    ints_from_bytes,
    ints_to_bytes,
    pack_e4m3,
    unpack_e4m3,
    wire_row_bytes,
)
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.models.moe.dispatcher import DispatchResult, ExpertsFn, RoutedOutput
from moetrain.models.moe.token_bags import TokenBags, bags_by_index, gather_rows, sum_rows, weighted_scatter


@dataclass
class _Stage:
    """One all-to-all of the two: its group, this rank's place in it, the node of each member,
    and the rows sent to / received from each member."""

    group: dist.ProcessGroup
    own: int
    nodes: list[int]
    send: list[int]
    recv: list[int]


@dataclass
class _HierarchicalState:
    send_token_U: torch.Tensor
    """Local token of each row sent across, in send order (by destination node, then token)."""
    token_bags: TokenBags
    """Rows sent across of each local token."""
    relay_S: torch.Tensor
    """Relayed row (of V) that each forwarded row copies, in send order (by local rank, then row)."""
    relay_bags: TokenBags
    """Forwarded rows of each relayed row."""
    row_M: torch.Tensor
    """Received row (of R) of each expert-grouped copy."""
    weights_M: torch.Tensor
    row_bags: TokenBags
    inter: _Stage
    intra: _Stage


class HierarchicalDispatcher(AllToAllDispatcher):
    """The two-stage exchange (module docstring) behind the ``Dispatcher`` interface.

    ``inter_group``: this rank's peers with the same local index on the ep group's other nodes
    (``ParallelDims.ep_inter_group``); ``intra_group``: its ep group's ranks on its node
    (``ParallelDims.ep_intra_group``); ``ep_nodes``/``dp_nodes``: the node of each ep / dp rank,
    which sorts the byte counters into inter- and intra-node. Drops, capacity and ``dp_group`` as
    ``AllToAllDispatcher``.
    """

    def __init__(self, num_experts: int, *, ep_group: dist.ProcessGroup, inter_group: dist.ProcessGroup,
                 intra_group: dist.ProcessGroup, ep_nodes: Sequence[int], dp_group: dist.ProcessGroup | None = None,
                 dp_nodes: Sequence[int] | None = None, dispatch_dtype: str = "none") -> None:
        # dedup: the routing step then finds each token's (destination rank) pairs, which both
        # stages are made of.
        super().__init__(num_experts, ep_group=ep_group, dp_group=dp_group, dedup=True,
                         dispatch_dtype=dispatch_dtype)
        # The inherited exchanges (routing counts, capacity all-gather) count their inter-node
        # bytes by these.
        self.ep_nodes, self.dp_nodes = list(ep_nodes), None if dp_nodes is None else list(dp_nodes)
        self.inter_group, self.intra_group = inter_group, intra_group
        self.num_nodes, self.node_size = dist.get_world_size(inter_group), dist.get_world_size(intra_group)
        self.node_index, self.local_index = dist.get_rank(inter_group), dist.get_rank(intra_group)
        # ParallelDims builds these groups from the rank order; here it is the invariant.
        assert self.num_nodes * self.node_size == self.ep_size, (self.num_nodes, self.node_size, self.ep_size)
        assert self.ep_rank == self.node_index * self.node_size + self.local_index, self.ep_rank
        G, g = self.node_size, self.local_index
        self._inter_nodes = [self.ep_nodes[q * G + g] for q in range(self.num_nodes)]
        self._intra_nodes = [self.ep_nodes[self.node_index * G + h] for h in range(G)]
        assert len(set(self._inter_nodes)) == self.num_nodes and len(set(self._intra_nodes)) == 1, self.ep_nodes

    # ----- dispatch and combine ------------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity_factor: float | Fraction | None = None, drop_policy: str = "position") -> DispatchResult:
        """As ``AllToAllDispatcher.dispatch`` (the same copies kept and grouped by local expert),
        through the two stages."""
        return self._launch(x_TD, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)()

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn, *,
                    capacity_factor: float | Fraction | None = None, drop_policy: str = "position",
                    in_flight: Callable[[], torch.Tensor] | None = None) -> RoutedOutput:
        """Dispatch, ``experts``, combine; ``in_flight()`` runs while the rows travel inside the
        node (with ``dispatch_dtype`` "none", whose exchanges are waited for when read)."""
        receive = self._launch(x_TD, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
        overlapped = in_flight() if in_flight is not None else None
        d = receive()
        out_TD = self.combine(experts(d.x_MD, d.num_tokens_per_expert), d.state)
        return RoutedOutput(out_TD=out_TD, overlapped=overlapped, num_routed_per_expert=d.num_routed_per_expert,
                            num_dropped=d.num_dropped, token_idx_M=d.token_idx_M,
                            num_token_rank_sends=d.num_token_rank_sends)

    def _launch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                capacity_factor: float | Fraction | None,
                drop_policy: str) -> Callable[[], DispatchResult]:
        """Steps 1-5 (the rows leave for the experts' ranks); returns step 6, which reads them."""
        num_tokens, top_k = idx_TK.shape
        # 1.-2. Count, exchange counts or decide the global drops (the flat dispatcher's step).
        route = self._route(idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
        self._count_minimum(route, dim=x_TD.shape[1], element_bytes=x_TD.element_size())
        order_M = route.order_N
        if capacity_factor is not None:
            order_M = order_M.index_select(0, kept_positions(route.num_routed_E, route.num_send_E,
                                                              sum(route.send_splits)))
        keep_TK = torch.zeros(num_tokens * top_k, dtype=torch.bool, device=idx_TK.device)
        keep_TK = keep_TK.index_fill_(0, order_M, True).view(num_tokens, top_k)
        # 3. The rows of each destination node, and every split of both stages (host sync).
        present_QGT = route.present_PT.view(self.num_nodes, self.node_size, num_tokens)
        node_present_QT = present_QGT.any(dim=1)
        inter, intra = self._stages(node_present_QT, present_QGT, route.recv_rows, bound=num_tokens)
        # 4. Across nodes: each token once per destination node (uncompressed rows leave first),
        #    with its slots and gate weights there.
        send_QT = torch.nonzero_static(node_present_QT.reshape(-1), size=sum(inter.send)).squeeze(1)
        send_token_U, dest_node_U = send_QT % num_tokens, torch.div(send_QT, num_tokens, rounding_mode="floor")
        token_bags = bags_by_index(send_token_U, num_tokens)
        x_UD = gather_rows(x_TD, send_token_U, token_bags)
        x_VD = self._stage_rows(x_UD, inter, payload="dispatch") if self.dispatch_dtype == "none" else None
        node_experts = self.node_size * self.num_local_experts
        idx_UK = idx_TK.index_select(0, send_token_U)
        here_UK = keep_TK.index_select(0, send_token_U) & (
            torch.div(idx_UK, node_experts, rounding_mode="floor") == dest_node_U.unsqueeze(1))
        slot_UK = torch.where(here_UK, idx_UK - dest_node_U.unsqueeze(1) * node_experts + 1, 0)
        slot_VK = self._stage_ints(slot_UK, inter, bound=node_experts)
        w_VK = self._stage_weights(weights_TK.index_select(0, send_token_U) * here_UK, inter)
        # 5. Inside the node: each relayed row once to every rank holding one of its experts.
        relay_S, slot_SK, w_SK = self._forward_rows(slot_VK, w_VK, num_forward=sum(intra.send))
        slot_RK = self._stage_ints(slot_SK, intra, bound=self.num_local_experts)
        w_RK = self._stage_weights(w_SK, intra)
        relay_bags = bags_by_index(relay_S, slot_VK.shape[0])
        if x_VD is not None:
            x_RD = self._stage_rows(gather_rows(x_VD, relay_S, relay_bags), intra, payload="dispatch")
        else:
            x_RD = self._relay_compressed(x_UD, relay_S, inter, intra)

        def receive() -> DispatchResult:
            # 6. Fan each row out to its experts: copies grouped by local expert (stable: row order).
            slot_C = slot_RK.reshape(-1)
            expert_C = torch.where(slot_C > 0, slot_C - 1, self.num_local_experts)
            copy_M = torch.sort(expert_C, stable=True).indices[:sum(route.recv_splits)]
            row_M = torch.div(copy_M, top_k, rounding_mode="floor")
            row_bags = bags_by_index(row_M, slot_RK.shape[0])
            state = _HierarchicalState(send_token_U, token_bags, relay_S, relay_bags, row_M,
                                       w_RK.reshape(-1).index_select(0, copy_M), row_bags, inter, intra)
            return DispatchResult(
                x_MD=gather_rows(x_RD, row_M, row_bags), num_tokens_per_expert=route.num_recv_PL.sum(dim=0),
                num_routed_per_expert=route.num_routed_E, num_dropped=(route.num_routed_E - route.num_send_E).sum(),
                token_idx_M=torch.div(order_M, top_k, rounding_mode="floor"), state=state,
                num_token_rank_sends=self._token_rank_sends(idx_TK))

        return receive

    def combine(self, y_MD: torch.Tensor, state: _HierarchicalState) -> torch.Tensor:
        # 7. Each received row: the weighted sum of its experts' outputs on this rank.
        y_RD = weighted_scatter(y_MD, state.weights_M, state.row_M, state.row_bags.num_bags, state.row_bags)
        # 8. Back to the relay, which sums its node's partial outputs: one row per token and node.
        y_SD = self._stage_rows(y_RD, state.intra, reverse=True, payload="combine")
        y_VD = sum_rows(y_SD, state.relay_S, state.relay_bags)
        # 9. Back across, and the home rank sums its token's nodes.
        y_UD = self._stage_rows(y_VD, state.inter, reverse=True, payload="combine")
        return sum_rows(y_UD, state.send_token_U, state.token_bags)

    # ----- steps 3 and 5: splits and the relay's forwarding --------------------------------------

    def _stages(self, node_present_QT: torch.Tensor, present_QGT: torch.Tensor, recv_rows: list[int], *,
                bound: int) -> tuple[_Stage, _Stage]:
        """Splits of both stages. Each rank tells its rail peer on node q how many rows it sends
        there and how many of them go to each rank of q; the relay's forward counts are the sums of
        those. A rank receives, from the relay of local index h, the rows that the ranks of local
        index h send it once per rank (the routing step's ``recv_rows``)."""
        Q, G = self.num_nodes, self.node_size
        counts_QX = torch.cat([node_present_QT.sum(dim=1, keepdim=True), present_QGT.sum(dim=2)], dim=1)
        ones = [1] * Q
        peer_counts_QX = self._stage_ints(counts_QX, _Stage(self.inter_group, self.node_index, self._inter_nodes,
                                                               ones, ones), bound=bound)
        send_inter, recv_inter, forward_G = to_host(counts_QX[:, 0], peer_counts_QX[:, 0],
                                                    peer_counts_QX[:, 1:].sum(dim=0))
        recv_intra = [sum(recv_rows[q * G + h] for q in range(Q)) for h in range(G)]
        return (_Stage(self.inter_group, self.node_index, self._inter_nodes, send_inter, recv_inter),
                _Stage(self.intra_group, self.local_index, self._intra_nodes, forward_G, recv_intra))

    def _forward_rows(self, slot_VK: torch.Tensor, w_VK: torch.Tensor, *, num_forward: int):
        """For the V relayed rows (node-local slots): the row each forwarded row copies, grouped by
        destination local rank, and its slots and weights there (rank-local; 0 and 0 elsewhere)."""
        V, L, G = slot_VK.shape[0], self.num_local_experts, self.node_size
        rank_VK = torch.where(slot_VK > 0, torch.div(slot_VK - 1, L, rounding_mode="floor"), G)
        hit_VG = torch.zeros(V, G + 1, dtype=torch.bool, device=slot_VK.device).scatter_(1, rank_VK, True)[:, :G]
        forward_GV = torch.nonzero_static(hit_VG.t().reshape(-1), size=num_forward).squeeze(1)
        relay_S, dest_S = forward_GV % V, torch.div(forward_GV, V, rounding_mode="floor")
        local_SK = slot_VK.index_select(0, relay_S) - 1 - dest_S.unsqueeze(1) * L
        here_SK = (local_SK >= 0) & (local_SK < L)
        return relay_S, torch.where(here_SK, local_SK + 1, 0), w_VK.index_select(0, relay_S) * here_SK

    # ----- communication: counted here, inter-node bytes by the node of each peer ---------------------

    def _relay_compressed(self, x_UD: torch.Tensor, relay_S: torch.Tensor, inter: _Stage,
                          intra: _Stage) -> torch.Tensor:
        """Compressed token rows through both stages, the relay forwarding rows ``relay_S`` of what
        it got without decoding them."""
        wire_row = wire_row_bytes(x_UD.shape[1], self.dispatch_dtype)
        for stage in (inter, intra):
            self._count(stage, rows=(stage.send, stage.recv), row_bytes=wire_row, dim=x_UD.shape[1])
        return timed_exchange(lambda x: _RelayedRows.apply(x, self.dispatch_dtype, relay_S, inter, intra), x_UD,
                              self.timer, kind="dispatch")

    def _stage_rows(self, x_MD: torch.Tensor, stage: _Stage, *, payload: str,
                    reverse: bool = False) -> torch.Tensor:
        """Token rows over one stage (autograd), forward or back; a compressed combine in bf16."""
        send, recv = (stage.recv, stage.send) if reverse else (stage.send, stage.recv)
        compressed = self.dispatch_dtype != "none"
        assert payload == "combine" or not compressed, payload  # compressed dispatch rows: _RelayedRows
        dim = x_MD.shape[1]
        self._count(stage, rows=(send, recv), row_bytes=wire_row_bytes(dim, "bf16") if compressed else row_bytes(x_MD),
                    dim=dim if payload == "dispatch" else None, combine=payload == "combine")
        if compressed:
            return timed_exchange(lambda x: exchange_rows(x, wire="bf16", output_splits=recv, input_splits=send,
                                                          group=stage.group), x_MD, self.timer, kind=payload)
        return timed_exchange(lambda x: all_to_all_single_autograd(x.contiguous(), recv, send, stage.group), x_MD,
                              self.timer, kind=payload)

    def _stage_weights(self, w_MK: torch.Tensor, stage: _Stage) -> torch.Tensor:
        """Gate weights (fp32 both ways, like the router's scores; autograd) over one stage."""
        self._count(stage, rows=(stage.send, stage.recv), row_bytes=row_bytes(w_MK))
        def exchange(w_MK: torch.Tensor) -> torch.Tensor:
            return all_to_all_single_autograd(w_MK.contiguous(), stage.recv, stage.send, stage.group)

        return timed_exchange(exchange, w_MK, self.timer, kind="routing")

    def _stage_ints(self, x_MX: torch.Tensor, stage: _Stage, *, bound: int) -> torch.Tensor:
        """Integers in ``[0, bound]`` over one stage (no autograd): with a compressed
        dispatch_dtype in the smallest integer type holding them, as the flat exchange does."""
        wire_MX = ints_to_bytes(x_MX, bound) if self.compact_ints else x_MX.contiguous()
        self._count(stage, rows=(stage.send, stage.recv), row_bytes=row_bytes(wire_MX))
        out_RX = wire_MX.new_empty(sum(stage.recv), *wire_MX.shape[1:])
        with self.timer.span("routing"):
            dist.all_to_all_single(out_RX, wire_MX, output_split_sizes=stage.recv, input_split_sizes=stage.send,
                                   group=stage.group)
        return ints_from_bytes(out_RX, bound, x_MX.shape[1:]) if self.compact_ints else out_RX

    def _count(self, stage: _Stage, *, rows: tuple[list[int], list[int]], row_bytes: int,
               dim: int | None = None, combine: bool = False) -> None:
        self.stats.count_exchange(input_splits=rows[0], output_splits=rows[1], own=stage.own, row_bytes=row_bytes,
                                  dispatch_row_elements=dim, peer_nodes=stage.nodes, combine=combine)


# ----- compressed token rows through both stages ------------------------------------------------------


def _all_to_all(x_MX: torch.Tensor, stage: _Stage, *, reverse: bool = False) -> torch.Tensor:
    send, recv = (stage.recv, stage.send) if reverse else (stage.send, stage.recv)
    out_RX = x_MX.new_empty(sum(recv), *x_MX.shape[1:])
    dist.all_to_all_single(out_RX, x_MX.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=stage.group)
    return out_RX


class _RelayedRows(torch.autograd.Function):
    """Rows encoded once ("bf16" or "fp8_e4m3" with its block scales), across, forwarded by the
    relay as they arrived, inside the node, decoded. Backward: the gradients back through both
    stages in bf16 (straight-through the quantisation), the relay summing a row's forwarded
    gradients in the compute dtype."""

    @staticmethod
    def forward(ctx, x_UD, wire, relay_S, inter, intra):
        ctx.save_for_backward(relay_S)
        ctx.stages, ctx.dtype, ctx.num_relayed = (inter, intra), x_UD.dtype, sum(inter.recv)
        wire_UX = pack_e4m3(x_UD) if wire == "fp8_e4m3" else x_UD.to(torch.bfloat16).contiguous()
        wire_VX = _all_to_all(wire_UX, inter)
        wire_RX = _all_to_all(wire_VX.index_select(0, relay_S), intra)
        return unpack_e4m3(wire_RX, x_UD.shape[1], x_UD.dtype) if wire == "fp8_e4m3" else wire_RX.to(x_UD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        (relay_S,) = ctx.saved_tensors
        inter, intra = ctx.stages
        grad_SD = _all_to_all(grad_RD.to(torch.bfloat16), intra, reverse=True)
        grad_VD = grad_SD.new_zeros(ctx.num_relayed, grad_SD.shape[1], dtype=ctx.dtype)
        grad_VD.index_add_(0, relay_S, grad_SD.to(ctx.dtype))
        grad_UD = _all_to_all(grad_VD.to(torch.bfloat16), inter, reverse=True)
        return grad_UD.to(ctx.dtype), None, None, None, None


def hierarchical_dispatcher(dims: ParallelDims, moe: MoEConfig) -> HierarchicalDispatcher:
    """The dispatcher of a layout with ``dims.hierarchical_ep`` (after ``build_mesh``)."""
    assert dims.hierarchical_ep, "the caller checks ParallelDims.hierarchical_ep"
    return HierarchicalDispatcher(
        moe.num_experts, ep_group=dims.ep_group, inter_group=dims.ep_inter_group, intra_group=dims.ep_intra_group,
        ep_nodes=dims.ep_rank_nodes(), dp_group=dims.dp_group if dims.dp > 1 else None,
        dp_nodes=dims.dp_rank_nodes() if dims.dp > 1 else None, dispatch_dtype=moe.dispatch_dtype)
