"""Hashed n-gram embeddings (``model.ngram_buckets``): fastText's bigram/trigram features for a classifier.

At each position s and for each order n in 2..``max_order``, the n token ids ending at s
(``ids[s-n+1 .. s]``) are hashed into one of ``num_buckets`` rows of a table shared by the orders;
the rows of all orders are summed and added to the token embedding of s. The model then sees which
words stand next to each other before any attention, as a bag of n-grams does.

The hash, in exact int64 arithmetic (no overflow, so the same ids on every device and in a plain
Python reimplementation):

    g_t = ids[t] + 1 for t >= 0, and g_t = 0 before the sequence start (t < 0)
    h = n;  for t = s-n+1 .. s:  h = (h * MULTIPLIER + g_t) mod MODULUS
    bucket = h mod num_buckets

Positions before the start hash as id "-1" (g = 0), a beginning-of-text id no token has: the first
tokens still get every order, and "word w opens the text" is a feature of its own. The order is the
hash's start value: without it a trigram that begins before the start (g = 0 first) would hash
exactly as the bigram it ends with. Only earlier positions enter an n-gram, so with right padding (real tokens
first) a real position's features never contain a padding id.

Shape legend: B batch, S sequence, D model dim, O orders (max_order - 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config.model import NGRAM_MODULUS, ModelConfig

MULTIPLIER = 116049371
"""fastText's n-gram hash multiplier (odd): h * MULTIPLIER + g < 2**63 for h < MODULUS and g < 2**31."""
MODULUS = NGRAM_MODULUS
"""2**31 - 1, a (Mersenne) prime: every step of the hash stays below 2**31 before it is multiplied."""


def ngram_buckets(ids_BS: torch.Tensor, *, num_buckets: int, max_order: int) -> torch.Tensor:
    """``[B, S, O]`` int64 bucket of the n-gram ending at each position, for n = 2 .. ``max_order``
    (the module docstring's hash); computed on the ids' device with tensor ops only."""
    g_BS = ids_BS.long() + 1
    S = g_BS.shape[1]
    # back[k][:, s] = g_{s-k}: the ids k places back, 0 before the start.
    back = [g_BS] + [F.pad(g_BS, (k, 0))[:, :S] for k in range(1, max_order)]
    buckets = []
    for n in range(2, max_order + 1):
        h_BS = torch.full_like(g_BS, n)
        for k in range(n - 1, -1, -1):  # oldest token first
            h_BS = torch.remainder(h_BS * MULTIPLIER + back[k], MODULUS)
        buckets.append(torch.remainder(h_BS, num_buckets))
    return torch.stack(buckets, dim=-1)


class NgramEmbedding(nn.Embedding):
    """``forward(ids_BS) -> [B, S, D]``: the sum over the orders of the hashed n-grams' rows of a
    ``[num_buckets, D]`` table. An ``nn.Embedding`` so that it is treated as one (AdamW, never Muon);
    ``moetrain.models.init`` starts it at zero."""

    def __init__(self, num_buckets: int, dim: int, *, max_order: int) -> None:
        super().__init__(num_buckets, dim)
        self.max_order = max_order

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        buckets_BSO = ngram_buckets(ids_BS, num_buckets=self.num_embeddings, max_order=self.max_order)
        return super().forward(buckets_BSO).sum(dim=2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_order={self.max_order}"


def ngram_embedding(config: ModelConfig) -> NgramEmbedding | None:
    """The table ``config.ngram_buckets`` asks for, or None when it is 0 (no parameter, no name)."""
    if config.ngram_buckets == 0:
        return None
    return NgramEmbedding(config.ngram_buckets, config.dim, max_order=config.ngram_max_order)
