"""Config of the Mixture-of-Experts feed-forward layer."""

from __future__ import annotations

from dataclasses import dataclass

import math

from moetrain.config._checks import require_int
from moetrain.config.base import require, require_choice, require_non_negative, require_positive


@dataclass
class MoEConfig:
    num_experts: int = 8
    """Number of routed experts E in each MoE layer."""

    top_k: int = 2
    """Experts each token is sent to (K). Must be <= num_experts."""

    expert_hidden_dim: int = 256
    """Hidden size F of each routed expert's FFN."""

    activation: str = "gelu"
    """Expert FFN type: "gelu" (two matrices) or "swiglu" (three, Llama/Mixtral style)."""

    capacity_factor: float | None = None
    """None = dropless. Otherwise each expert takes at most ceil(factor * T * K / E) token copies per
    forward; the rest are dropped (zero expert output, the residual carries the token)."""

    drop_policy: str = "position"
    """Which overflow copies are dropped in capacity mode: "position" keeps the earliest tokens,
    "score" keeps the copies with the highest router weight."""

    renormalize: bool = True
    """Rescale the K selected router weights of a token to sum to 1 (Mixtral). False keeps the raw
    softmax probabilities (Switch/GShard). Ignored for top_k=1: a weight fixed at 1.0 would leave
    the router without any gradient from the language-model loss."""

    router_init_std: float = 0.02
    """Std of the normal init of the router weight. Small, so that routing starts near uniform."""

    num_shared_experts: int = 0
    """Always-on dense experts added to the routed output (DeepSeek/Qwen style). 0 = none."""

    shared_hidden_dim: int | None = None
    """Hidden size of the shared-expert FFN; None = num_shared_experts * expert_hidden_dim."""

    aux_loss_coef: float = 0.01
    """Coefficient of the Switch/GShard load-balancing loss E * sum_e f_e * P_e."""

    z_loss_coef: float = 0.001
    """Coefficient of the router z-loss mean(logsumexp(logits)^2) (ST-MoE)."""

    expert_impl: str = "grouped"
    """"grouped": all experts in one torch._grouped_mm (fast path). "loop": one matmul per expert
    (the test oracle; also the fallback where grouped_mm is unavailable)."""

    def __post_init__(self) -> None:
        require_int("moe.num_experts", self.num_experts, min_value=1)
        require_int("moe.top_k", self.top_k, min_value=1)
        require(self.top_k <= self.num_experts, "moe.top_k", self.top_k,
                f"must be <= moe.num_experts ({self.num_experts})")
        require_int("moe.expert_hidden_dim", self.expert_hidden_dim, min_value=1)
        require_choice("moe.activation", self.activation, ("gelu", "swiglu"))
        if self.capacity_factor is not None:
            require_positive("moe.capacity_factor", self.capacity_factor)
            require(math.isfinite(self.capacity_factor), "moe.capacity_factor", self.capacity_factor,
                    "must be finite (use null for dropless)")
        require_choice("moe.drop_policy", self.drop_policy, ("position", "score"))
        require_positive("moe.router_init_std", self.router_init_std)
        require_int("moe.num_shared_experts", self.num_shared_experts, min_value=0)
        require_int("moe.shared_hidden_dim", self.shared_hidden_dim, min_value=1, none_ok=True)
        require_non_negative("moe.aux_loss_coef", self.aux_loss_coef)
        require_non_negative("moe.z_loss_coef", self.z_loss_coef)
        require_choice("moe.expert_impl", self.expert_impl, ("grouped", "loop"))

    @property
    def resolved_shared_hidden_dim(self) -> int:
        if self.shared_hidden_dim is not None:
            return self.shared_hidden_dim
        return self.num_shared_experts * self.expert_hidden_dim
