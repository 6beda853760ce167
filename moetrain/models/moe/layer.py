"""The Mixture-of-Experts feed-forward layer: router -> dispatch -> experts -> combine.

Written for one device. Expert parallelism replaces ``self.dispatcher`` (and shards the expert
weights) afterwards, from ``moetrain.distributed``; nothing here changes.

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, E experts, K experts per token,
M token copies kept after capacity drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.models.feedforward import FeedForward
from moetrain.models.moe.balance import all_reduce_counts, load_balancing_loss, router_z_loss
from moetrain.models.moe.dispatcher import LocalDispatcher, expert_capacity
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.router import TopKRouter


@dataclass
class MoEAux:
    """What one MoE forward returns besides its output. All entries are tensors (no host sync)."""

    loss: torch.Tensor
    """aux_loss_coef * load_balancing + z_loss_coef * z_loss: add it to the training loss."""
    load_balancing: torch.Tensor
    z_loss: torch.Tensor
    num_routed_per_expert: torch.Tensor
    """Routed copies per global expert (int64, before drops), summed over ``balance_group``."""
    num_dropped: torch.Tensor
    """Copies dropped by capacity (0-dim)."""
    num_routed: int
    """T * K for this forward."""

    @property
    def dropped_fraction(self) -> torch.Tensor:
        return self.num_dropped.float() / max(self.num_routed, 1)


class MoELayer(nn.Module):
    """Token-choice top-k MoE FFN with optional capacity and shared experts.

    ``forward(x)`` takes ``[..., D]`` and returns ``(out [..., D], MoEAux)``.
    """

    def __init__(self, dim: int, config: MoEConfig) -> None:
        super().__init__()
        self.dim, self.config = dim, config
        self.router = TopKRouter(dim, config.num_experts, top_k=config.top_k,
                                 renormalize=config.renormalize, init_std=config.router_init_std)
        self.experts = GroupedExperts(dim, config.expert_hidden_dim, config.num_experts,
                                      activation=config.activation, impl=config.expert_impl)
        self.shared_experts = (FeedForward(dim, config.resolved_shared_hidden_dim, activation=config.activation)
                               if config.num_shared_experts > 0 else None)
        self.dispatcher = LocalDispatcher(config.num_experts)
        # Process group over which routing counts are summed before the load-balancing loss
        # (set by the data/expert-parallel wrappers). With it, the mean of the per-rank losses
        # equals the loss of one process holding the whole global batch.
        self.balance_group = None
        # Routed copies per expert in the last forward; read by metrics, never synced here.
        # int64 so a cast of the module to bf16 cannot round the counts.
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.int64),
                             persistent=False)

    def capacity(self, num_tokens: int) -> int | None:
        c = self.config
        if c.capacity_factor is None:
            return None
        return expert_capacity(num_tokens, num_experts=c.num_experts, top_k=c.top_k,
                               capacity_factor=c.capacity_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        c = self.config
        x_TD = x.reshape(-1, self.dim)
        num_tokens = x_TD.shape[0]
        routing = self.router(x_TD)
        d = self.dispatcher.dispatch(x_TD, routing.idx_TK, routing.weights_TK,
                                     capacity=self.capacity(num_tokens), drop_policy=c.drop_policy)
        y_MD = self.experts(d.x_MD, d.num_tokens_per_expert)
        out_TD = self.dispatcher.combine(y_MD, d.state)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)

        num_routed_E, num_balance_tokens = d.num_routed_per_expert, num_tokens
        if self.balance_group is not None:
            num_routed_E = all_reduce_counts(num_routed_E, self.balance_group)
            num_balance_tokens = num_tokens * dist.get_world_size(self.balance_group)
        with torch.no_grad():
            self.tokens_per_expert.copy_(num_routed_E)
        lb = load_balancing_loss(routing.probs_TE, num_routed_E, top_k=c.top_k, num_tokens=num_balance_tokens)
        z = router_z_loss(routing.logits_TE)
        aux = MoEAux(loss=c.aux_loss_coef * lb + c.z_loss_coef * z, load_balancing=lb, z_loss=z,
                     num_routed_per_expert=num_routed_E, num_dropped=d.num_dropped,
                     num_routed=num_tokens * c.top_k)
        return out_TD.view_as(x), aux
