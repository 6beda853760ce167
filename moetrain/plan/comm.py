"""Bytes each rank sends per optimizer step, by collective.

Counted as a ring (bandwidth-optimal) implementation moves them, for a group of G ranks and a
buffer of S bytes (S = the full, unsharded size):

    all-reduce      2 * S * (G - 1) / G
    reduce-scatter      S * (G - 1) / G
    all-gather          S * (G - 1) / G
    all-to-all      the rows this rank sends to the other G - 1 ranks

Per ZeRO stage (Phi = parameters a rank's group reduces; dense ones over dp, experts' E/ep
shard over edp; gradients reduced in fp32; parameters gathered in the compute dtype, routers in fp32):

    stage 0   all-reduce of the gradients, once per step (no_sync on the other micro-steps)
    stage 1   stage 0 + all-gather of the updated fp32 parameters after the step
    stage 2   all-gather of the parameters in every micro-step's forward (kept for backward),
              reduce-scatter of the gradients once per step
    stage 3   all-gather in forward and again in backward for the blocks (the root stays
              gathered), reduce-scatter once per step
    HSDP      the reduce-scatter inside a shard group, then an all-reduce of the shard across
              the replicas

All-to-all (the textbook per-layer volume, dispatch + combine of every routed copy, made per rank):
each MoE layer sends its T*K routed copies (times min(1, capacity factor); expert choice
E * ceil(capacity factor * T*K / E) for any factor, ``routed_copies``) of D values, of which
(ep-1)/ep go to other ranks under balanced routing, in dispatch and again in combine:
2 * T*K*D*bytes * (ep-1)/ep per layer and forward.
With ``moe.dispatch_dedup`` a token's row goes once to each rank its copies' experts live on,
``ranks_per_token`` rows per token (``expected_groups_hit(E, K, ep)`` under uniform routing; E=8,
K=2, ep=2: 0.79x the per-copy rows), and each remote copy adds its fp32 gate weight (and the
weight's gradient in backward) and its row's index (int64; int32 with a compressed
``dispatch_dtype``) in forward.
Backward repeats both exchanges, and a checkpointed MoE layer's recompute repeats the forward.
The multi-token modules' blocks are MoE blocks in an MoE model (``moetrain.models.mtp``): depth k
routes the S - k positions of each sequence that have a token k places ahead (under tensor
parallelism too, whose padded last k positions its token mask leaves unrouted), so T * (S - k) / S
tokens, recomputed only by "moe" checkpointing (which wraps every MoE layer; "full" and
"every_n" wrap the trunk's blocks), again at those tokens (``recomputed_tokens``).
With ``moe.dispatch_dtype`` "bf16" every one of them moves 2 bytes per value; with "fp8_e4m3" the
forward dispatch moves D + 4 * ceil(D / 128) bytes per row (e4m3 values and fp32 block scales),
the combine and both backward exchanges 2 * D (bf16).
The routing-count exchanges (E integers per layer) are too small to list.

Expert tensor parallelism (``Layout.etp``, stages 0/1): the expert gradients are 1/(ep * etp) of the
experts, reduced over edp = world / (ep * etp); each rank dispatches its etp group's gathered
tokens (etp times the all-to-all rows); the gathers and reduce-scatters around the experts
(``etp_bytes_per_micro_batch``, derived in ``moetrain.plan.expert_tensor_parallel``) add to the
all-gather and reduce-scatter columns.

Inter-node all-to-all bytes, when ep groups are whole nodes (Q = ep / procs per node of them):
flat, the copies bound for another node, K * (Q - 1) / Q rows per token and layer; hierarchical
(``parallel.ep_hierarchical``), one row per token and other node its experts live on. Under
uniform routing (a token's K distinct experts uniform over E; node q holds E / Q of them) a
token misses a given node with probability C(E - E/Q, K) / C(E, K), so it meets
``expected_groups_hit(E, K, Q)`` nodes, (Q - 1) / Q of that count other than its own. The
hierarchical exchange then forwards inside each node once per rank: ``expected_groups_hit(E, K,
ep) * (ep - Q) / ep`` rows per token (the ranks other than the relay), so its all-to-all volume is
those two together. Example, E=8, ep=4 on 2 nodes: K=2 crosses 1.0 (flat) vs 0.79 rows per token,
K=4 2.0 vs 0.99. An ep group that straddles nodes unevenly counts all its bytes as inter-node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.distributed.data_parallel.compression import chunk_len
from moetrain.distributed.data_parallel.fsdp import expert_shard_dim
from moetrain.distributed.expert_parallel.wire import TOKEN_BOUND, int_wire_dtype, wire_row_bytes
from moetrain.models.moe.dispatcher import expert_capacity
from moetrain.plan.model_states import Layout, ParamSpec, _chunk

COLLECTIVES = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather")


@dataclass
class CommVolume:
    all_to_all: int = 0
    all_reduce: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0
    inter_node: int = 0
    """Of the total, the bytes that cross nodes (the slow link): collectives whose group spans
    nodes, and of the all-to-all the rows bound for other nodes."""
    all_to_all_inter_node_flat: int = 0
    """Inter-node bytes of the all-to-all with the flat exchange (0 when ep groups stay in a node)."""
    all_to_all_inter_node_hierarchical: int = 0
    """The same with parallel.ep_hierarchical, for comparison whichever the config chose."""

    @property
    def total(self) -> int:
        return self.all_to_all + self.all_reduce + self.reduce_scatter + self.all_gather

    def as_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in COLLECTIVES} | {
            "total": self.total, "inter_node": self.inter_node,
            "all_to_all_inter_node_flat": self.all_to_all_inter_node_flat,
            "all_to_all_inter_node_hierarchical": self.all_to_all_inter_node_hierarchical}


def _ring(size_bytes: float, group: int) -> float:
    return size_bytes * (group - 1) / group if group > 1 else 0.0


def num_moe_layers(model: ModelConfig) -> int:
    """MoE layers of one forward: the trunk's, and one per multi-token depth in an MoE model."""
    return len(model.moe_layer_ids) + (model.mtp_depth if model.is_moe else 0)


def routed_tokens(model: ModelConfig, tokens: int, seq_len: int | None) -> int:
    """Tokens routed by the MoE layers of one forward of ``tokens`` tokens, summed over the layers:
    ``tokens`` in each of the trunk's, ``tokens * (S - k) / S`` at multi-token depth k (see the
    module docstring). ``seq_len`` None counts every depth at ``tokens`` (k / S over)."""
    if not model.is_moe:
        return 0
    S = seq_len
    depths = sum(tokens if S is None else tokens * (S - k) // S for k in range(1, model.mtp_depth + 1))
    return tokens * len(model.moe_layer_ids) + depths


def recomputed_tokens(model: ModelConfig, tokens: int, seq_len: int | None, num_recomputed: int) -> int:
    """Tokens routed by ``num_recomputed`` recomputed MoE layers: the trunk's first, at ``tokens``
    each, then (under "moe" checkpointing, which wraps every MoE layer) the multi-token depths' at
    their S - k positions, as ``routed_tokens``."""
    trunk = min(num_recomputed, len(model.moe_layer_ids))
    S = seq_len
    depths = sum(tokens if S is None else tokens * (S - k) // S for k in range(1, num_recomputed - trunk + 1))
    return tokens * trunk + depths


def routed_copies(moe: MoEConfig, tokens: int) -> float:
    """Copies one MoE layer sends to its experts for ``tokens`` tokens: token choice T * K, times
    min(1, capacity factor) (an expert keeps ceil(f * T * K / E), which balanced routing fills up
    to T * K); expert choice E * ceil(f * T * K / E) for any factor (every expert takes its
    capacity, at most the T candidates)."""
    f = moe.capacity_factor
    if moe.is_expert_choice:
        assert f is not None, "MoEConfig requires a capacity factor with expert choice"
        return moe.num_experts * min(tokens, expert_capacity(tokens, num_experts=moe.num_experts, top_k=moe.top_k,
                                                             capacity_factor=f))
    return tokens * moe.top_k * (1.0 if f is None else min(1.0, f))


def ranks_per_token(moe: MoEConfig, ep: int, tokens: int) -> float:
    """Rows a token sends under ``moe.dispatch_dedup``: the distinct ep ranks among its kept copies'
    experts. Token choice under uniform routing ``expected_groups_hit(E, K, ep)`` (times min(1,
    capacity factor)); expert choice, each of a rank's E / ep experts taking a token with
    probability copies / (E * T), one minus the chance that none does."""
    E = moe.num_experts
    copies = routed_copies(moe, tokens)
    if moe.is_expert_choice:
        return ep * (1.0 - (1.0 - copies / (E * tokens)) ** (E // ep))
    return expected_groups_hit(E, moe.top_k, ep) * copies / (tokens * moe.top_k)


def _row_bytes(model: ModelConfig, moe: MoEConfig, *, tokens: int, seq_len: int | None, compute_bytes: int,
               num_recomputed: int) -> int:
    """All-to-all bytes if every routed token's row left the rank once in every MoE layer, over a
    micro-step of ``tokens`` tokens: dispatch and combine forward, both again in backward, the
    forward again per recomputed layer, in the wire formats of ``moe.dispatch_dtype``."""
    routed = routed_tokens(model, tokens, seq_len)
    recomputed = recomputed_tokens(model, tokens, seq_len, num_recomputed)
    if moe.dispatch_dtype == "none":
        return 2 * model.dim * compute_bytes * (2 * routed + recomputed)
    bf16_row = wire_row_bytes(model.dim, "bf16")
    forward_row = wire_row_bytes(model.dim, moe.dispatch_dtype) + bf16_row  # dispatch + combine
    return forward_row * (routed + recomputed) + 2 * bf16_row * routed


def _copy_metadata_bytes(model: ModelConfig, moe: MoEConfig, *, tokens: int, seq_len: int | None,
                         num_recomputed: int) -> int:
    """Once per rank, the per-copy metadata if every routed token had one copy leave in every MoE
    layer over a micro-step: each forward its fp32 gate weight and the index of its row (int64, or
    int32 in a compressed ``dispatch_dtype``); the backward the gate weight's gradient."""
    routed = routed_tokens(model, tokens, seq_len)
    index = 8 if moe.dispatch_dtype == "none" else int_wire_dtype(TOKEN_BOUND).itemsize
    recomputed = recomputed_tokens(model, tokens, seq_len, num_recomputed)
    return (routed + recomputed) * (GATE_WEIGHT_BYTES + index) + routed * GATE_WEIGHT_BYTES


def _exchange_bytes(model: ModelConfig, moe: MoEConfig, *, tokens: int, seq_len: int | None, compute_bytes: int,
                    num_recomputed: int, ep: int, share: float, dedup_ranks: float | None) -> float:
    """Bytes one rank sends in a micro-step's expert all-to-alls to the fraction ``share`` of the
    destinations of its tokens' copies (rows and, once per rank, metadata): per copy, one row per
    routed copy (``routed_copies``); once per rank (``moe.dispatch_dedup``), ``dedup_ranks`` rows
    per token (default ``ranks_per_token``) and each copy's metadata."""
    per_token = routed_copies(moe, tokens) / tokens
    rows = _row_bytes(model, moe, tokens=tokens, seq_len=seq_len, compute_bytes=compute_bytes,
                      num_recomputed=num_recomputed)
    if not moe.dispatch_dedup:
        return rows * per_token * share
    ranks = ranks_per_token(moe, ep, tokens) if dedup_ranks is None else dedup_ranks
    meta = _copy_metadata_bytes(model, moe, tokens=tokens, seq_len=seq_len, num_recomputed=num_recomputed)
    return (rows * ranks + meta * per_token) * share


def _all_to_all_bytes(model: ModelConfig, moe: MoEConfig, *, ep: int, tokens_per_micro_batch: int, grad_accum: int,
                      compute_bytes: int, num_recomputed: int, seq_len: int | None = None,
                      dedup_ranks: float | None = None) -> int:
    """Expert all-to-all bytes of one optimizer step (forward, backward and recompute): (ep - 1) / ep
    of what each token sends leaves the rank."""
    return int(_exchange_bytes(model, moe, tokens=tokens_per_micro_batch, seq_len=seq_len,
                               compute_bytes=compute_bytes, num_recomputed=num_recomputed, ep=ep,
                               share=(ep - 1) / ep, dedup_ranks=dedup_ranks) * grad_accum)


EXPERT_ID_BYTES = 8
"""The expert ids gathered over an etp group are int64."""
GATE_WEIGHT_BYTES = 4
"""Gate weights leave the router in fp32 whatever the compute dtype."""


def etp_forward_bytes(*, dim: int, etp: int, tokens: int, top_k: int, compute_bytes: int) -> tuple[int, int]:
    """``(all_gather, reduce_scatter)`` bytes one rank sends in one MoE layer's forward under
    parallel.etp: the gather of ``tokens`` rows (D values, K int64 ids, K fp32 gate weights) from
    each of the etp - 1 others, and the reduce-scatter of the partial outputs."""
    f, T, K = etp - 1, tokens, top_k
    return f * T * (dim * compute_bytes + EXPERT_ID_BYTES * K + GATE_WEIGHT_BYTES * K), f * T * dim * compute_bytes


def etp_bytes_per_micro_batch(model: ModelConfig, *, etp: int, tokens: int, top_k: int, compute_bytes: int,
                              num_recomputed: int = 0, seq_len: int | None = None) -> tuple[int, int]:
    """``(all_gather, reduce_scatter)`` bytes one rank sends for one micro-batch of ``tokens``
    routed tokens, over every MoE layer (the multi-token depths' at their tokens, ``routed_tokens``):
    the forward collectives (again per recomputed layer), and their backward, which swaps them: the
    output gradient all-gathered, the token and gate-weight gradients reduce-scattered (ids carry none)."""
    gather_row, scatter_row = etp_forward_bytes(dim=model.dim, etp=etp, tokens=1, top_k=top_k,
                                                compute_bytes=compute_bytes)
    f, D, c = etp - 1, model.dim, compute_bytes
    backwards = routed_tokens(model, tokens, seq_len)
    forwards = backwards + recomputed_tokens(model, tokens, seq_len, num_recomputed)
    gather = forwards * gather_row + backwards * f * D * c
    scatter = forwards * scatter_row + backwards * f * (D * c + GATE_WEIGHT_BYTES * top_k)
    return gather, scatter


def expected_groups_hit(num_experts: int, top_k: int, num_groups: int) -> float:
    """Expected distinct groups (of E / num_groups consecutive experts: ranks, nodes) among a
    token's top_k distinct experts, under uniform routing."""
    miss = math.comb(num_experts - num_experts // num_groups, top_k) / math.comb(num_experts, top_k)
    return num_groups * (1.0 - miss)


def _ep_node_bytes(vol: CommVolume, model: ModelConfig, moe: MoEConfig, *, ep: int, per_node: int,
                   tokens_per_micro_batch: int, seq_len: int | None, grad_accum: int, compute_bytes: int,
                   num_recomputed: int, hierarchical: bool, dedup_ranks: float | None) -> None:
    """Inter-node all-to-all bytes, flat and hierarchical; with ``hierarchical`` (and ep groups of
    whole nodes) the all-to-all volume of the two-stage exchange too."""
    if per_node % ep == 0:
        return  # every ep group inside one node
    if ep % per_node != 0:
        vol.all_to_all_inter_node_flat = vol.all_to_all_inter_node_hierarchical = vol.all_to_all
        return
    num_nodes, E, K = ep // per_node, moe.num_experts, moe.top_k
    T = tokens_per_micro_batch
    # Flat, (Q - 1) / Q of what each token sends goes to another node; the two-stage exchange
    # sends one row per other node a token's kept copies reach.
    flat = _exchange_bytes(model, moe, tokens=T, seq_len=seq_len, compute_bytes=compute_bytes,
                           num_recomputed=num_recomputed, ep=ep, share=(num_nodes - 1) / num_nodes,
                           dedup_ranks=dedup_ranks)
    kept = min(1.0, routed_copies(moe, T) / (T * K))
    per_token = kept * grad_accum * _row_bytes(model, moe, tokens=tokens_per_micro_batch, seq_len=seq_len,
                                               compute_bytes=compute_bytes, num_recomputed=num_recomputed)
    other_nodes = expected_groups_hit(E, K, num_nodes) * (num_nodes - 1) / num_nodes
    vol.all_to_all_inter_node_flat = int(flat * grad_accum)
    vol.all_to_all_inter_node_hierarchical = int(per_token * other_nodes)
    if hierarchical:
        forwarded = expected_groups_hit(E, K, ep) * (ep - num_nodes) / ep
        vol.all_to_all = int(per_token * (other_nodes + forwarded))


def _onebit_sent(numel: int, group: int) -> int:
    """Bytes a rank sends in the 1-bit all-reduce of one tensor: its W - 1 foreign chunks in the
    all-to-all and its own compressed chunk to W - 1 ranks in the all-gather."""
    if group == 1:
        return 0
    return 2 * (group - 1) * (chunk_len(numel, group) // 8 + 4)


def _add_replicated(vol: CommVolume, specs: list[ParamSpec], layout: Layout, *, grad_compression: str,
                    dp_crosses: bool, edp_crosses: bool) -> None:
    """Stages 0/1: the gradient all-reduce (dense over dp, expert shards over edp), in the wire
    format of ``grad_compression``, and at stage 1 the all-gather of the updated parameters."""
    W, edp, split = layout.world, layout.edp, layout.ep * layout.etp

    def sharded(s: ParamSpec) -> bool:  # an expert weight split over ep (and etp), reduced over edp
        return s.expert and split > 1

    dense_numel = sum(s.numel for s in specs if not sharded(s))
    expert_numel = sum(s.numel // split for s in specs if sharded(s))
    dense_ar, expert_ar = 2 * _ring(dense_numel * 4, W), 2 * _ring(expert_numel * 4, edp)
    if grad_compression == "bf16":
        dense_ar, expert_ar = dense_ar / 2, expert_ar / 2
    elif grad_compression == "onebit":
        dense_ar = sum(_onebit_sent(s.numel, W) for s in specs if not sharded(s))
        expert_ar = sum(_onebit_sent(s.numel // split, edp) for s in specs if sharded(s))
    vol.all_reduce = int(dense_ar + expert_ar)
    vol.inter_node += int(dense_ar * dp_crosses + expert_ar * edp_crosses)
    if layout.zero_stage == 1:
        dense_ag, expert_ag = _ring(dense_numel * 4, W), _ring(expert_numel * 4, edp)
        vol.all_gather += int(dense_ag + expert_ag)
        vol.inter_node += int(dense_ag * dp_crosses + expert_ag * edp_crosses)


def _add_token_exchanges(vol: CommVolume, model: ModelConfig, moe: MoEConfig, *, ep: int, etp: int, per_node: int,
                         tokens: int, seq_len: int | None, grad_accum: int, compute_bytes: int, num_recomputed: int,
                         ep_hierarchical: bool, dedup_ranks: float | None) -> None:
    """The expert all-to-all (dispatch + combine; forward, backward and recompute) of ``tokens``
    per micro-batch, and under etp the gathers and reduce-scatters around the experts: every rank
    then dispatches its etp group's gathered tokens."""
    if etp > 1:
        gather, scatter = etp_bytes_per_micro_batch(model, etp=etp, tokens=tokens, top_k=moe.top_k,
                                                    compute_bytes=compute_bytes, num_recomputed=num_recomputed,
                                                    seq_len=seq_len)
        vol.all_gather, vol.reduce_scatter = gather * grad_accum, scatter * grad_accum
        vol.inter_node += (gather + scatter) * grad_accum * (per_node % etp != 0)
    if ep == 1:
        return
    dispatched = tokens * etp
    vol.all_to_all = _all_to_all_bytes(model, moe, ep=ep, tokens_per_micro_batch=dispatched, grad_accum=grad_accum,
                                       compute_bytes=compute_bytes, num_recomputed=num_recomputed, seq_len=seq_len,
                                       dedup_ranks=dedup_ranks)
    _ep_node_bytes(vol, model, moe, ep=ep, per_node=per_node, tokens_per_micro_batch=dispatched, seq_len=seq_len,
                   grad_accum=grad_accum, compute_bytes=compute_bytes, num_recomputed=num_recomputed,
                   hierarchical=ep_hierarchical, dedup_ranks=dedup_ranks)
    ep_crosses = ep > per_node or per_node % ep != 0
    hierarchical = ep_hierarchical and ep_crosses and ep % per_node == 0
    vol.inter_node += vol.all_to_all_inter_node_hierarchical if hierarchical else vol.all_to_all_inter_node_flat


def comm_per_step(specs: list[ParamSpec], layout: Layout, model: ModelConfig, moe: MoEConfig, *,
                  tokens_per_micro_batch: int, grad_accum: int, compute_bytes: int,
                  ac_moe_layers_recomputed: int = 0, procs_per_node: int | None = None,
                  ep_hierarchical: bool = False, grad_compression: str = "none",
                  seq_len: int | None = None, dedup_ranks_per_token: float | None = None) -> CommVolume:
    """Bytes this rank sends in one optimizer step (``grad_accum`` micro-batches of
    ``tokens_per_micro_batch`` tokens). ``ac_moe_layers_recomputed``: MoE layers whose forward
    (all-to-alls included) checkpointing repeats in backward. ``procs_per_node`` (default: all
    on one node) decides which groups span nodes: ep groups are consecutive ranks, dp spans
    every rank, edp groups stride by ep, HSDP shard groups are consecutive. ``ep_hierarchical``
    (parallel.ep_hierarchical): the two-stage all-to-all where ep groups are whole nodes.
    ``grad_compression`` (dp.grad_compression, stages 0/1): "bf16" halves the gradient
    all-reduce; "onebit" counts a step of 1-bit Adam's compressed phase (after its fp32 warm-up):
    per tensor, the all-to-all and all-gather of W chunks of packed signs and an fp32 scale.
    ``seq_len``: the length of the micro-batch's sequences, which sets the tokens the multi-token
    depths route (``routed_tokens``; None counts them at ``tokens_per_micro_batch``).
    ``dedup_ranks_per_token``: with ``moe.dispatch_dedup``, the mean distinct ep ranks a token's
    copies go to, for a routing known exactly (default ``ranks_per_token``, uniform routing)."""
    W, ep, edp, stage, etp = layout.world, layout.ep, layout.edp, layout.zero_stage, layout.etp
    per_node = W if procs_per_node is None else procs_per_node
    vol = CommVolume()
    dp_crosses = W > per_node
    edp_crosses = edp > 1 and W > per_node
    shard_crosses = layout.dense_shard_size > per_node

    # 1. The experts' token exchanges: the all-to-all and, under etp, the gathers around it.
    if model.is_moe:
        _add_token_exchanges(vol, model, moe, ep=ep, etp=etp, per_node=per_node, tokens=tokens_per_micro_batch,
                             seq_len=seq_len, grad_accum=grad_accum, compute_bytes=compute_bytes,
                             num_recomputed=ac_moe_layers_recomputed, ep_hierarchical=ep_hierarchical,
                             dedup_ranks=dedup_ranks_per_token)

    # 2. Gradient and parameter collectives.
    if stage in (0, 1):
        _add_replicated(vol, specs, layout, grad_compression=grad_compression, dp_crosses=dp_crosses,
                        edp_crosses=edp_crosses)
        return vol

    shard = layout.dense_shard_size
    replicas = layout.hsdp_replicate

    def padded(s: ParamSpec, group: int) -> int:
        rows = s.shape[0] // ep if (s.expert and ep > 1) else s.shape[0]
        if s.expert and ep > 1 and expert_shard_dim(s.shape, ep, edp) == 1:
            return rows * s.row_numel  # split evenly on dim 1: no padding
        return _chunk(rows, group, 0)[1] * group * s.row_numel

    root_gather = blocks_gather = 0.0
    reduce = all_reduce = 0.0
    inter = 0.0
    gathers = 2 if stage == 3 else 1  # per micro-step, for a block unit
    for s in specs:
        is_expert = s.expert and ep > 1
        group = edp if is_expert else shard
        crosses = edp_crosses if is_expert else shard_crosses
        numel = padded(s, group)
        # Routers are FSDP units of their own that gather in fp32 (routing is fp32 at every stage).
        gathered = _ring(numel * (4 if ".router." in s.name else compute_bytes), group)
        if s.name.startswith("layers."):
            blocks_gather += gathered
            inter += gathered * gathers * grad_accum * crosses
        else:
            root_gather += gathered
            inter += gathered * grad_accum * crosses
        reduce += _ring(numel * 4, group)
        inter += _ring(numel * 4, group) * crosses
        if replicas > 1 and not is_expert:
            all_reduce += 2 * _ring(numel / shard * 4, replicas)
            inter += 2 * _ring(numel / shard * 4, replicas)  # replicas live on different nodes
    vol.all_gather = int((blocks_gather * gathers + root_gather) * grad_accum)
    vol.reduce_scatter = int(reduce)
    vol.all_reduce = int(all_reduce)
    vol.inter_node += int(inter)
    return vol
