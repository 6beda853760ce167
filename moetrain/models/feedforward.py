"""Dense feed-forward block, used by dense transformer blocks and as the MoE shared expert.

Shape legend: T tokens, D model dim, F hidden dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ComputeDtypeLinear(nn.Linear):
    """``nn.Linear`` whose weight follows the input's dtype: bf16 compute over fp32 master weights
    (the cast's backward brings the gradient back in fp32), as the routed experts do. Under
    autocast, or when the dtypes already agree, the cast is a no-op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight.to(x.dtype), bias)


class FeedForward(nn.Module):
    """``gelu(x W1) W2`` or SwiGLU ``(silu(x W1) * x W3) W2``, without biases.

    The projections are modules (``w1``, ``w2``, ``w3``), so fine-tuning can swap them for
    adapter-carrying ones (``moetrain.models.lora``) without touching this forward."""

    def __init__(self, dim: int, hidden_dim: int, *, activation: str = "gelu", init_std: float = 0.02) -> None:
        super().__init__()
        self.activation, self.init_std = activation, init_std
        self.w1 = ComputeDtypeLinear(dim, hidden_dim, bias=False)
        self.w2 = ComputeDtypeLinear(hidden_dim, dim, bias=False)
        self.w3 = ComputeDtypeLinear(dim, hidden_dim, bias=False) if activation == "swiglu" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w2, self.w3):
            if lin is not None:
                nn.init.normal_(lin.weight, std=self.init_std)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x_TD)) * self.w3(x_TD))
        return self.w2(F.gelu(self.w1(x_TD)))
