"""Naive references for the routers, written independently of ``moetrain.models.moe``.

Every selection is a Python ``sorted`` over plain lists, every expert is applied one token at a
time (``moe_reference.reference_ffn``), and the learning-rate compensation is checked against
torch's own AdamW with one parameter (and one learning rate) per expert.

Shape legend: T tokens, D model dim, E experts, K experts per token.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from tests.helpers.moe_reference import reference_ffn


def ranked(scores: list[float]) -> list[int]:
    """Expert ids by descending score; equal scores: the lower id first."""
    return sorted(range(len(scores)), key=lambda e: (-scores[e], e))


def group_limited_candidates(select: list[float], *, num_groups: int, top_groups: int) -> list[int]:
    """Experts a token may use under two-level routing: those of its ``top_groups`` best groups,
    a group scoring the sum of its two best selection scores (ties: the lower group id)."""
    size = len(select) // num_groups
    group_scores = []
    for g in range(num_groups):
        members = sorted((select[e] for e in range(g * size, (g + 1) * size)), reverse=True)
        group_scores.append(sum(members[:2]))
    groups = sorted(range(num_groups), key=lambda g: (-group_scores[g], g))[:top_groups]
    return [e for g in groups for e in range(g * size, (g + 1) * size)]


def token_choice_routes(logits_TE: torch.Tensor, *, top_k: int, score_func: str = "softmax",
                        bias: list[float] | None = None, num_groups: int = 1, top_groups: int = 1,
                        renormalize: bool = True) -> list[list[tuple[int, torch.Tensor]]]:
    """Per token, its (expert, gate weight) pairs. The weights are autograd expressions of the
    logits; the selection uses plain floats (scores + bias, limited to the chosen groups)."""
    routes = []
    for row in logits_TE:
        scores = torch.softmax(row, dim=-1) if score_func == "softmax" else torch.sigmoid(row)
        select = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores.tolist())]
        allowed = set(range(len(select)))
        if num_groups > 1:
            allowed = set(group_limited_candidates(select, num_groups=num_groups, top_groups=top_groups))
        chosen = [e for e in ranked(select) if e in allowed][:top_k]
        weights = [scores[e] for e in chosen]
        if renormalize and top_k > 1:
            total = sum(weights)
            weights = [w / total for w in weights]
        routes.append(list(zip(chosen, weights, strict=True)))
    return routes


def expert_choice_routes(logits_TE: torch.Tensor, *, capacity_factor: float, top_k: int
                         ) -> tuple[list[list[tuple[int, torch.Tensor]]], int]:
    """Each expert takes its ``ceil(factor * T * K / E)`` best tokens by softmax score (ties: the
    earlier token). Returns each token's (expert, weight) pairs and that capacity."""
    T, E = logits_TE.shape
    probs_TE = torch.softmax(logits_TE, dim=-1)
    capacity = math.ceil(Fraction(str(capacity_factor)) * T * top_k / E)
    routes: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(T)]
    for e in range(E):
        column = probs_TE[:, e].tolist()
        for t in sorted(range(T), key=lambda t: (-column[t], t))[:capacity]:
            routes[t].append((e, probs_TE[t, e]))
    return routes, capacity


def apply_routes(x_TD: torch.Tensor, routes, params: dict[str, torch.Tensor], activation: str) -> torch.Tensor:
    """``out[t] = sum over t's routes of w * expert_e(x_t)`` (+ the shared experts)."""
    w3 = params.get("experts.w3")
    rows = []
    for t, pairs in enumerate(routes):
        acc = torch.zeros(x_TD.shape[1])
        for e, w in pairs:
            acc = acc + w * reference_ffn(x_TD[t], params["experts.w1"][e], params["experts.w2"][e],
                                          w3[e] if w3 is not None else None, activation)
        rows.append(acc)
    out_TD = torch.stack(rows)
    if "shared_experts.w1.weight" in params:
        sw3 = params.get("shared_experts.w3.weight")
        out_TD = out_TD + reference_ffn(x_TD, params["shared_experts.w1.weight"].t(),
                                        params["shared_experts.w2.weight"].t(),
                                        sw3.t() if sw3 is not None else None, activation)
    return out_TD


def sequence_balance_loss(probs_BSE: list[list[list[float]]], idx_BSK: list[list[list[int]]]) -> float:
    """DeepSeek-V3's sequence-wise loss by loops: mean over sequences of E * sum_e f_e * P_e."""
    total = 0.0
    for probs_SE, idx_SK in zip(probs_BSE, idx_BSK, strict=True):
        S, E, K = len(probs_SE), len(probs_SE[0]), len(idx_SK[0])
        f = [sum(row.count(e) for row in idx_SK) / (S * K) for e in range(E)]
        P = [sum(row[e] for row in probs_SE) / S for e in range(E)]
        total += E * sum(fe * pe for fe, pe in zip(f, P, strict=True))
    return total / len(probs_BSE)
