"""Forced skewed routing for benchmarks (``moe.force_skew``): expert ids for every token of a step's
global batch, the same whatever the parallel layout.

Shape legend: T tokens of the global batch, E experts, K experts per token.
"""

from __future__ import annotations

import torch


def skew_weights(kind: str, params: tuple, *, step: int, num_experts: int) -> torch.Tensor:
    """``[E]`` fp64 sampling weights (summing to 1) of ``moe.force_skew`` at ``step``:
    "zipf" (S,): ``(e + 1)^-S``; "hot" (K, FRACTION): FRACTION / K for experts 0..K-1, the rest
    spread evenly; "drift" (S, PERIOD): zipf:S rolled up by ``(step - 1) // PERIOD`` ids."""
    e_E = torch.arange(num_experts, dtype=torch.float64)
    if kind in ("zipf", "drift"):
        w_E = (e_E + 1) ** -params[0]
        if kind == "drift":
            w_E = torch.roll(w_E, ((step - 1) // params[1]) % num_experts)
    elif kind == "hot":
        hot, fraction = params
        w_E = torch.where(e_E < hot, fraction / hot, (1 - fraction) / (num_experts - hot)).double()
    else:
        raise ValueError(f"moe.force_skew kind {kind!r} has no weights (zipf, hot or drift)")
    return w_E / w_E.sum()


def skewed_assignment(weights_E: torch.Tensor, *, num_tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """``idx_TK`` int64: each token's K distinct experts, drawn without replacement with probabilities
    proportional to ``weights_E`` (the Gumbel top-k trick), from a CPU generator seeded by ``seed``
    alone: the same ids on every rank and at every layout."""
    gen = torch.Generator().manual_seed(seed)
    u_TE = torch.rand(num_tokens, weights_E.numel(), generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    keys_TE = weights_E.log() - (-u_TE.log()).log()
    return keys_TE.topk(top_k, dim=-1).indices


def skew_seed(step: int, layer: int) -> int:
    """A generator seed per (step, MoE layer): distinct layers draw independent assignments."""
    return (step * 1_000_003 + layer * 7_919) % (2**63 - 1)
