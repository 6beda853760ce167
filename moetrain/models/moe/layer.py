"""The Mixture-of-Experts feed-forward layer: router -> dispatch -> experts -> combine, plus the
shared experts (optionally scaled by a per-token sigmoid gate), which the dispatcher runs while
the dispatched rows are in flight.

Written for one device. Expert parallelism replaces ``self.dispatcher`` (and shards the expert
weights) afterwards, from ``moetrain.distributed``; nothing here changes.

Balancing state that changes during training (the selection bias, the dynamic capacity factor,
the per-expert learning-rate scales, a raised aux-loss coefficient) lives in buffers of this
layer and its router, and is changed only by the optimizer hooks of
``moetrain.train.balancing.install_balancing``; forward only reads it, and (when those hooks ask
for it) adds its routing counts to per-step statistics buffers.

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, E experts, K experts per token,
M token copies kept after capacity drops, P expert-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.models.feedforward import FeedForward
from moetrain.models.moe.balance import (
    all_reduce_counts,
    frequency_load_balancing_loss,
    load_balancing_loss,
    masked_sequence_load_balancing_loss,
    routed_frequencies,
    router_z_loss,
    routing_entropy,
    sequence_load_balancing_loss,
)
from moetrain.models.moe.dispatcher import Dispatcher, LocalDispatcher, expert_capacity
from moetrain.models.moe.experts import GroupedExperts, to_autocast_dtype
from moetrain.models.moe.router import ExpertChoiceRouter, TopKRouter

# Slots of MoELayer.step_local_stats.
STAT_DROPPED, STAT_ROUTED, STAT_ENTROPY, STAT_TOKENS = range(4)


@dataclass
class MoEAux:
    """What one MoE forward returns besides its output. All entries are tensors (no host sync)."""

    loss: torch.Tensor
    """aux_loss_coef * load_balancing + z_loss_coef * z_loss: add it to the training loss."""
    load_balancing: torch.Tensor
    z_loss: torch.Tensor
    num_routed_per_expert: torch.Tensor
    """Routed copies per global expert (int64, before drops), summed over ``balance_group``.
    Expert choice: the copies each expert takes over the global batch (equal for all experts)."""
    num_dropped: torch.Tensor
    """Copies dropped by capacity (0-dim). Expert choice: tokens that no expert took."""
    num_routed: int
    """T * K for this forward. Expert choice: T (so dropped_fraction is the share of skipped tokens)."""
    num_token_rank_sends: torch.Tensor | None = None
    """Under expert parallelism (token choice): (token, other ep rank) pairs among this rank's
    routed copies, before capacity drops, as the dispatcher reports them
    (``DispatchResult.num_token_rank_sends``); None without expert parallelism."""
    routing_entropy: torch.Tensor | None = None
    """Summed routing entropy of this forward's tokens (0-dim, no grad), and ``num_tokens`` its
    tokens: set only while the layer tracks routing statistics (``MoELayer.record_step_stats``
    adds them up)."""
    num_tokens: int = 0
    local_routed_per_expert: torch.Tensor | None = None
    """This rank's routed copies per global expert (int64, before drops, not summed over any
    group), as the dispatcher counts them: what a ``counts`` routing trace records. Expert choice:
    this rank's tokens per expert (each is a candidate of every expert)."""

    @property
    def dropped_fraction(self) -> torch.Tensor:
        return self.num_dropped.float() / max(self.num_routed, 1)


class MoELayer(nn.Module):
    """MoE FFN with a token-choice (softmax/sigmoid, optional bias and groups) or expert-choice
    router, optional capacity and shared experts (optionally gated, ``shared_gate``).

    ``forward(x)`` takes ``[..., D]`` and returns ``(out [..., D], MoEAux)``. With
    ``moe.aux_loss_type="sequence"`` the last-but-one dim of ``x`` is the sequence.
    """

    tokens_per_expert: torch.Tensor
    step_routed_E: torch.Tensor
    step_local_stats: torch.Tensor
    trace_routed_E: torch.Tensor
    # Registered only when their feature is on (see __init__); read only then.
    capacity_factor_now: torch.Tensor
    expert_lr_scale: torch.Tensor
    aux_loss_coef_now: torch.Tensor
    prev_step_routed_E: torch.Tensor

    def __init__(self, dim: int, config: MoEConfig) -> None:
        super().__init__()
        self.dim, self.config = dim, config
        c = config
        self.router: TopKRouter
        if c.is_expert_choice:
            self.router = ExpertChoiceRouter(dim, c.num_experts, init_std=c.router_init_std,
                                             jitter=c.router_jitter, noise_std=c.router_noise_std)
        else:
            self.router = TopKRouter(dim, c.num_experts, top_k=c.top_k, renormalize=c.renormalize,
                                     init_std=c.router_init_std, score_func=c.router,
                                     bias=c.has_expert_bias, num_groups=c.num_expert_groups,
                                     top_groups=c.top_groups, group_score=c.group_score,
                                     scaling_factor=c.routed_scaling_factor, jitter=c.router_jitter,
                                     noise_std=c.router_noise_std, force_balance=c.force_balance)
        self.experts = GroupedExperts(dim, c.expert_hidden_dim, c.num_experts,
                                      activation=c.activation, impl=c.expert_impl)
        self.shared_experts = (FeedForward(dim, c.resolved_shared_hidden_dim, activation=c.activation)
                               if c.num_shared_experts > 0 else None)
        # Qwen2-MoE's shared-expert gate: one logit per token. Drawn normal(0.02) here, as
        # FeedForward draws its weights; Transformer.init_weights redraws it with model.init_std.
        self.shared_gate = nn.Linear(dim, 1, bias=False) if c.shared_expert_gate else None
        if self.shared_gate is not None:
            nn.init.normal_(self.shared_gate.weight, std=0.02)
        self.dispatcher: Dispatcher = LocalDispatcher(c.num_experts)
        # Process group over which routing counts are summed before the load-balancing loss
        # (set by the data/expert-parallel wrappers). With it, the mean of the per-rank losses
        # equals the loss of one process holding the whole global batch.
        self.balance_group: dist.ProcessGroup | None = None
        # Process group over which each sequence's positions are spread (tensor parallelism's
        # sequence shards), for the sequence-wise balance loss; None: whole sequences here.
        self.sequence_group: dist.ProcessGroup | None = None
        # Routed copies per expert in the last forward; read by metrics, never synced here.
        # int64 so a cast of the module to bf16 cannot round the counts.
        self.register_buffer("tokens_per_expert", torch.zeros(c.num_experts, dtype=torch.int64),
                             persistent=False)

        # Per-step routing statistics, accumulated over the micro-batches of one optimizer step
        # while ``track_routing_stats`` is on (install_balancing turns it on and its pre-step
        # hook reads and zeroes them). Routed counts are global (summed over balance_group); the
        # local stats are this rank's: dropped copies, routed copies, summed token entropy, tokens.
        self.track_routing_stats = False
        # Whether the caller records this layer's statistics from the returned MoEAux
        # (``record_step_stats``), not the forward itself: an activation checkpoint around the
        # layer does, after the checkpointed call, which a recompute in backward never reaches
        # (and which dynamo can trace, unlike a test for the recompute inside a compiled forward).
        self.stats_recorded_by_caller = False
        # Whether install_balancing's hooks own this layer (track_routing_stats may still be
        # muted for a forward, as the pipeline's shape inference does).
        self.balancing_installed = False
        self.register_buffer("step_routed_E", torch.zeros(c.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("step_local_stats", torch.zeros(4, dtype=torch.float64), persistent=False)
        # This rank's routed copies per expert (not all-reduced), added next to the step statistics
        # and never zeroed by the balancer: the routing-trace recorder zeroes it before a recorded
        # step and reads it after (recorded in the compiled graph, not by a hook that splits it).
        self.register_buffer("trace_routed_E", torch.zeros(c.num_experts, dtype=torch.int64), persistent=False)

        # Balancing state, registered only when its feature is on (so default checkpoints keep
        # their keys) and persistent (a resumed run continues with the same values).
        self._host_cache: dict[str, tuple[torch.Tensor, int, float]] = {}
        if c.dynamic_capacity:
            assert c.capacity_factor is not None, "MoEConfig requires a starting capacity_factor"
            self.register_buffer("capacity_factor_now", torch.tensor(float(c.capacity_factor), dtype=torch.float64))
        if c.expert_lr_scale_max > 1:
            self.register_buffer("expert_lr_scale", torch.ones(c.num_experts, dtype=torch.float32))
        if c.collapse_aux_increase > 0:
            self.register_buffer("aux_loss_coef_now", torch.tensor(float(c.aux_loss_coef), dtype=torch.float64))
        # The global_batch balance loss's f_e: the routed copies of the last optimizer step, over
        # every micro-batch and dp x tp rank (step_routed_E as the pre-step hook read it), zero =
        # none yet (uniform f). Saved with the balancer's counters, not in the model's state dict:
        # it is training state, no weight.
        if c.aux_loss_type == "global_batch":
            self.register_buffer("prev_step_routed_E", torch.zeros(c.num_experts, dtype=torch.int64),
                                 persistent=False)

    # ----- balancing state ---------------------------------------------------------------------------

    def _host_value(self, name: str) -> float:
        """A 0-dim buffer as a Python float, read from the device only after it changed (the
        tensor version counts in-place writes, load_state_dict's included): no host sync per
        forward."""
        buf = getattr(self, name)
        cached = self._host_cache.get(name)
        if cached is None or cached[0] is not buf or cached[1] != buf._version:
            cached = (buf, buf._version, float(buf.item()))
            self._host_cache[name] = cached
        return cached[2]

    @property
    def capacity_factor(self) -> float | Fraction | None:
        """The capacity factor this forward uses: moe.capacity_factor, the dynamic one, or for
        expert choice the factor per candidate copy, capacity_factor * K / E (an exact
        Fraction: every token is a candidate of all E experts)."""
        c = self.config
        if c.is_expert_choice:
            return Fraction(str(c.capacity_factor)) * c.top_k / c.num_experts
        if c.dynamic_capacity:
            return self.dynamic_capacity_factor
        return c.capacity_factor

    @property
    def dynamic_capacity_factor(self) -> float:
        """The factor ``moe.dynamic_capacity`` moves (set by the balancer's interval updates)."""
        return self._host_value("capacity_factor_now")

    @property
    def aux_loss_coef(self) -> float:
        if self.config.collapse_aux_increase > 0:
            return self._host_value("aux_loss_coef_now")
        return self.config.aux_loss_coef

    def capacity(self, num_tokens: int) -> int | None:
        c = self.config
        factor = self.capacity_factor
        if factor is None:
            return None
        top_k = c.num_experts if c.is_expert_choice else c.top_k
        return expert_capacity(num_tokens, num_experts=c.num_experts, top_k=top_k, capacity_factor=factor)

    # ----- forward -----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEAux]:
        """``x``: ``[..., D]``. ``token_mask``: bool, ``x``'s shape without D, True = a real token
        (the classifier's padding mask). Then only the real tokens are routed, dispatched and
        counted: padded positions get a zero output and no share of the aux losses or routing
        statistics, and the experts compute nothing for them. With a capacity factor every
        position is routed (capacity is a share of all of them)."""
        if token_mask is None or self.config.capacity_factor is not None:
            return self._forward(x)
        if token_mask.dtype != torch.bool or tuple(token_mask.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"token_mask ({token_mask.dtype} {list(token_mask.shape)}) must be a bool tensor of "
                             f"the input's shape without the model dim, {list(x.shape[:-1])}")
        x_TD = x.reshape(-1, self.dim)
        kept_N = token_mask.reshape(-1).nonzero().squeeze(1)  # host sync: the real-token count sizes the rest
        seq_len = x.shape[-2] if x.dim() >= 3 else x_TD.shape[0]
        out_ND, aux = self._forward(x_TD.index_select(0, kept_N), sequence_ids=torch.div(kept_N, seq_len,
                                    rounding_mode="floor"), num_sequences=x_TD.shape[0] // seq_len)
        return out_ND.new_zeros(x_TD.shape).index_copy(0, kept_N, out_ND).view_as(x), aux

    def _forward(self, x: torch.Tensor, *, sequence_ids: torch.Tensor | None = None,
                 num_sequences: int | None = None) -> tuple[torch.Tensor, MoEAux]:
        """``sequence_ids``: with a token mask, the sequence of each real token of ``x`` (``[N]``)."""
        c = self.config
        x_TD = x.reshape(-1, self.dim)
        num_tokens = x_TD.shape[0]
        # The router takes x as it comes (it computes in fp32 anyway); everything after it, the
        # dispatch payload, the experts, the shared experts and the combine, runs in the compute
        # dtype: the autocast dtype when autocast is on (the stream may still be fp32), else the
        # stream's own (bf16 when the parameters are).
        routing = self.router(x_TD)
        x_TD = to_autocast_dtype(x_TD)
        drop_policy = "score" if c.is_expert_choice else c.drop_policy
        # The dispatcher turns the factor into a capacity over the batch it decides drops for:
        # this layer's tokens, or the global batch under data/expert parallelism.
        # The shared experts (and their gate) do not read the routed rows: the dispatcher runs
        # them (in_flight) while those rows travel; their output is added here.
        in_flight = None if self.shared_experts is None else lambda: self._shared(x_TD)
        d = self.dispatcher.run_experts(x_TD, routing.idx_TK, routing.weights_TK, self.experts,
                                        capacity_factor=self.capacity_factor, drop_policy=drop_policy,
                                        in_flight=in_flight)
        out_TD = d.out_TD if d.overlapped is None else d.out_TD + d.overlapped

        z = router_z_loss(routing.logits_TE)
        if c.is_expert_choice:
            aux = self._expert_choice_aux(d, z, num_tokens)
        else:
            aux = self._token_choice_aux(x, routing, d, z, num_tokens, sequence_ids, num_sequences)
        if self.track_routing_stats and self.training:
            aux.routing_entropy = routing_entropy(routing.probs_TE.detach())
            aux.num_tokens = num_tokens
            if not self.stats_recorded_by_caller:
                self.record_step_stats(aux)
        return out_TD.view_as(x), aux

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared experts' output, times sigmoid(x w^T) per token with ``shared_gate``."""
        assert self.shared_experts is not None, "called only when the layer has shared experts"
        y_TD = self.shared_experts(x_TD)
        if self.shared_gate is None:
            return y_TD
        # The gate weight follows the activation dtype, as FeedForward's weights do.
        gate_T1 = torch.sigmoid(F.linear(x_TD, self.shared_gate.weight.to(x_TD.dtype)))
        return gate_T1 * y_TD

    def _token_choice_aux(self, x, routing, d, z, num_tokens: int, sequence_ids: torch.Tensor | None = None,
                          num_sequences: int | None = None) -> MoEAux:
        c = self.config
        local_routed_E = num_routed_E = d.num_routed_per_expert
        num_balance_tokens: int | torch.Tensor = num_tokens
        # Masked (real tokens only), the ranks hold different token counts: the global count is
        # the routed copies over K, and each rank's token means are taken over the mean count per
        # rank, so that the mean over ranks of their losses is still the global batch's loss.
        token_share: float | torch.Tensor = 1.0
        if self.balance_group is not None:
            num_routed_E = all_reduce_counts(num_routed_E, self.balance_group)
            world = dist.get_world_size(self.balance_group)
            if sequence_ids is None:
                num_balance_tokens = num_tokens * world
            else:
                num_balance_tokens = num_routed_E.sum().float() / c.top_k
                token_share = num_tokens * world / num_balance_tokens
                z = z * token_share
        with torch.no_grad():
            self.tokens_per_expert.copy_(num_routed_E)
        if c.aux_loss_type == "global_batch":
            lb = self._global_batch_loss(routing.probs_TE) * token_share
        elif c.aux_loss_type == "sequence" and sequence_ids is not None:
            assert num_sequences is not None, "a token mask gives both sequence_ids and num_sequences"
            lb = masked_sequence_load_balancing_loss(routing.probs_TE, routing.idx_TK, sequence_ids, num_sequences,
                                                     sequence_group=self.sequence_group)
        elif c.aux_loss_type == "sequence":
            seq_len = x.shape[-2] if x.dim() >= 3 else num_tokens
            B = num_tokens // seq_len
            lb = sequence_load_balancing_loss(routing.probs_TE.view(B, seq_len, -1),
                                              routing.idx_TK.view(B, seq_len, -1), sequence_group=self.sequence_group)
        else:
            lb = load_balancing_loss(routing.probs_TE, num_routed_E, top_k=c.top_k,
                                     num_tokens=num_balance_tokens) * token_share
        return MoEAux(loss=self.aux_loss_coef * lb + c.z_loss_coef * z, load_balancing=lb, z_loss=z,
                      num_routed_per_expert=num_routed_E, num_dropped=d.num_dropped,
                      num_routed=num_tokens * c.top_k, num_token_rank_sends=d.num_token_rank_sends,
                      local_routed_per_expert=local_routed_E)

    def _global_batch_loss(self, probs_TE: torch.Tensor) -> torch.Tensor:
        """``E * sum_e f_e * P_e``, f_e from the previous optimizer step's global counts and P_e
        over this forward's tokens (see ``MoEConfig.aux_loss_type``)."""
        if self.training and not self.balancing_installed:
            raise RuntimeError('moe.aux_loss_type "global_batch" takes f_e from the routing counts of the previous '
                               'optimizer step, which only the optimizer hook of moetrain.train.balancing.'
                               'install_balancing records: install it before training (the trainer does)')
        return frequency_load_balancing_loss(probs_TE, routed_frequencies(self.prev_step_routed_E))

    def _expert_choice_aux(self, d, z, num_tokens: int) -> MoEAux:
        c = self.config
        # Tokens no expert took: those without a kept copy.
        covered_T = torch.zeros(num_tokens, dtype=torch.bool, device=z.device)
        covered_T.index_fill_(0, d.token_idx_M.to(z.device), True)
        num_skipped = num_tokens - covered_T.sum()
        # Every token is a candidate of every expert, so over the global batch of W ranks each
        # expert takes exactly min(capacity, T * W) tokens: known without counting.
        world = dist.get_world_size(self.balance_group) if self.balance_group is not None else 1
        capacity = self.capacity(num_tokens * world)
        assert capacity is not None, "expert choice always has a capacity"
        taken = min(capacity, num_tokens * world)
        num_taken_E = torch.full((c.num_experts,), taken, dtype=torch.int64, device=z.device)
        with torch.no_grad():
            self.tokens_per_expert.copy_(num_taken_E)
        lb = torch.zeros((), dtype=torch.float32, device=z.device)  # balanced by construction
        return MoEAux(loss=c.z_loss_coef * z, load_balancing=lb, z_loss=z, num_routed_per_expert=num_taken_E,
                      num_dropped=num_skipped, num_routed=num_tokens,
                      local_routed_per_expert=d.num_routed_per_expert)

    @torch.no_grad()
    def record_step_stats(self, aux: MoEAux) -> None:
        """Add one training forward's routing counts (``aux``, with its ``routing_entropy``) to
        the step's statistics buffers."""
        # Under a checkpoint of the caller's own the forward runs again inside backward (eager: a
        # graph task is then executing); counting it twice would double the step's load. Dynamo
        # cannot trace that test: in compiled code the forward records only where no checkpoint
        # of moetrain's encloses it (apply_activation_checkpointing records after its checkpoint).
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        assert aux.routing_entropy is not None, "set by a forward that tracks routing statistics"
        self.step_routed_E.add_(aux.num_routed_per_expert)
        if aux.local_routed_per_expert is not None:
            self.trace_routed_E.add_(aux.local_routed_per_expert)
        self.step_local_stats[STAT_DROPPED] += aux.num_dropped.to(torch.float64)
        self.step_local_stats[STAT_ROUTED] += aux.num_routed
        self.step_local_stats[STAT_ENTROPY] += aux.routing_entropy.to(torch.float64)
        self.step_local_stats[STAT_TOKENS] += aux.num_tokens

