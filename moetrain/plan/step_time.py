"""Seconds per optimizer step of one layout, with its breakdown, tokens/s and MFU.

Per rank (ranks are alike under balanced routing; the slowest one sets the step)::

    step = compute + exposed communication + fixed

**Compute**, forward + backward (+ recompute) of the step's ``grad_accum`` micro-batches of T tokens:

    dense GEMMs    2 * T * (attention projections + dense FFNs + shared experts + routers + head)
                   FLOPs forward; backward twice the forward (input and weight gradients)
    expert GEMMs   2 * N * (2 or 3) * D * F forward, N = T*K*min(1, capacity factor) routed copies
                   (expert choice: E * ceil(capacity factor * T*K / E), for any factor):
                   under balanced routing a rank's experts receive as many copies as it sends, so
                   ep spreads the experts, not the work per rank
    multi-token    depth k of ``model.mtp_depth``: its block, eh_proj (2*D*D) and the shared head over
                   the (S - k) / S of the tokens with a token k places ahead, attention over S - k
                   positions; recomputed only by "moe" checkpointing (its MoE FFN)
    attention      2 * S * D FLOPs per token and layer forward (QK^T and AV, causal: the masked half
                   is skipped, as flash kernels do); backward 2.5x (it recomputes the probabilities:
                   5 matmuls to the forward's 2)
    elementwise    norms, activations, softmaxes, routing, permutations, residuals and the loss are
                   memory-bound: ``ELEMENTWISE_PASSES`` passes over the activation bytes the model
                   saves for backward (``plan.activations``), plus 2 passes over what a recompute
                   regenerates
    recompute      activation checkpointing repeats the checkpointed modules' forward in backward

GEMMs run at ``peak * gemm_efficiency`` (experts at ``expert_gemm_efficiency``), attention at
``peak * attention_efficiency``, elementwise bytes at ``memory_bandwidth``.

**Communication**: the bytes of ``plan.comm.comm_per_step`` over the link's bandwidth for that
collective, plus one latency per call; a group that spans nodes runs at the inter-node link.

**Overlap**: the DDP all-reduce (stages 0/1) runs under the last micro-batch's backward except
its last bucket; FSDP's all-gathers are prefetched under the previous unit's compute except the
first, its reduce-scatters run under the backward except the last unit's; the MoE all-to-all
blocks its layer unless ``dispatch_chunks`` > 1 splits it, and then all but one chunk hide behind
the expert GEMMs. Of the communication that could hide, the fraction ``comm_overlap`` does (1 on
GPUs, whose collectives run on their own streams; measured on CPUs, where gloo competes for the
cores); what does not fit under the compute is exposed too. The ZeRO-1 parameter all-gather
after the step is exposed.

**Fixed**: the optimizer step (``OPTIMIZER_BYTES_PER_ELEMENT`` per element this rank updates,
plus gradient clipping and the weight average's update, at memory bandwidth), the step's small
collectives (global norm, agreement on the step, and one routing-count all-reduce per MoE layer and
micro-batch) and, at ep > 1, per MoE layer and micro-batch one host sync (the all-to-all's split
sizes) and the dispatcher's host work (``DeviceProfile.ep_layer_host_s``); and the host's cost per
operation (``DeviceProfile.op_overhead_s`` x the operations ``plan.host_ops`` counts, plus
``dtensor_param_host_s`` per ep-sharded expert tensor), all of it on a CPU, where the same cores run
it, and on a GPU only what exceeds the device's work queued behind it.

What it cannot know: kernel efficiency on a device it never measured (the GPU profiles' are stated
assumptions), imbalanced routing (the busiest expert rank sets the step), congestion, stragglers,
and fused kernels (``torch.compile`` removes much elementwise traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.models.transformer import attention_params
from moetrain.plan.activations import estimate_activations, moe_layers_recomputed
from moetrain.plan.comm import comm_per_step, num_moe_layers, routed_copies
from moetrain.plan.device_profiles import (  # noqa: F401  (re-exported: the step-time API)
    H100_SXM,
    H200,
    PROFILES,
    CalibratedProfiles,
    DeviceProfile,
    Link,
    load_profile,
)
from moetrain.plan.model_states import ADAM_STATE_BYTES, Layout, ParamSpec, param_specs, state_bytes_per_rank

ELEMENTWISE_PASSES = 5
"""Passes over each saved activation byte: written and read in forward; read, its gradient written
and read in backward."""
OPTIMIZER_BYTES_PER_ELEMENT = 28 + 12
"""AdamW (fused, as ``train.optim`` builds it: ``LocalAdamW``): one pass reading the parameter, its
gradient and both moments and writing the three, 28; global-norm clipping: the norm 4 and the
scaling 8."""
WEIGHT_AVERAGE_BYTES_PER_ELEMENT = 12
"""optim.ema_decay's lerp: the average and the weight read, the average written (fp32)."""
ATTENTION_BACKWARD_RATIO = 2.5
"""Flash-attention backward FLOPs over forward: 5 matmuls (probabilities recomputed) against 2."""


@dataclass
class Work:
    """One rank's work in one optimizer step; FLOPs and bytes forward / backward (recompute in backward)."""

    dense_gemm_flops: tuple[float, float]
    expert_gemm_flops: tuple[float, float]
    attention_flops: tuple[float, float]
    elementwise_bytes: tuple[float, float]

    def seconds(self, p: DeviceProfile, peak: float) -> tuple[float, float]:
        """(forward, backward) seconds, the matmuls at ``peak`` (``DeviceProfile.peak``)."""
        fwd, bwd = (self.dense_gemm_flops[i] / (peak * p.gemm_efficiency)
                    + self.expert_gemm_flops[i] / (peak * p.expert_gemm_efficiency)
                    + self.attention_flops[i] / (peak * p.attention_efficiency)
                    + self.elementwise_bytes[i] / p.memory_bandwidth for i in (0, 1))
        return fwd, bwd


def _recomputed_blocks(model: ModelConfig, ac: str, every: int) -> tuple[list[int], list[int]]:
    """(blocks whose whole forward is recomputed, blocks whose MoE FFN alone is)."""
    ids = list(range(model.num_layers))
    if ac == "full":
        return ids, []
    if ac == "every_n":
        return ids[::every], []
    if ac == "moe":
        return [], [i for i in ids if model.is_moe_layer(i)]
    return [], []


def step_work(model: ModelConfig, moe: MoEConfig, *, micro_batch_size: int, seq_len: int, grad_accum: int,
              ep: int = 1, ac: str = "none", ac_every: int = 2, dtype: str = "fp32") -> Work:
    """FLOPs and elementwise bytes of one rank's optimizer step (see the module docstring)."""
    T, D, S = micro_batch_size * seq_len, model.dim, seq_len
    mats = {"gelu": 2, "swiglu": 3}
    attn_proj = attention_params(model)  # wq, wk, wv, wo (or the MLA projections), biases, q/k norms
    dense_ffn = mats[model.activation] * D * model.resolved_dense_hidden_dim
    shared = mats[moe.activation] * D * moe.resolved_shared_hidden_dim if moe.num_shared_experts > 0 else 0
    moe_dense = shared + D * moe.num_experts  # shared experts + router
    # Copies per token: T * K (times min(1, capacity factor)), or expert choice's E * capacity.
    expert_per_token = routed_copies(moe, T) / T * mats[moe.activation] * D * moe.expert_hidden_dim
    head = D * model.num_outputs

    def block(moe_ffn: bool, positions: int = S, ffn_only: bool = False) -> tuple[float, float, float]:
        """Forward (dense GEMM, expert GEMM, attention) FLOPs per token of a block over sequences
        of ``positions``."""
        ffn = (moe_dense, expert_per_token) if moe_ffn else (dense_ffn, 0.0)
        if ffn_only:
            return 2 * ffn[0], 2 * ffn[1], 0.0
        return 2 * (attn_proj + ffn[0]), 2 * ffn[1], 2 * positions * D

    def add(total: list[float], part: tuple[float, ...], share: float = 1.0) -> list[float]:
        return [a + share * b for a, b in zip(total, part, strict=True)]

    fwd = [0.0, 0.0, 0.0]
    for i in range(model.num_layers):
        fwd = add(fwd, block(model.is_moe_layer(i)))
    fwd[0] += 2 * head
    whole, ffn_only = _recomputed_blocks(model, ac, ac_every)
    rec = [0.0, 0.0, 0.0]
    for i in whole:
        rec = add(rec, block(model.is_moe_layer(i)))
    for _ in ffn_only:  # MoE layers ("moe" checkpointing)
        rec = add(rec, block(True, ffn_only=True))
    # Multi-token depth k: its block, eh_proj ([2D] -> D) and the shared head over the (S - k) / S
    # of the positions that have a token k places ahead; checkpointed only by "moe" (its MoE FFN).
    for k in range(1, model.mtp_depth + 1):
        share = (S - k) / S
        fwd = add(fwd, block(model.is_moe, S - k), share)
        fwd = add(fwd, (2.0 * (2 * D * D + head), 0.0, 0.0), share)
        if ac == "moe" and model.is_moe:
            rec = add(rec, block(True, ffn_only=True), share)
    tokens = T * grad_accum

    def act(mode: str) -> int:
        return estimate_activations(model, moe, micro_batch_size=micro_batch_size, seq_len=seq_len, ep=ep,
                                    ac=mode, ac_every=ac_every, dtype=dtype).saved_bytes

    saved = act("none")
    regenerated = saved - act(ac) if ac != "none" else 0
    forward_passes = 2  # of ELEMENTWISE_PASSES: written and read in forward
    return Work(
        dense_gemm_flops=(tokens * fwd[0], tokens * (2 * fwd[0] + rec[0])),
        expert_gemm_flops=(tokens * fwd[1], tokens * (2 * fwd[1] + rec[1])),
        attention_flops=(tokens * fwd[2], tokens * (ATTENTION_BACKWARD_RATIO * fwd[2] + rec[2])),
        elementwise_bytes=(grad_accum * forward_passes * saved,
                           grad_accum * ((ELEMENTWISE_PASSES - forward_passes) * saved
                                         + forward_passes * regenerated)))


DDP_FIRST_BUCKET_BYTES = 1 << 20
"""DDP's first bucket (the gradients ready first) is capped at 1 MiB, the others at ``bucket_cap_mb``."""


def all_to_alls_per_moe_layer(moe: MoEConfig, *, chunks: int | None = None) -> tuple[int, int]:
    """(all-to-all calls of one MoE layer and micro-batch at ep > 1, and of a recompute of its
    forward), with the batch sent in C = ``chunks`` (default ``moe.dispatch_chunks``) exchanges::

        forward    the counts, once for all chunks (dropless, or C > 1; a capacity factor at C = 1
                   decides the drops from an all-gather of them: no all-to-all), then per chunk the
                   dispatch and the combine
        backward   per chunk, the gradients of the dispatch and the combine

    ``moe.dispatch_dedup`` adds the unique-row counts once, per chunk the copies' gate weights and
    row indices forward and the weights' gradient backward. Counted op by op on real ranks by
    tests/integration/test_a2a_calls.py. Not modelled: parallel.ep_hierarchical's two-stage exchange."""
    C = moe.dispatch_chunks if chunks is None else chunks
    dedup = int(moe.dispatch_dedup)
    forward = int(moe.capacity_factor is None or C > 1) + dedup + C * (2 + 2 * dedup)
    return forward + C * (2 + dedup), forward


STEP_COLLECTIVES = 2
"""Latency-bound all-reduces of every step: the global gradient norm, the agreement on the step."""


@dataclass
class StepEstimate:
    """One rank's optimizer step, in seconds."""

    forward_s: float
    backward_s: float
    """Backward, recompute included."""
    comm_s: dict
    """Time of each collective (bytes / bandwidth + calls * latency), hidden or not."""
    exposed_s: dict
    """What of each collective's time the compute does not hide."""
    optimizer_s: float
    sync_s: float
    """The step's small collectives and host syncs."""
    host_s: float
    """Host time per operation the compute does not cover (``DeviceProfile.op_overhead_s``)."""
    tokens_per_step: int
    world: int
    flops_per_token: float
    peak_flops: float
    threads_per_rank: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.exposed_s.values())

    @property
    def fixed_s(self) -> float:
        return self.optimizer_s + self.sync_s + self.host_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.fixed_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs (``flops_per_token``, as the trainer reports MFU) over the ranks' peak."""
        return self.tokens_per_s * self.flops_per_token / (self.world * self.peak_flops)

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "forward_s": self.forward_s,
                "backward_s": self.backward_s, "exposed_comm_s": self.exposed_comm_s, "fixed_s": self.fixed_s,
                "optimizer_s": self.optimizer_s, "sync_s": self.sync_s, "host_s": self.host_s,
                "comm_s": dict(self.comm_s), "exposed_s": dict(self.exposed_s), "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu}


def _hide(total_s: float, exposed_floor_s: float, capacity_s: float, overlap: float) -> tuple[float, float]:
    """(exposed, capacity left): of ``total_s``, ``exposed_floor_s`` cannot overlap; of the rest the
    fraction ``overlap`` hides, as far as ``capacity_s`` of compute reaches."""
    hidden = min((total_s - exposed_floor_s) * overlap, capacity_s)
    return total_s - hidden, capacity_s - hidden


def _num_units(specs: list[ParamSpec], ep: int) -> int:
    """FSDP2 units: the root, each block, and each block's experts at ep > 1 (``fully_shard`` order)."""
    blocks = {".".join(s.name.split(".")[:2]) for s in specs if s.name.startswith("layers.")}
    experts = {s.name.rsplit(".", 1)[0] for s in specs if s.expert and ep > 1}
    return 1 + len(blocks) + len(experts)


def _calls(specs: list[ParamSpec], layout: Layout, *, num_moe: int, recomputed: int, grad_accum: int,
           bucket_cap_bytes: int, a2a_per_layer: tuple[int, int]) -> tuple[dict[str, int], int, float]:
    """(calls per collective in one step, FSDP units, the share of the stage-0/1 reduction in its
    last bucket)."""
    units = _num_units(specs, layout.ep)
    ep, stage = layout.ep, layout.zero_stage
    expert_tensors = sum(1 for s in specs if s.expert) if ep > 1 and layout.edp > 1 else 0
    grad_bytes = sum(s.numel * 4 for s in specs if not (s.expert and ep > 1))
    expert_bytes = sum(s.numel * 4 // ep for s in specs if s.expert) if expert_tensors else 0
    # DDP's buckets fill in backward order (1 MiB, then bucket_cap_bytes each): the last one to
    # reduce holds what is left, the first layers' gradients. Expert shards reduce one by one.
    rest = grad_bytes - DDP_FIRST_BUCKET_BYTES
    last_bucket = (rest % bucket_cap_bytes or bucket_cap_bytes) if rest > 0 else grad_bytes
    buckets = 1 + max(0, -(-rest // bucket_cap_bytes))
    # Per MoE layer (``all_to_alls_per_moe_layer``), and again per recompute of its forward.
    a2a = (num_moe * a2a_per_layer[0] + recomputed * a2a_per_layer[1]) * grad_accum if ep > 1 else 0
    calls = {"all_to_all": a2a,
             "all_reduce": buckets + expert_tensors if stage < 2 else units * (layout.hsdp_replicate > 1),
             "reduce_scatter": units if stage >= 2 else 0,
             "all_gather": ((units - 1) * (2 if stage == 3 else 1) + 1) * grad_accum if stage >= 2 else int(stage == 1)}
    return calls, units, last_bucket / (grad_bytes + expert_bytes)


def _spans_nodes(layout: Layout, per_node: int) -> dict[str, bool]:
    """Whether each collective's group leaves the node (the group rules of ``comm_per_step``)."""
    grads = layout.world > per_node
    return {"all_to_all": layout.ep > per_node or per_node % layout.ep != 0, "all_reduce": grads,
            "reduce_scatter": layout.dense_shard_size > per_node, "all_gather": grads}


def estimate_step_time(specs: list[ParamSpec], layout: Layout, model: ModelConfig, moe: MoEConfig, *,
                       micro_batch_size: int, seq_len: int, grad_accum: int, profile: DeviceProfile,
                       dtype: str = "fp32", ac: str = "none", ac_every: int = 2, procs_per_node: int | None = None,
                       dispatch_chunks: int = 1, bucket_cap_bytes: int = 25 << 20, tf32: bool = False) -> StepEstimate:
    """Seconds of one optimizer step of ``layout`` on ``profile`` (see the module docstring)."""
    if layout.offload_optimizer or layout.offload_params:
        raise ValueError("zero.offload_optimizer/offload_param ('cpu'): host offload is not in the step-time "
                         "model (its host-link copies and host optimizer are not measured)")
    if dispatch_chunks < 1:
        raise ValueError(f"moe.dispatch_chunks ({dispatch_chunks}) must be >= 1")
    from moetrain.models.transformer import flops_per_token

    per_node = layout.world if procs_per_node is None else procs_per_node
    compute_bytes = 4 if dtype == "fp32" else 2
    T = micro_batch_size * seq_len
    work = step_work(model, moe, micro_batch_size=micro_batch_size, seq_len=seq_len, grad_accum=grad_accum,
                     ep=layout.ep, ac=ac, ac_every=ac_every, dtype=dtype)
    peak = profile.peak(dtype, tf32=tf32)
    forward_s, backward_s = work.seconds(profile, peak)
    num_moe = num_moe_layers(model)  # the multi-token depths' MoE layers exchange tokens too
    recomputed = moe_layers_recomputed(model, ac, ac_every)
    vol = comm_per_step(specs, layout, model, moe, tokens_per_micro_batch=T, grad_accum=grad_accum,
                        compute_bytes=compute_bytes, ac_moe_layers_recomputed=recomputed, procs_per_node=per_node,
                        seq_len=seq_len)
    # 1. Each collective's time: its bytes over its link, one latency per call.
    calls, units, last_bucket_share = _calls(specs, layout, num_moe=num_moe, recomputed=recomputed,
                                             grad_accum=grad_accum, bucket_cap_bytes=bucket_cap_bytes,
                                             a2a_per_layer=all_to_alls_per_moe_layer(moe, chunks=dispatch_chunks))
    spans = _spans_nodes(layout, per_node)
    comm = {}
    for c, n in calls.items():
        link = profile.inter_node if spans[c] else profile.intra_node
        num_bytes = getattr(vol, c)
        comm[c] = link.seconds(c, num_bytes, n) if (num_bytes or n) and layout.world > 1 else 0.0

    # 2. What hides behind compute: reductions under the last micro-batch's backward first.
    last_backward = backward_s / grad_accum
    exposed = {}
    if layout.zero_stage < 2:
        floor = comm["all_reduce"] * last_bucket_share
        exposed["all_reduce"], _ = _hide(comm["all_reduce"], floor, last_backward, profile.comm_overlap)
        exposed["all_gather"] = comm["all_gather"]  # ZeRO-1: after the optimizer step
        exposed["reduce_scatter"] = 0.0
    else:
        exposed["reduce_scatter"], left = _hide(comm["reduce_scatter"], comm["reduce_scatter"] / units,
                                                last_backward, profile.comm_overlap)
        exposed["all_reduce"], left = _hide(comm["all_reduce"], comm["all_reduce"] / units, left,
                                            profile.comm_overlap)
        first_gather = comm["all_gather"] / max(1, calls["all_gather"]) * grad_accum
        exposed["all_gather"], _ = _hide(comm["all_gather"], first_gather,
                                         forward_s + backward_s - last_backward + left, profile.comm_overlap)
    expert_s = sum(work.expert_gemm_flops) / (peak * profile.expert_gemm_efficiency)
    chunk_floor = comm["all_to_all"] / dispatch_chunks
    exposed["all_to_all"], _ = _hide(comm["all_to_all"], chunk_floor, expert_s, profile.comm_overlap)

    # 3. Fixed costs: the optimizer over this rank's slice, the step's small collectives, host syncs.
    worst = max(state_bytes_per_rank(specs, layout), key=lambda s: s.total)
    owned = worst.optim / ADAM_STATE_BYTES
    averaged = worst.average / 4 * WEIGHT_AVERAGE_BYTES_PER_ELEMENT
    optimizer_s = ((owned * (OPTIMIZER_BYTES_PER_ELEMENT - 12) + worst.grad / 4 * 12 + averaged)
                   / profile.optimizer_bandwidth)
    moe_forwards = (num_moe + recomputed) * grad_accum
    host_syncs = moe_forwards if layout.ep > 1 else 0
    small = profile.inter_node if layout.world > per_node else profile.intra_node
    # Each MoE forward sums its routing counts over the data-parallel ranks (the balance loss's
    # global frequencies): one small all-reduce.
    sync_s = (small.seconds("all_reduce", 0, STEP_COLLECTIVES + moe_forwards) if layout.world > 1 else 0.0) \
        + host_syncs * (profile.host_sync_s + profile.ep_layer_host_s)
    host_s = sum(1 for s in specs if s.expert) * profile.dtensor_param_host_s if layout.ep > 1 else 0.0
    if profile.op_overhead_s:
        from moetrain.plan.host_ops import count_host_ops

        host_s += count_host_ops(model, moe).per_step(grad_accum) * profile.op_overhead_s
    if profile.host_async:
        host_s = max(0.0, host_s - forward_s - backward_s - optimizer_s)
    return StepEstimate(forward_s=forward_s, backward_s=backward_s, comm_s=comm, exposed_s=exposed,
                        optimizer_s=optimizer_s, sync_s=sync_s, host_s=host_s,
                        tokens_per_step=T * grad_accum * layout.world, world=layout.world,
                        flops_per_token=flops_per_token(model, moe, seq_len=seq_len), peak_flops=peak,
                        threads_per_rank=profile.threads_per_rank)


def estimate_for_config(cfg: JobConfig, *, world: int, profile: DeviceProfile | CalibratedProfiles,
                        nodes: int = 1) -> StepEstimate:
    """The step time of ``cfg``'s own layout (parallel.ep, zero_stage, hsdp_replicate, checkpointing)
    at ``world`` processes over ``nodes`` nodes, with the micro-batch the planner would plan."""
    from moetrain.plan.planner import planned_micro_batch, resolve_vocab

    if cfg.parallel.etp != 1:  # its gathers, on the critical path, are not in the model
        raise ValueError(f"parallel.etp ({cfg.parallel.etp}) must be 1 for a step-time estimate (plan's etp table)")
    model, per_node = resolve_vocab(cfg), world // nodes
    if isinstance(profile, CalibratedProfiles):
        profile = profile.for_procs(per_node)
    micro, accum, _ = planned_micro_batch(cfg.train, world)
    t = cfg.train
    return estimate_step_time(param_specs(model, cfg.moe), Layout.of_config(cfg, world), model, cfg.moe,
                              micro_batch_size=micro, seq_len=cfg.data.seq_len, grad_accum=accum, profile=profile,
                              dtype=t.dtype, tf32=t.tf32, ac=t.activation_checkpointing,
                              ac_every=t.activation_checkpointing_every, procs_per_node=per_node,
                              dispatch_chunks=cfg.moe.dispatch_chunks)
