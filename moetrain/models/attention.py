"""Multi-head self-attention with rotary positions, and the pieces every attention variant shares:
RMSNorm, the rotary table and its two pair layouts, the attention mask and the SDPA call.

``Attention`` covers the grouped-query family of the Hugging Face MoE models: an explicit head
dim (Qwen3-MoE), bias on the q/k/v projections (Qwen2-MoE), an RMSNorm over each head of q and
k (Qwen3-MoE) or over the whole q and k projections (OLMoE), and clamping of q, k, v (OLMoE).
Multi-head latent attention (DeepSeek) lives in ``moetrain.models.mla``. For decoding, a layer
appends its keys and values to a ``KVCache`` (``moetrain.models.kv_cache``) and attends over it.

Shape legend: B batch, S sequence (queries), K keys (= S in self-attention), D model dim,
H query heads, G key/value heads, A head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config.model import ModelConfig
from moetrain.config.rope import RopeScaling
from moetrain.models.kv_cache import KVCache


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares of bf16 activations loses the small entries.
        x32_BSD = x_BSD.float()
        normed_BSD = x32_BSD * torch.rsqrt(x32_BSD.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed_BSD.type_as(x_BSD) * self.weight


def rope_frequencies(dim: int, *, theta: float, scaling: RopeScaling | None = None,
                     seq_len: int | None = None) -> torch.Tensor:
    """fp64 angular frequency of each of the dim/2 rotary pairs, plain or stretched by ``scaling``.
    ``seq_len``: the length of the sequence they rotate, read by "dynamic" alone (None = within
    the original context, where "dynamic" is plain)."""
    inv_freq_A2 = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if scaling is None:
        return inv_freq_A2
    factor = float(scaling.factor)
    if scaling.rope_type == "linear":
        return inv_freq_A2 / factor
    assert scaling.original_max_seq_len is not None, "RopeScaling requires it for llama3, yarn and dynamic"
    context = scaling.original_max_seq_len
    if scaling.rope_type == "dynamic":
        if seq_len is None or seq_len <= context:
            return inv_freq_A2
        # NTK: a larger base slows the low frequencies most, so the longer sequence stays in range.
        base = theta * (factor * seq_len / context - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if scaling.rope_type == "llama3":
        assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        # Periods per pretraining context: short wavelengths (many turns) were seen whole in
        # pretraining and stay; long ones are interpolated; the band between blends linearly.
        turns_A2 = context * inv_freq_A2 / (2 * math.pi)
        keep_A2 = ((turns_A2 - low) / (high - low)).clamp(0.0, 1.0)
        return keep_A2 * inv_freq_A2 + (1 - keep_A2) * inv_freq_A2 / factor
    assert scaling.rope_type == "yarn", scaling.rope_type
    # The pair index at which a frequency turns ``r`` times over the pretraining context.
    def pair_of(r: float) -> float:
        return dim * math.log(context / (r * 2 * math.pi)) / (2 * math.log(theta))
    fast = 32.0 if scaling.beta_fast is None else scaling.beta_fast
    slow = 1.0 if scaling.beta_slow is None else scaling.beta_slow
    lo, hi = pair_of(fast), pair_of(slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if hi == lo else hi  # a ramp of zero width would divide by zero
    # 0 below ``lo`` (fast pairs keep their frequency) to 1 above ``hi`` (slow ones interpolated).
    ramp_A2 = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0.0, 1.0)
    return ramp_A2 * inv_freq_A2 / factor + (1 - ramp_A2) * inv_freq_A2


def rope_table(head_dim: int, max_seq_len: int, *, theta: float, scaling: RopeScaling | None = None,
               seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos_SA, sin_SA)`` for positions ``0..max_seq_len-1``; each frequency is repeated in
    both halves of the head dim (rotate-half layout). ``scaling``: the frequencies are stretched
    (``rope_frequencies``, for a sequence of ``seq_len``) and cos and sin scaled by its
    ``cos_sin_scale`` (yarn's temperature)."""
    inv_freq_A2 = rope_frequencies(head_dim, theta=theta, scaling=scaling, seq_len=seq_len)
    angles_SA2 = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq_A2)
    angles_SA = torch.cat([angles_SA2, angles_SA2], dim=-1)
    cos_SA, sin_SA = angles_SA.cos(), angles_SA.sin()
    if scaling is not None and scaling.cos_sin_scale != 1.0:
        cos_SA, sin_SA = cos_SA * scaling.cos_sin_scale, sin_SA * scaling.cos_sin_scale
    return cos_SA.float(), sin_SA.float()


def rope_table_for(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary table: ``rope_table`` of its rotary dims (``rope_dim``), ``max_seq_len``
    positions, ``rope_theta`` and ``rope_scaling``. Every module that holds the table builds it here
    and reads it through ``rope_rows``. With "dynamic" scaling it is the table of the original context."""
    return rope_table(config.rope_dim, config.max_seq_len, theta=config.rope_theta, scaling=config.rope_scaling)


def rope_rows(config: ModelConfig, cos_SA: torch.Tensor, sin_SA: torch.Tensor, start: int,
              end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary angles of positions ``start..end-1`` from the model's table (``rope_table_for``).
    With "dynamic" scaling and a sequence past the original context (``end`` beyond it), they come
    from a table stretched for ``end`` positions, built here, as transformers' dynamic NTK does at
    each forward: a decoded token rotates with the stretch of the sequence so far, and the keys
    cached before keep theirs."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "dynamic" or end <= (scaling.original_max_seq_len or 0):
        return cos_SA[start:end], sin_SA[start:end]
    stretched_cos_SA, stretched_sin_SA = rope_table(config.rope_dim, end, theta=config.rope_theta, scaling=scaling,
                                                    seq_len=end)
    return stretched_cos_SA[start:].to(cos_SA.device), stretched_sin_SA[start:].to(sin_SA.device)


def apply_rope(x_BHSA: torch.Tensor, cos_SA: torch.Tensor, sin_SA: torch.Tensor, *,
               interleave: bool = False) -> torch.Tensor:
    """Rotate each (i, i + A/2) pair of features by its position's angle, in fp32.

    ``interleave``: the pairs are (2i, 2i + 1) instead (DeepSeek's checkpoints, transformers'
    ``rope_interleave``). They are gathered evens-then-odds first, which puts pair i at
    (i, i + A/2); the output stays in that order, as transformers' does. q and k are permuted
    alike, so their dot products are those of the interleaved rotation."""
    x32_BHSA = x_BHSA.float()
    if interleave:
        x32_BHSA = torch.cat([x32_BHSA[..., 0::2], x32_BHSA[..., 1::2]], dim=-1)
    x1, x2 = x32_BHSA.chunk(2, dim=-1)
    rotated_BHSA = torch.cat([-x2, x1], dim=-1)
    return (x32_BHSA * cos_SA + rotated_BHSA * sin_SA).type_as(x_BHSA)


def attention_mask(input_ids_BS: torch.Tensor, *, causal: bool, document_separator: int | None,
                   padding_mask_BS: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean mask every attention layer of one forward uses (True = may attend), built once
    per forward; None = no mask beyond SDPA's own ``is_causal``.

    - ``document_separator``: block-diagonal, a query sees only keys of its own document. The
      separator ends its document, so it belongs to the one before it. Positions stay global
      (rotary angles count from the start of the packed sequence, as Megatron without
      ``reset_position_ids``): only visibility is cut.
    - ``causal=False`` with ``padding_mask_BS``: padded keys are hidden from every query.
    - ``causal=True``: right padding comes after every real token, so causality alone keeps it
      from them; no padding mask is needed.

    Shape ``[B, 1, S, K]`` (``[B, 1, 1, K]`` for a key mask alone), broadcast over heads.
    """
    mask_B1SK = None
    if document_separator is not None:
        is_sep_BS = input_ids_BS == document_separator
        doc_BS = is_sep_BS.cumsum(dim=1) - is_sep_BS.long()
        mask_B1SK = (doc_BS[:, :, None] == doc_BS[:, None, :])[:, None]
    if not causal and padding_mask_BS is not None:
        keys_B11K = padding_mask_BS[:, None, None, :]
        mask_B1SK = keys_B11K if mask_B1SK is None else mask_B1SK & keys_B11K
    if causal and mask_B1SK is not None:
        S = input_ids_BS.shape[1]
        mask_B1SK = mask_B1SK & torch.ones(S, S, dtype=torch.bool, device=input_ids_BS.device).tril()
    return mask_B1SK


def attend(q_BHSA: torch.Tensor, k_BGKA: torch.Tensor, v_BGKA: torch.Tensor, mask_B1SK: torch.Tensor | None,
           *, causal: bool, scale: float | None = None) -> torch.Tensor:
    """Softmax attention, ``1/sqrt(A)`` scaled (A = q's last dim) unless ``scale`` is given; G < H
    heads are grouped-query. ``mask_B1SK`` (from ``attention_mask``) replaces ``causal`` when
    given: it already holds the causal pattern. With a mask the GPU's flash kernel is out and SDPA
    takes its memory-efficient kernel; without one the fused causal kernels run."""
    gqa = k_BGKA.shape[1] != q_BHSA.shape[1]
    if mask_B1SK is None:
        return F.scaled_dot_product_attention(q_BHSA, k_BGKA, v_BGKA, is_causal=causal, enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(q_BHSA, k_BGKA, v_BGKA, attn_mask=mask_B1SK, enable_gqa=gqa, scale=scale)


QK_NORMS = ("none", "head", "full")
"""``qk_norm`` values: none; an RMSNorm over each head's A features of q and k; one over the whole
q projection [H*A] and k projection [G*A]."""


class Attention(nn.Module):
    """Self-attention with rotary positions; G < H key/value heads is grouped-query attention.

    Order of operations, as in transformers: project (with bias when ``qkv_bias``), q/k norm,
    clamp q, k, v to ``[-clip_qkv, clip_qkv]``, rotary, attention, output projection (no bias).
    """

    def __init__(self, dim: int, *, num_heads: int, num_kv_heads: int, head_dim: int | None = None,
                 qkv_bias: bool = False, qk_norm: str = "none", clip_qkv: float | None = None,
                 norm_eps: float = 1e-5, rope_interleave: bool = False, causal: bool = True,
                 softmax_scale: float | None = None) -> None:
        super().__init__()
        assert qk_norm in QK_NORMS, qk_norm
        self.softmax_scale = softmax_scale  # None = 1/sqrt(A); yarn's mscale_all_dim changes it
        A = dim // num_heads if head_dim is None else head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, A
        self.qk_norm, self.clip_qkv = qk_norm, clip_qkv
        self.rope_interleave, self.causal = rope_interleave, causal
        self.wq = nn.Linear(dim, num_heads * A, bias=qkv_bias)
        self.wk = nn.Linear(dim, num_kv_heads * A, bias=qkv_bias)
        self.wv = nn.Linear(dim, num_kv_heads * A, bias=qkv_bias)
        self.wo = nn.Linear(num_heads * A, dim, bias=False)
        if qk_norm != "none":
            per_head = qk_norm == "head"
            self.q_norm = RMSNorm(A if per_head else num_heads * A, eps=norm_eps)
            self.k_norm = RMSNorm(A if per_head else num_kv_heads * A, eps=norm_eps)

    def new_cache(self, batch_size: int, *, max_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        """An empty ``KVCache`` of this layer's G key/value heads."""
        return KVCache(batch_size, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, max_len=max_len,
                       dtype=dtype, device=device)

    def forward(self, x_BSD: torch.Tensor, cos_SA: torch.Tensor, sin_SA: torch.Tensor,
                mask_B1SK: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """``cos_SA, sin_SA``: the rotary angles of the S positions of ``x_BSD``. ``cache``: the S
        new keys and values are appended to it and the queries attend over every cached position;
        ``mask_B1SK`` is then ``DecodeCache.begin``'s."""
        B, S, _ = x_BSD.shape
        H, G, A = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)  # [B, S, H*A], [B, S, G*A] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BSHA, k_BSGA, v_BSGA = q.view(B, S, H, A), k.view(B, S, G, A), v.view(B, S, G, A)
        if self.qk_norm == "head":
            q_BSHA, k_BSGA = self.q_norm(q_BSHA), self.k_norm(k_BSGA)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q_BSHA, k_BSGA, v_BSGA = q_BSHA.clamp(-c, c), k_BSGA.clamp(-c, c), v_BSGA.clamp(-c, c)
        q_BHSA = apply_rope(q_BSHA.transpose(1, 2), cos_SA, sin_SA, interleave=self.rope_interleave)
        k_BGSA = apply_rope(k_BSGA.transpose(1, 2), cos_SA, sin_SA, interleave=self.rope_interleave)
        if cache is None:
            o_BHSA = attend(q_BHSA, k_BGSA, v_BSGA.transpose(1, 2), mask_B1SK, causal=self.causal,
                            scale=self.softmax_scale)
        else:
            k_BGKA, v_BGKA = cache.update(k_BGSA, v_BSGA.transpose(1, 2))
            o_BHSA = attend(q_BHSA, k_BGKA, v_BGKA, mask_B1SK, causal=S > 1, scale=self.softmax_scale)
        return self.wo(o_BHSA.transpose(1, 2).reshape(B, S, H * A))
