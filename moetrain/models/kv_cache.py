"""Decoding caches: what each attention layer keeps of the tokens it has seen, so that generating
one more token costs a forward over that token alone (``Transformer.new_cache``).

- ``KVCache`` (grouped-query attention): keys and values ``[B, G, K, A]``, preallocated to the
  cache's capacity in the compute dtype. G key/value heads are stored, not the H query heads: a
  grouped-query model's cache is H/G times smaller, which is the point of grouped-query attention.
- ``LatentCache`` (multi-head latent attention): the normalised key/value latent ``[B, K, R]`` and
  the rotated rotary key ``[B, K, P]`` that all heads share, not the per-head keys and values that
  transformers caches (``[B, H, K, N + P]`` and ``[B, H, K, U]``). Per token that is R + P numbers
  instead of H * (N + P + U): 576 instead of 40,960 for DeepSeek-V3, the reason latent attention
  exists. The attention then runs in the latent ("absorbed") form, see ``mla.py``.
- ``DecodeCache``: one of the above per block, the number of cached positions (the rotary offset
  of the next token), and for packed-document models the document each cached position belongs to.

A cache holds the keys of the weights it was filled with; it is invalid after a forward that raised.

Shape legend: B batch, S new tokens, K cached positions (capacity, or filled so far), G key/value
heads, A head dim, R key/value latent rank, P rotary dims, H heads, N no-position q/k head dim,
U value head dim.
"""

from __future__ import annotations

import torch

from moetrain.config.base import require


class KVCache:
    """One attention layer's keys and values, preallocated: ``k_BGKA``, ``v_BGKA`` of capacity K."""

    def __init__(self, batch_size: int, *, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k_BGKA = torch.zeros(shape, dtype=dtype, device=device)
        self.v_BGKA = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        """Positions filled so far."""

    def update(self, k_BGSA: torch.Tensor, v_BGSA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the S new positions after the filled ones (in the cache's dtype: under autocast a
        q/k norm can hand over fp32 keys that attention would cast anyway); return views of every
        filled position ``[B, G, length, A]`` (no copy)."""
        start, end = self.length, self.length + k_BGSA.shape[2]
        self.k_BGKA[:, :, start:end] = k_BGSA
        self.v_BGKA[:, :, start:end] = v_BGSA
        self.length = end
        return self.k_BGKA[:, :, :end], self.v_BGKA[:, :, :end]


class LatentCache:
    """One latent-attention layer's normalised latents ``c_BKR`` and rotated rotary keys
    ``k_rope_BKP``, preallocated; plus ``absorbed``, the layer's key/value up-projection split per
    head (``w_uk_HNR``, ``w_uv_HUR``), taken once from the weights the cache is filled with."""

    def __init__(self, batch_size: int, *, kv_lora_rank: int, rope_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.c_BKR = torch.zeros(batch_size, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.k_rope_BKP = torch.zeros(batch_size, max_len, rope_dim, dtype=dtype, device=device)
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.length = 0
        """Positions filled so far."""

    def update(self, c_BSR: torch.Tensor, k_rope_BSP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the S new positions after the filled ones; return views of every filled position."""
        start, end = self.length, self.length + c_BSR.shape[1]
        self.c_BKR[:, start:end] = c_BSR
        self.k_rope_BKP[:, start:end] = k_rope_BSP
        self.length = end
        return self.c_BKR[:, :end], self.k_rope_BKP[:, :end]


class DecodeCache:
    """Every block's cache plus the bookkeeping of the positions: ``begin`` before each forward."""

    def __init__(self, layers: list[KVCache | LatentCache], *, batch_size: int, max_len: int,
                 document_separator: int | None, device: torch.device) -> None:
        self.layers, self.batch_size, self.max_len = layers, batch_size, max_len
        self.document_separator = document_separator
        self.num_cached = 0
        """Positions cached: the absolute position (rotary angle) of the next token."""
        # Document of each cached position, and separators seen per sequence (packed documents only).
        self.doc_BK = torch.zeros(batch_size, max_len, dtype=torch.int64, device=device)
        self.num_seps_B = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def begin(self, input_ids_BS: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Claim positions ``[start, start + S)`` for the next forward: returns ``start`` and the mask
        of those S queries over every key ``[0, start + S)`` (True = may attend), or None where no
        mask is needed: an empty cache (SDPA's causal alignment is then right) or a single new token
        (it sees every cached key). The attention layers rely on exactly that: no mask means causal
        when S > 1, everything visible when S == 1."""
        B, S = input_ids_BS.shape
        start, end = self.num_cached, self.num_cached + S
        require(B == self.batch_size, "input batch size", B, f"must be the cache's batch size ({self.batch_size})")
        require(S >= 1 and end <= self.max_len, "cached positions", f"{start} + {S}",
                f"must fit the cache's max_len ({self.max_len})")
        self.num_cached = end
        if self.document_separator is None:
            if start == 0 or S == 1:
                return start, None
            q_S1 = torch.arange(start, end, device=input_ids_BS.device)[:, None]
            return start, (torch.arange(end, device=input_ids_BS.device)[None, :] <= q_S1)[None, None]
        # Packed documents: a query sees the earlier keys of its own document, the separator
        # counting in the document it ends (as ``attention_mask``); positions stay global.
        is_sep_BS = input_ids_BS == self.document_separator
        doc_BS = self.num_seps_B[:, None] + is_sep_BS.cumsum(dim=1) - is_sep_BS.long()
        self.doc_BK[:, start:end] = doc_BS
        self.num_seps_B += is_sep_BS.sum(dim=1)
        causal_SK = torch.ones(S, end, dtype=torch.bool, device=input_ids_BS.device).tril(diagonal=start)
        return start, ((doc_BS[:, :, None] == self.doc_BK[:, None, :end]) & causal_SK)[:, None]
