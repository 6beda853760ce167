"""Decoder-only transformer with MoE feed-forward blocks, written for one device.

Block: ``x + attn(norm(x))`` then ``h + ffn(norm(h))``; the FFN is an ``MoELayer`` in the blocks
``ModelConfig.is_moe_layer`` selects and a dense ``FeedForward`` elsewhere. Attention
(``moetrain.models.attention``: grouped-query with rotary positions; ``moetrain.models.mla``:
DeepSeek's latent attention) is causal, block-diagonal causal over packed documents
(``document_separator``), or bidirectional over the real tokens for a classifier (``causal``).
Parallelism is applied from outside (``moetrain.distributed``); nothing here knows about it.
Decoding with a cache (``Transformer.new_cache``, ``moetrain.models.kv_cache``) runs the same
blocks over the new tokens only.

Shape legend: B batch, S sequence, K keys (= S; with a ``DecodeCache``, every cached position), D
model dim, V vocabulary, C classes, H query heads, G key/value heads, A head dim, P rotary dims per
head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config.base import require
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.models.attention import (
    Attention,
    RMSNorm,
    apply_rope,
    attention_mask,
    rope_rows,
    rope_table,
    rope_table_for,
)
from moetrain.models.feedforward import FeedForward
from moetrain.models.init import init_parameters
from moetrain.models.kv_cache import DecodeCache
from moetrain.models.mla import MultiHeadLatentAttention
from moetrain.models.moe.layer import MoEAux, MoELayer
from moetrain.models.mtp import MTPModule, mtp_losses
from moetrain.models.ngram import ngram_embedding

# Attention, MultiHeadLatentAttention, RMSNorm, apply_rope and rope_table live in their own
# modules; importing them from here keeps working.
__all__ = ["IGNORE_INDEX", "Attention", "DecodeCache", "MultiHeadLatentAttention", "ParamCounts", "RMSNorm",
           "Transformer",
           "TransformerBlock", "TransformerOutput", "apply_rope", "attention_params", "build_attention",
           "count_params", "flops_per_token", "rope_table"]

IGNORE_INDEX = -100
"""Label value excluded from the loss (as in ``F.cross_entropy``)."""


@dataclass
class TransformerOutput:
    logits: torch.Tensor
    """``[B, S, V]`` next-token logits (lm head) or ``[B, C]`` class logits (classifier head),
    in the compute dtype."""
    loss: torch.Tensor | None
    """Mean cross-entropy over the labelled tokens (fp32, 0-dim); None without labels."""
    aux_loss: torch.Tensor
    """Sum over the MoE blocks of ``MoEAux.loss`` (fp32, 0-dim; 0 for a dense model). Add it to
    ``loss`` for training."""
    moe_aux: list[MoEAux]
    """One ``MoEAux`` per MoE block, in block order, then the multi-token modules' (routing counts,
    drops, loss terms for metrics)."""
    mtp_losses: torch.Tensor | None = None
    """``[model.mtp_depth]`` cross-entropy of each multi-token depth (fp32); None without labels or
    with ``mtp_depth`` 0."""
    mtp_loss: torch.Tensor | None = None
    """``model.mtp_loss_weight * mtp_losses.mean()`` (fp32, 0-dim): added to ``loss`` for training."""
    hidden_BSD: torch.Tensor | None = None
    """``[B, S, D]`` the final norm's output, which the lm head and the first multi-token module read."""

    @property
    def total_loss(self) -> torch.Tensor:
        """``loss + aux_loss (+ mtp_loss)``: what training back-propagates."""
        assert self.loss is not None, "total_loss needs labels"
        total = self.loss + self.aux_loss
        return total if self.mtp_loss is None else total + self.mtp_loss


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """All parameters (a tied embedding counted once)."""
    active: int
    """Parameters used per token: every non-expert parameter plus K/E of the routed experts."""
    expert: int
    """Routed-expert parameters (the stacked ``GroupedExperts`` weights of all MoE blocks)."""
    non_expert: int
    """Everything else: embeddings, attention, dense FFNs, shared experts, routers, norms, head."""
    embedding: int
    """The embedding tables: the tokens' (V * D) and the hashed n-grams' (``ngram_buckets`` * D)."""


def build_attention(config: ModelConfig) -> Attention | MultiHeadLatentAttention:
    """The attention module ``config.attention`` names, with its fields."""
    if config.attention == "mla":
        return MultiHeadLatentAttention(
            config.dim, num_heads=config.num_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            rope_interleave=config.rope_interleave, causal=config.causal, softmax_scale=config.softmax_scale)
    return Attention(config.dim, num_heads=config.num_heads, num_kv_heads=config.resolved_num_kv_heads,
                     head_dim=config.resolved_head_dim, qkv_bias=config.qkv_bias, qk_norm=config.qk_norm,
                     clip_qkv=config.clip_qkv, norm_eps=config.norm_eps, rope_interleave=config.rope_interleave,
                     causal=config.causal, softmax_scale=config.softmax_scale)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, moe: MoEConfig, *, layer_id: int, is_moe: bool | None = None) -> None:
        """``is_moe``: an MoE FFN or a dense one; None = as ``config.is_moe_layer(layer_id)``."""
        super().__init__()
        self.layer_id = layer_id
        self.is_moe = config.is_moe_layer(layer_id) if is_moe is None else is_moe
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = build_attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward: nn.Module = (
            MoELayer(config.dim, moe) if self.is_moe
            else FeedForward(config.dim, config.resolved_dense_hidden_dim, activation=config.activation,
                             init_std=config.init_std))
        # Identity at model.dropout = 0, so the default model has no dropout in its graph.
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()

    def forward(self, x_BSD: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor,
                mask_B1SK: torch.Tensor | None = None, cache=None,
                token_mask_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEAux | None]:
        """``cos_SP, sin_SP``: the rotary angles of the S positions; ``mask_B1SK``: the forward's
        ``attention_mask``; ``cache``: this block's entry of a ``DecodeCache``, or None;
        ``token_mask_BS``: the real tokens, the only ones an MoE layer routes (None: all)."""
        h_BSD = x_BSD + self.dropout(self.attention(self.attention_norm(x_BSD), cos_SP, sin_SP, mask_B1SK, cache))
        if self.is_moe:
            y_BSD, aux = self.feed_forward(self.ffn_norm(h_BSD), token_mask_BS)
            return h_BSD + self.dropout(y_BSD), aux
        return h_BSD + self.dropout(self.feed_forward(self.ffn_norm(h_BSD))), None


class Transformer(nn.Module):
    """``forward(input_ids_BS, labels=None, *, padding_mask_BS=None, cache=None) -> TransformerOutput``.

    Decoding: ``cache = model.new_cache(batch_size)``, then ``model(prompt_BS, cache=cache)`` (the
    prefill, one forward) and ``model(next_B1, cache=cache)`` per new token; each forward's logits
    are those of its own tokens at the positions after the cached ones.

    ``config.vocab_size`` must be set (``ModelConfig.with_vocab_size(tokenizer.vocab_size)``).
    The weights are initialised at construction from ``seed`` (see ``init_weights``), except
    when built on the meta device: then call ``init_weights`` after ``to_empty``.
    """

    rope_cos_SA: torch.Tensor
    rope_sin_SA: torch.Tensor

    def __init__(self, config: ModelConfig, *, moe: MoEConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        vocab_size = config.vocab_size
        if vocab_size is None:
            raise ValueError("model.vocab_size (None) must be set before building the model "
                             "(ModelConfig.with_vocab_size(tokenizer vocab size))")
        moe = MoEConfig() if moe is None else moe
        self.config, self.moe_config = config, moe
        self.tok_embeddings = nn.Embedding(vocab_size, config.dim)
        self.ngram_embeddings = ngram_embedding(config)  # None at model.ngram_buckets = 0
        self.embedding_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.layers = nn.ModuleList(TransformerBlock(config, moe, layer_id=i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        # Multi-token modules (empty at mtp_depth 0): an MoE block when the model has MoE blocks,
        # as DeepSeek-V3's, numbered after the main blocks.
        self.mtp = nn.ModuleList(
            MTPModule(config.dim, norm_eps=config.norm_eps,
                      block=TransformerBlock(config, moe, layer_id=config.num_layers + k, is_moe=config.is_moe))
            for k in range(config.mtp_depth))
        if config.head == "classifier":
            if config.pooling == "attention":
                self.pool_query = nn.Parameter(torch.zeros(config.dim))
            assert config.num_classes is not None, "ModelConfig requires num_classes for a classifier"
            self.output = nn.Linear(config.dim, config.num_classes, bias=False)
        else:
            self.output = nn.Linear(config.dim, vocab_size, bias=False)
            if config.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight
        # Rotary tables (for the rotary part of each head): derived from the config, so not saved
        # in checkpoints.
        cos_SP, sin_SP = rope_table_for(config)
        self.register_buffer("rope_cos_SA", cos_SP, persistent=False)
        self.register_buffer("rope_sin_SA", sin_SP, persistent=False)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights(seed)

    # --- forward ----------------------------------------------------------------------------------

    def forward(self, input_ids_BS: torch.Tensor, labels: torch.Tensor | None = None, *,
                padding_mask_BS: torch.Tensor | None = None, cache: DecodeCache | None = None) -> TransformerOutput:
        """``labels``: for the lm head ``[B, S]`` next-token ids already shifted by the loader
        (``labels[b, s]`` follows ``input_ids[b, s]``; ``IGNORE_INDEX`` = not scored); for the
        classifier head ``[B]`` class ids of each sequence.

        ``padding_mask_BS``: bool ``[B, S]``, True = a real token; sequences are right-padded and
        hold at least one real token. None = every token is real. The classifier pools over it
        (``model.pooling``), its MoE layers route only the real tokens and, with ``model.causal``
        false, attention hides padded keys. The lm head ignores it: its labels carry
        ``IGNORE_INDEX`` at padded positions.

        ``cache``: a ``DecodeCache`` from ``new_cache``; the tokens continue the cached ones (rotary
        angles from ``cache.num_cached`` on) and their keys are appended to it. No padding with it.
        """
        B, S = input_ids_BS.shape
        if cache is None:
            require(S <= self.config.max_seq_len, "sequence length", S,
                    f"must be <= model.max_seq_len ({self.config.max_seq_len})")
            if padding_mask_BS is not None:
                require(padding_mask_BS.dtype == torch.bool and tuple(padding_mask_BS.shape) == (B, S),
                        "padding_mask_BS", f"{padding_mask_BS.dtype} {list(padding_mask_BS.shape)}",
                        f"must be a bool tensor of the input's shape [{B}, {S}]")
            cos_SP, sin_SP = rope_rows(self.config, self.rope_cos_SA, self.rope_sin_SA, 0, S)
            # One mask for every layer; None keeps SDPA's fused causal kernels.
            mask_B1SK = attention_mask(input_ids_BS, causal=self.config.causal,
                                       document_separator=self.config.document_separator,
                                       padding_mask_BS=padding_mask_BS)
        else:
            require(padding_mask_BS is None, "padding_mask_BS", "a tensor",
                    "must be None with a cache (decode sequences of one length)")
            start, mask_B1SK = cache.begin(input_ids_BS)
            cos_SP, sin_SP = rope_rows(self.config, self.rope_cos_SA, self.rope_sin_SA, start, start + S)
        h_BSD = self.tok_embeddings(input_ids_BS)
        if self.ngram_embeddings is not None:  # a classifier's only: no decoding cache needs the earlier ids
            h_BSD = h_BSD + self.ngram_embeddings(input_ids_BS)
        h_BSD = self.embedding_dropout(h_BSD)
        # The classifier's padded positions are not routed: they would take expert FLOPs and a
        # share of the balance losses and load statistics, and pooling drops them anyway.
        token_mask_BS = padding_mask_BS if self.config.head == "classifier" else None
        moe_aux: list[MoEAux] = []
        for i, layer in enumerate(self.layers):
            h_BSD, aux = layer(h_BSD, cos_SP, sin_SP, mask_B1SK, None if cache is None else cache.layers[i],
                               token_mask_BS)
            if aux is not None:
                moe_aux.append(aux)
        h_BSD = self.norm(h_BSD)

        if self.config.head == "classifier":
            logits = self.output(self._pool(h_BSD, padding_mask_BS))  # [B, C]
        else:
            logits = self.output(h_BSD)  # [B, S, V]
        loss = mtp_loss = per_depth = None
        if labels is not None:
            # Cross-entropy in fp32 whatever the compute dtype: the log-softmax over V in bf16
            # loses the small probabilities the loss is made of.
            loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)
            if len(self.mtp) > 0 and cache is None:
                per_depth = self._mtp_losses(h_BSD, input_ids_BS, labels, cos_SP, sin_SP, moe_aux)
                mtp_loss = self.config.mtp_loss_weight * per_depth.mean()
        if moe_aux:
            aux_loss = torch.stack([a.loss.float() for a in moe_aux]).sum()
        else:
            aux_loss = torch.zeros((), dtype=torch.float32, device=h_BSD.device)
        return TransformerOutput(logits=logits, loss=loss, aux_loss=aux_loss, moe_aux=moe_aux, mtp_losses=per_depth,
                                 mtp_loss=mtp_loss, hidden_BSD=h_BSD)

    def _mtp_losses(self, h_BSD: torch.Tensor, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor,
                    cos_SP: torch.Tensor, sin_SP: torch.Tensor, moe_aux: list[MoEAux]) -> torch.Tensor:
        """Each multi-token depth's loss (``moetrain.models.mtp``); their blocks' MoE aux appended."""
        S, depth = input_ids_BS.shape[1], self.config.mtp_depth
        require(S > depth, "sequence length", S, f"must be > model.mtp_depth ({depth}) to score a token that far")
        cfg = self.config

        def embed(ids_BS: torch.Tensor) -> torch.Tensor:
            return self.embedding_dropout(self.tok_embeddings(ids_BS))

        def mask_fn(ids_BS: torch.Tensor) -> torch.Tensor | None:
            return attention_mask(ids_BS, causal=cfg.causal, document_separator=cfg.document_separator,
                                  padding_mask_BS=None)

        per_depth, aux = mtp_losses(self.mtp, h_BSD, input_ids_BS, labels_BS, embed=embed, output=self.output,
                                    cos_SP=cos_SP, sin_SP=sin_SP, mask_fn=mask_fn)
        moe_aux.extend(aux)
        return per_depth

    def check_generative(self) -> None:
        """ValueError, with the reason, where token-by-token decoding cannot reproduce the model: a
        classifier head (the only one that may attend bidirectionally, ``model.causal``), and MoE
        routing that looks at the whole batch.
        Token-choice routing without a capacity is per token, so cached decoding computes what a
        full forward computes; a capacity factor drops copies by their rank among all tokens of the
        forward (later positions included), and expert choice picks each expert's tokens from them."""
        cfg, moe = self.config, self.moe_config
        require(cfg.head == "lm", "model.head", cfg.head,
                'must be "lm" to generate (a classifier scores whole sequences and has no next-token logits)')
        if cfg.is_moe:
            require(not moe.is_expert_choice, "moe.router", moe.router,
                    "must be a token-choice router to decode with a cache (expert choice picks tokens from the "
                    "whole batch, later positions included)")
            require(moe.capacity_factor is None, "moe.capacity_factor", moe.capacity_factor,
                    "must be None (dropless) to decode with a cache: capacity drops depend on every token of "
                    "the forward, later positions included, so no token-by-token decoding reproduces them")

    def new_cache(self, batch_size: int, *, max_len: int | None = None, dtype: torch.dtype | None = None
                  ) -> DecodeCache:
        """An empty ``DecodeCache`` for ``batch_size`` sequences of up to ``max_len`` positions
        (default ``model.max_seq_len``, the rotary table's length), on the parameters' device, in
        ``dtype`` (default: the autocast dtype when autocast is on there, else the embedding's).
        Refused where ``check_generative`` refuses."""
        self.check_generative()
        cfg = self.config
        max_len = cfg.max_seq_len if max_len is None else max_len
        require(1 <= max_len <= cfg.max_seq_len, "max_len", max_len,
                f"must be in [1, model.max_seq_len ({cfg.max_seq_len})]: the rotary table's length")
        device = self.tok_embeddings.weight.device
        if dtype is None:
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else self.tok_embeddings.weight.dtype
        layers = [block.attention.new_cache(batch_size, max_len=max_len, dtype=dtype, device=device)
                  for block in self._blocks()]
        return DecodeCache(layers, batch_size=batch_size, max_len=max_len,
                           document_separator=cfg.document_separator, device=device)

    def _pool(self, h_BSD: torch.Tensor, padding_mask_BS: torch.Tensor | None) -> torch.Tensor:
        """``[B, D]``: the last real token's hidden state (with causal attention the only one that
        saw the whole sequence), or the plain or attention-weighted mean over the real tokens
        (``model.pooling``)."""
        if self.config.pooling == "attention":
            # fp32 softmax: the weights of a long padded row must not underflow in bf16.
            score_BS = (h_BSD @ self.pool_query.to(h_BSD.dtype)).float()
            if padding_mask_BS is not None:
                score_BS = score_BS.masked_fill(~padding_mask_BS, float("-inf"))
            weight_BS1 = torch.softmax(score_BS, dim=1).to(h_BSD.dtype)[..., None]
            return (h_BSD * weight_BS1).sum(dim=1)
        if self.config.pooling == "mean":
            if padding_mask_BS is None:
                return h_BSD.mean(dim=1)
            real_BS1 = padding_mask_BS[..., None].to(h_BSD.dtype)
            return (h_BSD * real_BS1).sum(dim=1) / real_BS1.sum(dim=1)
        if padding_mask_BS is None:
            return h_BSD[:, -1]
        last_B = padding_mask_BS.sum(dim=1) - 1  # right padding: the real tokens come first
        return h_BSD[torch.arange(h_BSD.shape[0], device=h_BSD.device), last_B]

    # --- init -------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Draw every parameter from ``seed`` (:func:`init_parameters`) and fill the rotary tables."""
        init_parameters(self, self.config, seed)
        cos_SP, sin_SP = rope_table_for(self.config)
        self.rope_cos_SA.copy_(cos_SP)
        self.rope_sin_SA.copy_(sin_SP)

    # --- counting ---------------------------------------------------------------------------------

    def param_counts(self) -> ParamCounts:
        """Counts of the instantiated model (global sizes, also when sharded)."""
        total = sum(p.numel() for p in self.parameters())
        expert = active_expert = 0
        for module in self.modules():  # the blocks' and the multi-token modules' MoE layers
            if isinstance(module, MoELayer):
                n = sum(p.numel() for p in module.experts.parameters())
                expert += n
                active_expert += n * self.moe_config.top_k // self.moe_config.num_experts
        embedding = self.tok_embeddings.weight.numel() + self.config.ngram_buckets * self.config.dim
        return ParamCounts(total=total, active=total - expert + active_expert, expert=expert,
                           non_expert=total - expert, embedding=embedding)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward); see ``flops_per_token``."""
        return flops_per_token(self.config, self.moe_config, seq_len=seq_len)

    def mtp_modules(self) -> list[MTPModule]:
        """The multi-token modules in depth order (``mtp`` types its items as nn.Module)."""
        return [cast(MTPModule, m) for m in self.mtp]

    def _blocks(self) -> list[TransformerBlock]:
        # nn.ModuleList types its items as nn.Module; this model's are always TransformerBlocks.
        return [cast(TransformerBlock, block) for block in self.layers]


def count_params(config: ModelConfig, moe: MoEConfig, *, vocab_size: int | None = None) -> ParamCounts:
    """Parameter counts from the configs alone (no tensors): for planning the large presets.
    ``vocab_size`` replaces ``config.vocab_size`` when that is None."""
    V = config.vocab_size if config.vocab_size is not None else vocab_size
    if V is None:
        raise ValueError("model.vocab_size (None) must be set (or vocab_size given) to count parameters")
    D, L = config.dim, config.num_layers
    attention = attention_params(config)
    norms = 2 * D
    mats = {"gelu": 2, "swiglu": 3}
    dense_ffn = mats[config.activation] * D * config.resolved_dense_hidden_dim
    one_expert = mats[moe.activation] * D * moe.expert_hidden_dim
    shared = mats[moe.activation] * D * moe.resolved_shared_hidden_dim if moe.num_shared_experts > 0 else 0
    router = D * moe.num_experts
    num_moe = len(config.moe_layer_ids)
    # Each multi-token module: a block (MoE when the model has MoE blocks), its three norms and
    # the [2D -> D] projection; the embedding and head are the model's.
    M = config.mtp_depth
    mtp_moe = M if num_moe > 0 else 0

    embedding = (V + config.ngram_buckets) * D
    if config.head == "classifier":
        assert config.num_classes is not None, "ModelConfig requires num_classes for a classifier"
        head = D * config.num_classes + (D if config.pooling == "attention" else 0)  # + the pooling query
    else:
        head = 0 if config.tie_embeddings else V * D
    non_expert = (embedding + head + D + (L + M) * (attention + norms) + M * (3 * D + 2 * D * D)
                  + (L + M - num_moe - mtp_moe) * dense_ffn + (num_moe + mtp_moe) * (shared + router))
    expert = (num_moe + mtp_moe) * moe.num_experts * one_expert
    active = non_expert + (num_moe + mtp_moe) * moe.top_k * one_expert
    return ParamCounts(total=non_expert + expert, active=active, expert=expert, non_expert=non_expert,
                       embedding=embedding)


def attention_params(config: ModelConfig) -> int:
    """Parameters of one attention module."""
    D, H = config.dim, config.num_heads
    if config.attention == "mla":
        Q, R, P = config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim
        qk, U = config.resolved_head_dim, config.v_head_dim
        q = D * H * qk if Q is None else D * Q + Q + Q * H * qk  # wq, or wq_a, q_norm, wq_b
        kv = D * (R + P) + R + R * H * (config.qk_nope_head_dim + U)  # wkv_a, kv_norm, wkv_b
        return q + kv + H * U * D  # wo
    A, G = config.resolved_head_dim, config.resolved_num_kv_heads
    projections = D * H * A * 2 + D * G * A * 2  # wq, wo; wk, wv
    biases = (H + 2 * G) * A if config.qkv_bias else 0
    qk_norms = {"none": 0, "head": 2 * A, "full": (H + G) * A}[config.qk_norm]
    return projections + biases + qk_norms


def flops_per_token(config: ModelConfig, moe: MoEConfig, *, seq_len: int | None = None,
                    vocab_size: int | None = None) -> int:
    """Training FLOPs per token, forward + backward, for MFU: ``6 * N + 6 * L * H * (A + U) * S``.

    N is the active parameters that do matmul work (the embedding lookup does none, unless the
    table is tied to the LM head); the second term is attention scores and values (QK^T over
    the q.k head dim A and AV over the value head dim U, A = U outside MLA: 2 * S * H * (A + U)
    per layer forward, x3 for backward) at sequence length S (default ``max_seq_len``), counted
    without the causal half as PaLM and torchtitan do. The multi-token modules (``mtp_depth``) add
    their blocks, projections and one more head each, counted over all S positions.
    """
    counts = count_params(config, moe, vocab_size=vocab_size)
    tied_lm = config.head == "lm" and config.tie_embeddings
    matmul_params = counts.active - (0 if tied_lm else counts.embedding)
    # Every multi-token depth runs the shared head once more (its blocks are in the counts).
    matmul_params += config.mtp_depth * counts.embedding
    S = config.max_seq_len if seq_len is None else seq_len
    A = config.resolved_head_dim
    U = config.v_head_dim if config.attention == "mla" else A
    num_blocks = config.num_layers + config.mtp_depth
    return 6 * matmul_params + 6 * num_blocks * config.num_heads * (A + U) * S
