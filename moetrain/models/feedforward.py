"""Dense feed-forward block, used by dense transformer blocks and as the MoE shared expert.

Shape legend: T tokens, D model dim, F hidden dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """``gelu(x W1) W2`` or SwiGLU ``(silu(x W1) * x W3) W2``, without biases."""

    def __init__(self, dim: int, hidden_dim: int, *, activation: str = "gelu", init_std: float = 0.02) -> None:
        super().__init__()
        self.activation, self.init_std = activation, init_std
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False) if activation == "swiglu" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w2, self.w3):
            if lin is not None:
                nn.init.normal_(lin.weight, std=self.init_std)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        # Weights follow the activation dtype (bf16 compute over fp32 master weights), as the
        # routed experts do; under autocast this cast is a no-op.
        w1, w2 = self.w1.weight.to(x_TD.dtype), self.w2.weight.to(x_TD.dtype)
        if self.w3 is not None:
            return F.linear(F.silu(F.linear(x_TD, w1)) * F.linear(x_TD, self.w3.weight.to(x_TD.dtype)), w2)
        return F.linear(F.gelu(F.linear(x_TD, w1)), w2)
