"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come out of one low-rank latent
per token, and only a small slice of each head carries rotary positions.

Per token: the latent ``c = kv_norm(x @ wkv_a)[:R]`` (rank R) expands into every head's
no-position key part and value (``wkv_b``); the last P features of ``x @ wkv_a`` are one rotary
key part shared by all heads. Queries come from ``wq`` or, with ``q_lora_rank``, through their
own latent (``wq_b(q_norm(wq_a(x)))``). Each head scores ``[q_nope, q_rope] . [k_nope, k_rope]``
with scale ``1/sqrt(N + P)`` (times yarn's ``softmax_multiplier``); the output projection reads H
heads of U value features.

For decoding, a ``LatentCache`` keeps per token only the normalised latent and the rotated rotary
key (R + P numbers), and attention runs in the absorbed form (``_attend_latent``).

Shape legend: B batch, S sequence (queries), K keys (= S; with a cache, every cached position), D
model dim, H heads, Q query latent rank, R key/value latent rank, N no-position (nope) q/k head
dim, P rotary head dim, U value head dim, X = R + P latent key features.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.models.attention import RMSNorm, apply_rope, attend
from moetrain.models.kv_cache import LatentCache

LATENT_NORM_EPS = 1e-6
"""Epsilon of the q and kv latent norms. DeepSeek's reference code and transformers build them with
their RMSNorm's default 1e-6 whatever ``rms_norm_eps`` says, so checkpoints were trained with it."""


class MultiHeadLatentAttention(nn.Module):
    """Self-attention through a key/value latent. Parameters: ``wq [H*(N+P), D]`` (no q latent) or
    ``wq_a [Q, D]``, ``q_norm [Q]``, ``wq_b [H*(N+P), Q]``; ``wkv_a [R+P, D]``, ``kv_norm [R]``,
    ``wkv_b [H*(N+U), R]``, ``wo [D, H*U]``."""

    def __init__(self, dim: int, *, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope_interleave: bool = False,
                 causal: bool = True, softmax_scale: float | None = None) -> None:
        super().__init__()
        # None = 1/sqrt(N + P); DeepSeek's yarn (mscale_all_dim) sharpens it for the long context.
        self.softmax_scale = softmax_scale
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_interleave, self.causal = rope_interleave, causal
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.wq = nn.Linear(dim, num_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, num_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(num_heads * v_head_dim, dim, bias=False)

    def new_cache(self, batch_size: int, *, max_len: int, dtype: torch.dtype, device: torch.device) -> LatentCache:
        """An empty ``LatentCache``: R + P numbers per position, shared by the H heads."""
        return LatentCache(batch_size, kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim, max_len=max_len,
                           dtype=dtype, device=device)

    def forward(self, x_BSD: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor,
                mask_B1SK: torch.Tensor | None = None, cache: LatentCache | None = None) -> torch.Tensor:
        """``cos_SP, sin_SP``: the rotary angles of the P rotary features (``ModelConfig.rope_dim``)
        at the S positions of ``x_BSD``. ``cache``: the S new latents are appended to it and the
        queries attend over every cached position (``_attend_latent``); ``mask_B1SK`` is then
        ``DecodeCache.begin``'s."""
        B, S, _ = x_BSD.shape
        H, R, N, P, U = self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim
        # 1. Queries: every head's no-position and rotary parts.
        if self.q_lora_rank is None:
            q = self.wq(x_BSD)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_nope_BHSN, q_rope_BHSP = q.view(B, S, H, N + P).transpose(1, 2).split([N, P], dim=-1)
        q_rope_BHSP = apply_rope(q_rope_BHSP, cos_SP, sin_SP, interleave=self.rope_interleave)
        # 2. The key/value latent and the rotary key part all heads share.
        c_BSR, k_rope_BSP = self.wkv_a(x_BSD).split([R, P], dim=-1)
        k_rope_B1KP = apply_rope(k_rope_BSP[:, None], cos_SP, sin_SP, interleave=self.rope_interleave)
        if cache is not None:
            return self._attend_latent(q_nope_BHSN, q_rope_BHSP, self.kv_norm(c_BSR), k_rope_B1KP[:, 0],
                                       mask_B1SK, cache)
        # 3. Each head's no-position key part and value out of the normalised latent.
        kv_BHKX = self.wkv_b(self.kv_norm(c_BSR)).view(B, S, H, N + U).transpose(1, 2)
        k_nope_BHKN, v_BHKU = kv_BHKX.split([N, U], dim=-1)
        # 4. Attention over [nope, rope] features (scale 1/sqrt(N + P)), then the output projection.
        q_BHSA = torch.cat([q_nope_BHSN, q_rope_BHSP], dim=-1)
        k_BHKA = torch.cat([k_nope_BHKN, k_rope_B1KP.expand(B, H, S, P)], dim=-1)
        o_BHSU = attend(q_BHSA, k_BHKA, v_BHKU, mask_B1SK, causal=self.causal, scale=self.softmax_scale)
        return self.wo(o_BHSU.transpose(1, 2).reshape(B, S, H * U))

    def _attend_latent(self, q_nope_BHSN: torch.Tensor, q_rope_BHSP: torch.Tensor, c_BSR: torch.Tensor,
                       k_rope_BSP: torch.Tensor, mask_B1SK: torch.Tensor | None, cache: LatentCache) -> torch.Tensor:
        """Attention over the cached latents in the absorbed form (DeepSeek's inference code):
        ``q_nope . k_nope = q_nope . (W_uk c) = (W_uk^T q_nope) . c``, so each head's query moves
        into the latent space and the keys are the cached ``[c, k_rope]`` themselves, one key "head"
        that all H query heads share (multi-query over R + P features, scale still 1/sqrt(N + P));
        the values likewise: ``o = W_uv (attn . c)``. Nothing per head is ever expanded over the
        cached positions. Equal to ``forward``'s expanded form up to the order of the sums."""
        B, H, S, _ = q_nope_BHSN.shape
        N, P, U, R = self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank
        c_BKR, k_rope_BKP = cache.update(c_BSR, k_rope_BSP)
        if cache.absorbed is None:
            # The up-projection as the module applies it (an adapter-wrapped one too): the identity
            # through it is W^T exactly. Taken once per cache: the weights do not change while decoding.
            w_RHX = self.wkv_b(torch.eye(R, dtype=c_BKR.dtype, device=c_BKR.device)).view(R, H, N + U)
            cache.absorbed = (w_RHX[..., :N].permute(1, 2, 0), w_RHX[..., N:].permute(1, 2, 0))
        w_uk_HNR, w_uv_HUR = cache.absorbed
        q_latent_BHSR = torch.einsum("bhsn,hnr->bhsr", q_nope_BHSN, w_uk_HNR)
        q_BHSX = torch.cat([q_latent_BHSR, q_rope_BHSP], dim=-1)
        k_B1KX = torch.cat([c_BKR, k_rope_BKP], dim=-1)[:, None]
        scale = 1 / math.sqrt(N + P) if self.softmax_scale is None else self.softmax_scale
        o_latent_BHSR = attend(q_BHSX, k_B1KX, c_BKR[:, None], mask_B1SK, causal=S > 1, scale=scale)
        o_BHSU = torch.einsum("bhsr,hur->bhsu", o_latent_BHSR, w_uv_HUR)
        return self.wo(o_BHSU.transpose(1, 2).reshape(B, S, H * U))
