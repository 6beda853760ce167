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

Routing and drops are the flat dispatcher's own (``AllToAllRouting.route``, once per rank), so
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
from moetrain.distributed.expert_parallel.index import to_host
from moetrain.distributed.expert_parallel.route import AllToAllRouting, Route
from moetrain.distributed.expert_parallel.wire import (
    TOKEN_BOUND,
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
class _Stages:
    """Both all-to-alls of a dispatch."""

    inter: _Stage
    """Across nodes, between the ranks of one local index (a rail)."""
    intra: _Stage
    """Inside the node, from the relay to the ranks holding the experts."""
    node_present_QT: torch.Tensor
    """(destination node, token) pairs of the kept copies."""


@dataclass
class _Outbound:
    """The rows that cross nodes, one per token and destination node (``dispatch_preprocess``)."""

    route: Route
    stages: _Stages
    send_token_U: torch.Tensor
    """Local token of each row sent across, in send order (by destination node, then token)."""
    token_bags: TokenBags
    """Rows sent across of each local token."""
    x_UD: torch.Tensor
    here_UK: torch.Tensor
    """Kept copies of each row whose expert lives on the row's destination node."""
    slot_UK: torch.Tensor
    """Node-local expert of each slot there, plus one (0: none)."""


@dataclass
class _Forwarded:
    """The relay's rows to forward inside the node (step 5)."""

    relay_S: torch.Tensor
    """Relayed row (of V) that each forwarded row copies, in send order (by local rank, then row)."""
    slot_SK: torch.Tensor
    """Rank-local expert of each slot there, plus one (0: none)."""
    w_SK: torch.Tensor


@dataclass
class _InFlight:
    """The rows and their slots and gate weights after both stages (``token_dispatch``)."""

    outbound: _Outbound
    relay_S: torch.Tensor
    relay_bags: TokenBags
    """Forwarded rows of each relayed row."""
    x_RD: torch.Tensor
    slot_RK: torch.Tensor
    w_RK: torch.Tensor


@dataclass
class HierarchicalState:
    """What ``HierarchicalDispatcher.combine`` needs."""

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


class HierarchicalDispatcher(AllToAllRouting):
    """The two-stage exchange (module docstring) behind the ``Dispatcher`` interface, in the
    phases of ``AllToAllDispatcher`` with one more, ``plan_stages``: only ``route``,
    ``plan_stages``, ``token_dispatch`` and ``token_combine`` communicate.

    ``inter_group``: this rank's peers with the same local index on the ep group's other nodes
    (``ParallelDims.group("ep_inter")``); ``intra_group``: its ep group's ranks on its node
    (``ParallelDims.group("ep_intra")``); ``ep_nodes``/``dp_nodes``: the node of each ep / dp rank,
    which sorts the byte counters into inter- and intra-node. Drops, capacity and ``dp_group`` as
    ``AllToAllDispatcher``.
    """

    def __init__(self, num_experts: int, *, ep_group: dist.ProcessGroup, inter_group: dist.ProcessGroup,
                 intra_group: dist.ProcessGroup, ep_nodes: Sequence[int], dp_group: dist.ProcessGroup | None = None,
                 dp_nodes: Sequence[int] | None = None, dispatch_dtype: str = "none") -> None:
        # dedup: the routing step then finds each token's (destination rank) pairs, which both
        # stages are made of. The routing exchanges count their inter-node bytes by the nodes.
        super().__init__(num_experts, ep_group=ep_group, dp_group=dp_group, dedup=True,
                         dispatch_dtype=dispatch_dtype, ep_nodes=list(ep_nodes),
                         dp_nodes=None if dp_nodes is None else list(dp_nodes))
        self.inter_group, self.intra_group = inter_group, intra_group
        self.num_nodes, self.node_size = dist.get_world_size(inter_group), dist.get_world_size(intra_group)
        self.node_index, self.local_index = dist.get_rank(inter_group), dist.get_rank(intra_group)
        # ParallelDims builds these groups from the rank order; here it is the invariant.
        assert self.num_nodes * self.node_size == self.ep_size, (self.num_nodes, self.node_size, self.ep_size)
        assert self.ep_rank == self.node_index * self.node_size + self.local_index, self.ep_rank
        G, g = self.node_size, self.local_index
        self._inter_nodes = [ep_nodes[q * G + g] for q in range(self.num_nodes)]
        self._intra_nodes = [ep_nodes[self.node_index * G + h] for h in range(G)]
        assert len(set(self._inter_nodes)) == self.num_nodes and len(set(self._intra_nodes)) == 1, ep_nodes

    # ----- the Dispatcher interface ----------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity_factor: float | Fraction | None = None,
                 drop_policy: str = "position") -> DispatchResult[HierarchicalState]:
        """As ``AllToAllDispatcher.dispatch`` (the same copies kept and grouped by local expert),
        through the two stages."""
        # 1.-2. Count, exchange counts (or decide the global drops), one host sync.
        route = self.route(x_TD, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
        # 3. Both stages' splits; 4.-5. the rows through them; 6. fanned out to the experts.
        outbound = self.dispatch_preprocess(x_TD, idx_TK, route, self.plan_stages(route))
        return self.dispatch_postprocess(self.token_dispatch(outbound, weights_TK))

    def combine(self, y_MD: torch.Tensor, state: HierarchicalState) -> torch.Tensor:
        """7. Each row's weighted sum on this rank; 8.-9. back through both stages, summed."""
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(y_MD, state), state), state)

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn, *,
                    capacity_factor: float | Fraction | None = None, drop_policy: str = "position",
                    in_flight: Callable[[], torch.Tensor] | None = None) -> RoutedOutput:
        """Dispatch, ``experts``, combine; ``in_flight()`` runs while the rows travel inside the
        node (with ``dispatch_dtype`` "none", whose exchanges are waited for when read)."""
        route = self.route(x_TD, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
        outbound = self.dispatch_preprocess(x_TD, idx_TK, route, self.plan_stages(route))
        flight = self.token_dispatch(outbound, weights_TK)
        overlapped = in_flight() if in_flight is not None else None
        d = self.dispatch_postprocess(flight)
        out_TD = self.combine(experts(d.x_MD, d.num_tokens_per_expert), d.state)
        return RoutedOutput(out_TD=out_TD, overlapped=overlapped, num_routed_per_expert=d.num_routed_per_expert,
                            num_dropped=d.num_dropped, token_idx_M=d.token_idx_M,
                            num_token_rank_sends=d.num_token_rank_sends)

    # ----- steps 3-6: the way there --------------------------------------------------------------

    def dispatch_preprocess(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, route: Route,
                            stages: _Stages) -> _Outbound:
        """3. The rows of each destination node, and the node-local slots of the copies kept there.
        No communication here."""
        num_tokens, top_k = idx_TK.shape
        keep_TK = torch.zeros(num_tokens * top_k, dtype=torch.bool, device=idx_TK.device)
        keep_TK = keep_TK.index_fill_(0, route.order_M, True).view(num_tokens, top_k)
        send_QT = torch.nonzero_static(stages.node_present_QT.reshape(-1), size=sum(stages.inter.send)).squeeze(1)
        send_token_U, dest_node_U = send_QT % num_tokens, torch.div(send_QT, num_tokens, rounding_mode="floor")
        token_bags = bags_by_index(send_token_U, num_tokens)
        x_UD = gather_rows(x_TD, send_token_U, token_bags)
        node_experts = self.node_size * self.num_local_experts
        idx_UK = idx_TK.index_select(0, send_token_U)
        here_UK = keep_TK.index_select(0, send_token_U) & (
            torch.div(idx_UK, node_experts, rounding_mode="floor") == dest_node_U.unsqueeze(1))
        slot_UK = torch.where(here_UK, idx_UK - dest_node_U.unsqueeze(1) * node_experts + 1, 0)
        return _Outbound(route, stages, send_token_U, token_bags, x_UD, here_UK, slot_UK)

    def token_dispatch(self, outbound: _Outbound, weights_TK: torch.Tensor) -> _InFlight:
        """4. Across nodes: each token once per destination node (uncompressed rows leave first),
        with its slots and gate weights there; 5. inside the node: each relayed row once to every
        rank holding one of its experts."""
        inter, intra = outbound.stages.inter, outbound.stages.intra
        x_VD = self._stage_rows(outbound.x_UD, inter, payload="dispatch") if self.dispatch_dtype == "none" else None
        slot_VK = self._stage_ints(outbound.slot_UK, inter, bound=self.node_size * self.num_local_experts)
        w_VK = self._stage_weights(weights_TK.index_select(0, outbound.send_token_U) * outbound.here_UK, inter)
        forwarded = self._forward_rows(slot_VK, w_VK, num_forward=sum(intra.send))
        slot_RK = self._stage_ints(forwarded.slot_SK, intra, bound=self.num_local_experts)
        w_RK = self._stage_weights(forwarded.w_SK, intra)
        relay_bags = bags_by_index(forwarded.relay_S, slot_VK.shape[0])
        if x_VD is not None:
            x_RD = self._stage_rows(gather_rows(x_VD, forwarded.relay_S, relay_bags), intra, payload="dispatch")
        else:
            x_RD = self._relay_compressed(outbound.x_UD, forwarded.relay_S, inter, intra)
        return _InFlight(outbound, forwarded.relay_S, relay_bags, x_RD, slot_RK, w_RK)

    def dispatch_postprocess(self, flight: _InFlight) -> DispatchResult[HierarchicalState]:
        """6. Fan each row out to its experts: copies grouped by local expert (stable: row order).
        No communication here."""
        route, outbound, top_k = flight.outbound.route, flight.outbound, flight.slot_RK.shape[1]
        slot_C = flight.slot_RK.reshape(-1)
        expert_C = torch.where(slot_C > 0, slot_C - 1, self.num_local_experts)
        copy_M = torch.sort(expert_C, stable=True).indices[:sum(route.recv_splits)]
        row_M = torch.div(copy_M, top_k, rounding_mode="floor")
        row_bags = bags_by_index(row_M, flight.slot_RK.shape[0])
        state = HierarchicalState(outbound.send_token_U, outbound.token_bags, flight.relay_S, flight.relay_bags, row_M,
                                  flight.w_RK.reshape(-1).index_select(0, copy_M), row_bags, outbound.stages.inter,
                                  outbound.stages.intra)
        return DispatchResult(
            x_MD=gather_rows(flight.x_RD, row_M, row_bags), num_tokens_per_expert=route.num_recv_PL.sum(dim=0),
            num_routed_per_expert=route.num_routed_E, num_dropped=route.num_dropped,
            token_idx_M=torch.div(route.order_M, top_k, rounding_mode="floor"), state=state,
            num_token_rank_sends=route.num_token_rank_sends)

    # ----- steps 7-9: the way home ---------------------------------------------------------------

    def combine_preprocess(self, y_MD: torch.Tensor, state: HierarchicalState) -> torch.Tensor:
        """7. Each received row: the weighted sum of its experts' outputs on this rank. No
        communication here."""
        return weighted_scatter(y_MD, state.weights_M, state.row_M, state.row_bags.num_bags, state.row_bags)

    def token_combine(self, y_RD: torch.Tensor, state: HierarchicalState) -> torch.Tensor:
        """8. Back to the relay, which sums its node's partial outputs: one row per token and node;
        9. back across."""
        y_SD = self._stage_rows(y_RD, state.intra, reverse=True, payload="combine")
        y_VD = sum_rows(y_SD, state.relay_S, state.relay_bags)
        return self._stage_rows(y_VD, state.inter, reverse=True, payload="combine")

    def combine_postprocess(self, y_UD: torch.Tensor, state: HierarchicalState) -> torch.Tensor:
        """The home rank sums its token's nodes. No communication here."""
        return sum_rows(y_UD, state.send_token_U, state.token_bags)

    # ----- steps 3 and 5: splits and the relay's forwarding --------------------------------------

    def plan_stages(self, route: Route) -> _Stages:
        """3. The splits of both stages; communicates (one host sync). Each rank tells its rail peer
        on node q how many rows it sends there and how many of them go to each rank of q; the
        relay's forward counts are the sums of those. A rank receives, from the relay of local
        index h, the rows that the ranks of local index h send it once per rank (the routing step's
        ``recv_rows``)."""
        assert route.unique is not None, "the hierarchical route is once per rank"
        Q, G, recv_rows = self.num_nodes, self.node_size, route.unique.recv_rows
        present_QGT = route.unique.present_PT.view(Q, G, route.num_tokens)
        node_present_QT = present_QGT.any(dim=1)
        counts_QX = torch.cat([node_present_QT.sum(dim=1, keepdim=True), present_QGT.sum(dim=2)], dim=1)
        ones = [1] * Q
        peer_counts_QX = self._stage_ints(counts_QX, _Stage(self.inter_group, self.node_index, self._inter_nodes,
                                                               ones, ones), bound=TOKEN_BOUND)
        host = to_host(send_inter=counts_QX[:, 0], recv_inter=peer_counts_QX[:, 0],
                       forward_G=peer_counts_QX[:, 1:].sum(dim=0))
        recv_intra = [sum(recv_rows[q * G + h] for q in range(Q)) for h in range(G)]
        return _Stages(_Stage(self.inter_group, self.node_index, self._inter_nodes, host["send_inter"],
                              host["recv_inter"]),
                       _Stage(self.intra_group, self.local_index, self._intra_nodes, host["forward_G"], recv_intra),
                       node_present_QT)

    def _forward_rows(self, slot_VK: torch.Tensor, w_VK: torch.Tensor, *, num_forward: int) -> _Forwarded:
        """For the V relayed rows (node-local slots): the row each forwarded row copies, grouped by
        destination local rank, and its slots and weights there (rank-local; 0 and 0 elsewhere).
        No communication here."""
        V, L, G = slot_VK.shape[0], self.num_local_experts, self.node_size
        rank_VK = torch.where(slot_VK > 0, torch.div(slot_VK - 1, L, rounding_mode="floor"), G)
        hit_VG = torch.zeros(V, G + 1, dtype=torch.bool, device=slot_VK.device).scatter_(1, rank_VK, True)[:, :G]
        forward_GV = torch.nonzero_static(hit_VG.t().reshape(-1), size=num_forward).squeeze(1)
        relay_S, dest_S = forward_GV % V, torch.div(forward_GV, V, rounding_mode="floor")
        local_SK = slot_VK.index_select(0, relay_S) - 1 - dest_S.unsqueeze(1) * L
        here_SK = (local_SK >= 0) & (local_SK < L)
        return _Forwarded(relay_S, torch.where(here_SK, local_SK + 1, 0), w_VK.index_select(0, relay_S) * here_SK)

    # ----- communication: counted here, inter-node bytes by the node of each peer ---------------------

    def _relay_compressed(self, x_UD: torch.Tensor, relay_S: torch.Tensor, inter: _Stage,
                          intra: _Stage) -> torch.Tensor:
        """Compressed token rows through both stages, the relay forwarding rows ``relay_S`` of what
        it got without decoding them."""
        wire_row = wire_row_bytes(x_UD.shape[1], self.dispatch_dtype)
        for stage in (inter, intra):
            self._count_stage(stage, send=stage.send, recv=stage.recv, row_bytes=wire_row, dim=x_UD.shape[1])
        return timed_exchange(lambda x: _RelayedRows.apply(x, self.dispatch_dtype, relay_S, inter, intra), x_UD,
                              self.timer, kind="dispatch")

    def _stage_rows(self, x_MD: torch.Tensor, stage: _Stage, *, payload: str,
                    reverse: bool = False) -> torch.Tensor:
        """Token rows over one stage (autograd), forward or back; a compressed combine in bf16."""
        send, recv = (stage.recv, stage.send) if reverse else (stage.send, stage.recv)
        compressed = self.dispatch_dtype != "none"
        assert payload == "combine" or not compressed, payload  # compressed dispatch rows: _RelayedRows
        dim = x_MD.shape[1]
        self._count_stage(stage, send=send, recv=recv,
                          row_bytes=wire_row_bytes(dim, "bf16") if compressed else row_bytes(x_MD),
                          dim=dim if payload == "dispatch" else None, combine=payload == "combine")
        if compressed:
            return timed_exchange(lambda x: exchange_rows(x, wire="bf16", output_splits=recv, input_splits=send,
                                                          group=stage.group), x_MD, self.timer, kind=payload)
        return timed_exchange(lambda x: all_to_all_single_autograd(x.contiguous(), recv, send, stage.group), x_MD,
                              self.timer, kind=payload)

    def _stage_weights(self, w_MK: torch.Tensor, stage: _Stage) -> torch.Tensor:
        """Gate weights (fp32 both ways, like the router's scores; autograd) over one stage."""
        self._count_stage(stage, send=stage.send, recv=stage.recv, row_bytes=row_bytes(w_MK))

        def exchange(w_MK: torch.Tensor) -> torch.Tensor:
            return all_to_all_single_autograd(w_MK.contiguous(), stage.recv, stage.send, stage.group)

        return timed_exchange(exchange, w_MK, self.timer, kind="routing")

    def _stage_ints(self, x_MX: torch.Tensor, stage: _Stage, *, bound: int) -> torch.Tensor:
        """Integers in ``[0, bound]`` over one stage (no autograd): with a compressed
        dispatch_dtype in the smallest integer type holding them, as the flat exchange does."""
        wire_MX = ints_to_bytes(x_MX, bound) if self.compact_ints else x_MX.contiguous()
        self._count_stage(stage, send=stage.send, recv=stage.recv, row_bytes=row_bytes(wire_MX))
        out_RX = wire_MX.new_empty(sum(stage.recv), *wire_MX.shape[1:])
        with self.timer.span("routing"):
            dist.all_to_all_single(out_RX, wire_MX, output_split_sizes=stage.recv, input_split_sizes=stage.send,
                                   group=stage.group)
        return ints_from_bytes(out_RX, bound, x_MX.shape[1:]) if self.compact_ints else out_RX

    def _count_stage(self, stage: _Stage, *, send: list[int], recv: list[int], row_bytes: int,
                     dim: int | None = None, combine: bool = False) -> None:
        self.stats.count_exchange(input_splits=send, output_splits=recv, own=stage.own, row_bytes=row_bytes,
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
        ctx.inter, ctx.intra, ctx.dtype, ctx.num_relayed = inter, intra, x_UD.dtype, sum(inter.recv)
        wire_UX = pack_e4m3(x_UD) if wire == "fp8_e4m3" else x_UD.to(torch.bfloat16).contiguous()
        wire_VX = _all_to_all(wire_UX, inter)
        wire_RX = _all_to_all(wire_VX.index_select(0, relay_S), intra)
        return unpack_e4m3(wire_RX, x_UD.shape[1], x_UD.dtype) if wire == "fp8_e4m3" else wire_RX.to(x_UD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        (relay_S,) = ctx.saved_tensors
        inter, intra = ctx.inter, ctx.intra
        grad_SD = _all_to_all(grad_RD.to(torch.bfloat16), intra, reverse=True)
        grad_VD = grad_SD.new_zeros(ctx.num_relayed, grad_SD.shape[1], dtype=ctx.dtype)
        grad_VD.index_add_(0, relay_S, grad_SD.to(ctx.dtype))
        grad_UD = _all_to_all(grad_VD.to(torch.bfloat16), inter, reverse=True)
        return grad_UD.to(ctx.dtype), None, None, None, None


def hierarchical_dispatcher(dims: ParallelDims, moe: MoEConfig) -> HierarchicalDispatcher:
    """The dispatcher of a layout with ``dims.hierarchical_ep`` (after ``build_mesh``)."""
    assert dims.hierarchical_ep, "the caller checks ParallelDims.hierarchical_ep"
    return HierarchicalDispatcher(
        moe.num_experts, ep_group=dims.group("ep"), inter_group=dims.group("ep_inter"),
        intra_group=dims.group("ep_intra"),
        ep_nodes=dims.ep_rank_nodes(), dp_group=dims.group("dp") if dims.dp > 1 else None,
        dp_nodes=dims.dp_rank_nodes() if dims.dp > 1 else None, dispatch_dtype=moe.dispatch_dtype)
