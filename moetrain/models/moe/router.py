"""Token-choice top-k router.

Shape legend: T tokens, D model dim, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RouterOutput:
    weights_TK: torch.Tensor
    """Gate weight of each selected expert (fp32)."""
    idx_TK: torch.Tensor
    """Selected expert ids (int64), best first; ties go to the lower expert id."""
    probs_TE: torch.Tensor
    """Softmax scores over all experts (fp32); used by the load-balancing loss."""
    logits_TE: torch.Tensor
    """Raw router logits (fp32); used by the z-loss."""


class TopKRouter(nn.Module):
    """Softmax over a linear projection, then the top-k experts per token."""

    def __init__(self, dim: int, num_experts: int, *, top_k: int, renormalize: bool = True,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.init_std = init_std
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate.weight, std=self.init_std)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        # Routing runs in fp32 whatever the compute dtype: in bf16 nearby scores collapse to
        # equal values, so top-k flips between runs, layouts and ranks, and the softmax of the
        # z-loss overflows sooner.
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        probs_TE = torch.softmax(logits_TE, dim=-1)
        # A stable descending sort instead of topk: torch.topk does not specify the order of
        # equal scores; here ties always go to the lower expert id, on every device.
        sorted_TE, order_TE = torch.sort(probs_TE, dim=-1, descending=True, stable=True)
        weights_TK = sorted_TE[:, : self.top_k]
        idx_TK = order_TE[:, : self.top_k]
        if self.renormalize and self.top_k > 1:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return RouterOutput(weights_TK=weights_TK, idx_TK=idx_TK, probs_TE=probs_TE, logits_TE=logits_TE)
