"""Expert-health statistics: per MoE layer, how evenly the experts are used.

Pure functions of routing counts (no state, no communication); ``moetrain.train.balancing``
accumulates the counts and calls them once per log step.

Shape legend: L MoE layers, E experts.
"""

from __future__ import annotations

import math

import torch

from moetrain.train.metrics import expert_load_summary


def token_fraction(counts_LE: torch.Tensor, tokens_L: torch.Tensor) -> torch.Tensor:
    """Fraction of each layer's tokens that chose each expert (copies / tokens): with top-k each
    token is one copy of k experts, so the fractions sum to k, and a perfectly balanced layer
    gives every expert k/E. The collapse alarm compares the largest with its threshold."""
    return counts_LE.double() / tokens_L.double().clamp(min=1e-12).unsqueeze(-1)


def load_entropy(counts_LE: torch.Tensor) -> torch.Tensor:
    """Entropy of each layer's expert shares divided by ln(E): 1.0 = perfectly even load, 0.0 =
    one expert takes everything."""
    share_LE = counts_LE.double() / counts_LE.double().sum(dim=1, keepdim=True).clamp(min=1e-12)
    ent_L = -(share_LE * torch.log(share_LE.clamp(min=1e-300))).sum(dim=1)
    num_experts = counts_LE.shape[1]
    return ent_L / math.log(num_experts) if num_experts > 1 else torch.ones_like(ent_L)


def expert_health_summary(counts_LE: torch.Tensor, *, dropped_L: torch.Tensor, routed_L: torch.Tensor,
                          entropy_sum_L: torch.Tensor, tokens_L: torch.Tensor, idle_steps_LE: torch.Tensor,
                          unused_after: int) -> dict:
    """Metrics for the routed counts of a window of steps (all summed over ranks).

    ``counts_LE``: routed copies per expert; ``dropped_L``/``routed_L``: dropped and routed
    copies (expert choice: skipped tokens and tokens); ``entropy_sum_L``: the sum over tokens of
    the router's per-token score entropy; ``tokens_L``: tokens; ``idle_steps_LE``: consecutive
    optimizer steps without a token, per expert, now.

    Returns (lists per layer): ``expert_share``, ``load_cv``, ``load_max_over_mean`` (see
    ``expert_load_summary``), ``max_token_fraction``, ``routing_entropy`` (mean nats per token;
    ln E = undecided router), ``load_entropy`` (1 = even), ``dropped_fraction``,
    ``unused_experts`` (ids idle for >= ``unused_after`` steps) and ``num_unused_experts``.
    """
    m = expert_load_summary(counts_LE)
    tokens_L = tokens_L.double()
    m["max_token_fraction"] = _rounded(token_fraction(counts_LE, tokens_L).max(dim=1).values)
    m["routing_entropy"] = _rounded(entropy_sum_L.double() / tokens_L.clamp(min=1e-12))
    m["load_entropy"] = _rounded(load_entropy(counts_LE))
    m["dropped_fraction"] = _rounded(dropped_L.double() / routed_L.double().clamp(min=1e-12))
    unused = [torch.nonzero(row >= unused_after).flatten().tolist() for row in idle_steps_LE]
    m["unused_experts"] = unused
    m["num_unused_experts"] = [len(u) for u in unused]
    return m


def _rounded(t: torch.Tensor) -> list[float]:
    return [round(v, 5) for v in t.tolist()]
