"""Workers and hand counts of the hierarchical all-to-all tests (test_hierarchical.py, and the two
torchrun agents of torchrun_nodes.py).

``layer_worker`` runs one MoE layer at ep = world, once through the flat exchange and once through
the hierarchical one, on the same input and weights, and returns what the experts received, the
outputs, every gradient and the byte counters. ``training_worker`` trains ep_parity's model with
the hierarchical exchange. ``inter_node_rows`` counts, from the routing alone, the token rows
that must cross nodes.

Shape legend: T tokens per rank, D model dim, K experts per token, E experts, W ranks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moetrain.config.moe import MoEConfig
from moetrain.distributed import ParallelDims, apply_expert_parallel, parallelize
from moetrain.distributed.expert_parallel.dispatcher import AllToAllDispatcher
from moetrain.distributed.expert_parallel.hierarchical import HierarchicalDispatcher, hierarchical_dispatcher
from moetrain.distributed.expert_parallel.wire import wire_row_bytes
from moetrain.models.moe import MoELayer
from tests.distributed.workers.ep_parity import (
    _micro_slices,
    _train,
    assert_rel_close,
    build_model,
    make_data,
)

NUM_EXPERTS = 8
ROUNDING = 2.0**-9
"""Relative error of one bf16 rounding."""


def node_dims(world_size: int, *, ranks_per_node: int | None) -> ParallelDims:
    """ep = world over nodes of ``ranks_per_node`` (None: the launcher's), hierarchical."""
    dims = ParallelDims(world_size=world_size, ep=world_size, num_experts=NUM_EXPERTS, ranks_per_node=ranks_per_node,
                        ep_hierarchical=True)
    dims.build_mesh("cpu")
    return dims


def flat_dispatcher(dims: ParallelDims, moe: MoEConfig) -> AllToAllDispatcher:
    """The flat exchange of this layout (what build_dispatcher builds without ep_hierarchical),
    told the node of each peer."""
    flat = AllToAllDispatcher(moe.num_experts, ep_group=dims.group("ep"), dp_group=dims.group("dp"),
                              dedup=moe.dispatch_dedup, dispatch_dtype=moe.dispatch_dtype)
    flat.ep_nodes, flat.dp_nodes = dims.ep_rank_nodes(), dims.dp_rank_nodes()
    return flat


def _one_layer(dims, moe: MoEConfig, kind: str, x_TD: torch.Tensor, grad_TD: torch.Tensor, dim: int) -> dict:
    torch.manual_seed(0)  # the same global weights for both kinds (experts sharded after)
    layer = apply_expert_parallel(torch.nn.Sequential(MoELayer(dim, moe)), dims)[0]
    layer.dispatcher = flat_dispatcher(dims, moe) if kind == "flat" else hierarchical_dispatcher(dims, moe)
    x_TD = x_TD.clone().requires_grad_()
    routing = layer.router(x_TD)
    d = layer.dispatcher.dispatch(x_TD, routing.idx_TK, routing.weights_TK, capacity_factor=moe.capacity_factor,
                                  drop_policy=moe.drop_policy)
    inputs = [rows.detach().clone() for rows in d.x_MD.split(d.num_tokens_per_expert.tolist())]
    out_TD = layer.dispatcher.combine(layer.experts(d.x_MD, d.num_tokens_per_expert), d.state)
    (out_TD * grad_TD).sum().backward()
    grads = {"x": x_TD.grad.clone()}
    for name, p in layer.named_parameters():
        if p.grad is not None:
            g = p.grad
            grads[name] = (g.to_local() if hasattr(g, "to_local") else g).clone()
    return {"inputs": inputs, "out": out_TD.detach().clone(), "grads": grads, "dropped": int(d.num_dropped),
            "idx_TK": routing.idx_TK.clone(), "stats": layer.dispatcher.read_comm_stats(),
            "hierarchical": isinstance(layer.dispatcher, HierarchicalDispatcher)}


def layer_worker(rank: int, world_size: int, settings: dict[str, dict], *, dim: int, tokens: int,
                 ranks_per_node: int | None = None) -> dict:
    """Per setting (name -> MoEConfig overrides, E=8): the flat and the hierarchical exchange
    of one layer on this rank's fixed input, and the layout seen."""
    dims = node_dims(world_size, ranks_per_node=ranks_per_node)
    out = {"layout": {"nodes": dims.num_nodes, "node": dims.node_of(rank), "ep_rank_nodes": dims.ep_rank_nodes(),
                      "inter": dist.get_process_group_ranks(dims.group("ep_inter")),
                      "intra": dist.get_process_group_ranks(dims.group("ep_intra")),
                      "group_rank": os.environ.get("GROUP_RANK")}}
    g = torch.Generator().manual_seed(100 + rank)
    x_TD, grad_TD = torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g)
    for name, overrides in settings.items():
        moe = MoEConfig(num_experts=NUM_EXPERTS, expert_hidden_dim=32, **overrides)
        out[name] = {kind: _one_layer(dims, moe, kind, x_TD, grad_TD, dim) for kind in ("flat", "hierarchical")}
    return out


def training_worker(rank: int, world_size: int, cases, *, ranks_per_node: int) -> dict:
    """ep_parity's training loop at ep = world, every MoE layer on the hierarchical exchange."""
    dims = node_dims(world_size, ranks_per_node=ranks_per_node)
    results = {}
    for case in cases:
        model = build_model(case)
        train_model = parallelize(model, dims, activation_checkpointing=case.activation_checkpointing)
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.dispatcher = hierarchical_dispatcher(dims, layer.config)
        x, target = make_data(case, world_size)
        results[case.name] = _train(model, train_model, case, x, target, _micro_slices(case, rank, world_size), dims)
    return results


# ----- counts from the routing alone ------------------------------------------------------------------


def inter_node_rows(idx_by_rank: list[torch.Tensor], rank: int, *, ranks_per_node: int, per_copy: bool) -> int:
    """Token rows of the forward dispatch that ``rank`` sends to or receives from other nodes
    (dropless, ep = world, E=8): per copy, every copy whose expert lives on another node; else
    each distinct (token, destination node != its own) pair once."""
    world = len(idx_by_rank)
    experts_per_rank = NUM_EXPERTS // world
    node_of_rank = [r // ranks_per_node for r in range(world)]

    def rows(src: int, dst: int) -> int:
        """Rows from rank src to rank dst crossing nodes (0 on one node)."""
        if node_of_rank[src] == node_of_rank[dst]:
            return 0
        dest_TK = torch.div(idx_by_rank[src], experts_per_rank, rounding_mode="floor")
        if per_copy:
            return int((dest_TK == dst).sum())
        # Hierarchical: to the rank of dst's node with src's local index, once per token.
        if dst % ranks_per_node != src % ranks_per_node:
            return 0
        return int((torch.div(dest_TK, ranks_per_node, rounding_mode="floor") == node_of_rank[dst]).any(dim=1).sum())

    return sum(rows(rank, p) + rows(p, rank) for p in range(world))


# ----- checks on the results of layer_worker (every rank's) -----------------------------------------------


def _rows(t: torch.Tensor) -> list:
    return sorted(map(tuple, t.tolist()))


def assert_layer_parity(results: list[dict], name: str, setting: dict) -> None:
    """The hierarchical exchange against the flat one: the same rows reach each expert (bit for
    bit, order aside), the same copies drop, outputs and every gradient agree (summation order
    only, or a few bf16 roundings of the partial sums with a compressed dispatch_dtype)."""
    tol = 1e-5 if setting["dispatch_dtype"] == "none" else 4 * ROUNDING
    for rank, res in enumerate(results):
        flat, hier = res[name]["flat"], res[name]["hierarchical"]
        assert hier["hierarchical"] and not flat["hierarchical"]
        assert [len(r) for r in hier["inputs"]] == [len(r) for r in flat["inputs"]], (name, rank)
        for e, (a, b) in enumerate(zip(hier["inputs"], flat["inputs"], strict=True)):
            assert _rows(a) == _rows(b), (name, rank, e)
        assert hier["dropped"] == flat["dropped"]
        assert_rel_close(hier["out"], flat["out"], f"{name} output rank {rank}", rtol=tol)
        assert set(hier["grads"]) == set(flat["grads"]) >= {"x", "router.gate.weight", "experts.w1"}
        for p, g in flat["grads"].items():
            assert_rel_close(hier["grads"][p], g, f"{name} grad {p} rank {rank}", rtol=tol)
    if "capacity_factor" in setting:
        assert sum(r[name]["flat"]["dropped"] for r in results) > 0, name  # capacity really dropped


def assert_inter_node_bytes(results: list[dict], name: str, setting: dict, *, dim: int, ranks_per_node: int) -> None:
    """Both exchanges count what crosses nodes; dropless, exactly the rows counted from the
    routing by hand (per copy flat, per distinct (token, other node) pair hierarchical); the
    hierarchical exchange crosses less, its metadata included."""
    wire = setting["dispatch_dtype"]
    row = 4 * dim if wire == "none" else wire_row_bytes(dim, wire)
    idx_by_rank = [r[name]["flat"]["idx_TK"] for r in results]
    flat_total = hier_total = 0
    for rank, res in enumerate(results):
        flat, hier = res[name]["flat"]["stats"], res[name]["hierarchical"]["stats"]
        if "capacity_factor" not in setting:
            for stats, per_copy in ((flat, True), (hier, False)):
                rows = inter_node_rows(idx_by_rank, rank, ranks_per_node=ranks_per_node, per_copy=per_copy)
                assert rows > 0 and stats.inter_node_dispatch_bytes == rows * row, (name, rank, per_copy)
        assert hier.inter_node_dispatch_bytes <= flat.inter_node_dispatch_bytes, (name, rank)
        # The relay's hop stays inside the node.
        assert 0 < hier.inter_node_bytes < hier.bytes_sent + hier.bytes_received, (name, rank)
        assert hier.as_metrics()["a2a_intra_node_bytes"] == hier.intra_node_bytes > 0
        flat_total, hier_total = flat_total + flat.inter_node_bytes, hier_total + hier.inter_node_bytes
    assert hier_total < flat_total, (name, hier_total, flat_total)
