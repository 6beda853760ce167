"""A naive Mixture-of-Experts reference, written independently of ``moetrain.models.moe``.

It shares no code with the library: routing picks each token's experts with a Python sort,
capacity drops come from a plain Python loop over the token copies, and every kept copy goes
through its expert by indexing the stacked ``[E, D, F]`` weights, one token at a time. It is slow
on purpose; the tests use it on a few dozen tokens as the oracle for both expert paths.

Everything is computed in fp32 (inputs and weights are upcast), so for bf16 runs it is the
"exact" answer the bf16 layer is compared with under a loose tolerance.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F


def reference_capacity(num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """``ceil(factor * T * K / E)`` in exact rational arithmetic, the factor read as the decimal
    the user wrote (1.1 means 11/10, not the nearest double)."""
    return math.ceil(Fraction(str(capacity_factor)) * num_tokens * top_k / num_experts)


def reference_topk(probs_TE: torch.Tensor, top_k: int) -> list[list[int]]:
    """Each token's K best experts, best first; equal scores go to the lower expert id."""
    num_experts = probs_TE.shape[1]
    return [sorted(range(num_experts), key=lambda e: (-row[e], e))[:top_k] for row in probs_TE.tolist()]


def reference_keep(idx_TK: list[list[int]], weights_TK: list[list[float]], *, num_experts: int,
                   capacity: int | None, drop_policy: str) -> list[list[bool]]:
    """Which token copies an expert takes, by walking the copies one at a time.

    "position": tokens in order, an expert takes copies until it holds ``capacity``.
    "score": the same walk over the copies ordered by descending weight (ties: earlier token).
    """
    num_tokens, top_k = len(idx_TK), len(idx_TK[0])
    if capacity is None:
        return [[True] * top_k for _ in range(num_tokens)]
    copies = [(t, k) for t in range(num_tokens) for k in range(top_k)]
    if drop_policy == "score":
        copies = sorted(copies, key=lambda tk: -weights_TK[tk[0]][tk[1]])  # sorted() is stable
    taken = [0] * num_experts
    keep = [[False] * top_k for _ in range(num_tokens)]
    for t, k in copies:
        e = idx_TK[t][k]
        if taken[e] < capacity:
            taken[e] += 1
            keep[t][k] = True
    return keep


def reference_ffn(x_D: torch.Tensor, w1_DF: torch.Tensor, w2_FD: torch.Tensor, w3_DF: torch.Tensor | None,
                  activation: str) -> torch.Tensor:
    if activation == "swiglu":
        return (F.silu(x_D @ w1_DF) * (x_D @ w3_DF)) @ w2_FD
    return F.gelu(x_D @ w1_DF) @ w2_FD


@dataclass
class ReferenceResult:
    out: torch.Tensor
    """[..., D] in fp32."""
    idx_TK: list[list[int]]
    keep_TK: list[list[bool]]
    num_routed_per_expert: list[int]
    num_dropped: int
    load_balancing: torch.Tensor
    z_loss: torch.Tensor
    aux_loss: torch.Tensor


def reference_moe(x: torch.Tensor, params: dict[str, torch.Tensor], *, num_experts: int, top_k: int,
                  activation: str, renormalize: bool = True, capacity_factor: float | None = None,
                  drop_policy: str = "position", aux_loss_coef: float = 0.0,
                  z_loss_coef: float = 0.0) -> ReferenceResult:
    """MoE forward with the parameters named as in ``MoELayer.named_parameters()``.

    ``params``: ``router.gate.weight`` [E, D]; ``experts.w1`` [E, D, F], ``experts.w2`` [E, F, D],
    ``experts.w3`` (swiglu); optional ``shared_experts.w{1,2,3}.weight`` (``nn.Linear`` layout).
    """
    dim = x.shape[-1]
    x_TD = x.reshape(-1, dim).float()
    num_tokens = x_TD.shape[0]
    p = {name: w.float() for name, w in params.items()}

    # 1. Route: softmax over all experts, then the K best by a Python sort.
    logits_TE = x_TD @ p["router.gate.weight"].t()
    probs_TE = torch.softmax(logits_TE, dim=-1)
    idx_TK = reference_topk(probs_TE.detach(), top_k)
    rows_TK = [torch.stack([probs_TE[t, e] for e in idx_TK[t]]) for t in range(num_tokens)]
    if renormalize and top_k > 1:
        rows_TK = [row / row.sum() for row in rows_TK]

    # 2. Capacity, by walking the copies.
    capacity = None
    if capacity_factor is not None:
        capacity = reference_capacity(num_tokens, num_experts=num_experts, top_k=top_k,
                                      capacity_factor=capacity_factor)
    keep_TK = reference_keep(idx_TK, [row.tolist() for row in rows_TK], num_experts=num_experts,
                             capacity=capacity, drop_policy=drop_policy)

    # 3. Each kept copy through its expert, weighted sum per token.
    w3 = p.get("experts.w3")
    out_rows = []
    for t in range(num_tokens):
        acc_D = torch.zeros(dim)
        for k, e in enumerate(idx_TK[t]):
            if keep_TK[t][k]:
                y_D = reference_ffn(x_TD[t], p["experts.w1"][e], p["experts.w2"][e],
                                    w3[e] if w3 is not None else None, activation)
                acc_D = acc_D + rows_TK[t][k] * y_D
        out_rows.append(acc_D)
    out_TD = torch.stack(out_rows)
    if "shared_experts.w1.weight" in p:
        sw3 = p.get("shared_experts.w3.weight")
        shared_TD = reference_ffn(x_TD, p["shared_experts.w1.weight"].t(), p["shared_experts.w2.weight"].t(),
                                  sw3.t() if sw3 is not None else None, activation)
        out_TD = out_TD + shared_TD

    # 4. Aux losses: E * sum_e f_e * P_e (counts before drops) and mean(logsumexp^2).
    num_routed_E = [0] * num_experts
    for row in idx_TK:
        for e in row:
            num_routed_E[e] += 1
    f_E = torch.tensor([c / (num_tokens * top_k) for c in num_routed_E])
    load_balancing = num_experts * (f_E * probs_TE.mean(dim=0)).sum()
    z_loss = torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
    num_dropped = sum(not kept for row in keep_TK for kept in row)
    return ReferenceResult(out=out_TD.reshape(x.shape), idx_TK=idx_TK, keep_TK=keep_TK,
                           num_routed_per_expert=num_routed_E, num_dropped=num_dropped,
                           load_balancing=load_balancing, z_loss=z_loss,
                           aux_loss=aux_loss_coef * load_balancing + z_loss_coef * z_loss)


def reference_experts(x_MD: torch.Tensor, num_tokens_per_expert: list[int], params: dict[str, torch.Tensor],
                      activation: str) -> torch.Tensor:
    """``GroupedExperts`` by hand: row m goes through the expert whose block holds it."""
    expert_of_row = [e for e, n in enumerate(num_tokens_per_expert) for _ in range(n)]
    w3 = params.get("w3")
    rows = [reference_ffn(x_MD[m].float(), params["w1"][e].float(), params["w2"][e].float(),
                          w3[e].float() if w3 is not None else None, activation)
            for m, e in enumerate(expert_of_row)]
    return torch.stack(rows) if rows else x_MD.new_zeros(0, x_MD.shape[1]).float()
