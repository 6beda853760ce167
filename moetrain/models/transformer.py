"""Decoder-only transformer with MoE feed-forward blocks, written for one device.

Block: ``x + attn(norm(x))`` then ``h + ffn(norm(h))``; the FFN is an ``MoELayer`` in the blocks
``ModelConfig.is_moe_layer`` selects and a dense ``FeedForward`` elsewhere. Attention is causal
with rotary positions (the Hugging Face "rotate half" layout) and optional grouped-query heads.
Parallelism is applied from outside (``moetrain.distributed``); nothing here knows about it.

Shape legend: B batch, S sequence, D model dim, V vocabulary, C classes, H query heads,
G key/value heads, A head dim.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config.base import require
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.models.feedforward import FeedForward
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.layer import MoEAux, MoELayer
from moetrain.models.moe.router import TopKRouter

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
    """One ``MoEAux`` per MoE block, in block order (routing counts, drops, loss terms for metrics)."""

    @property
    def total_loss(self) -> torch.Tensor:
        """``loss + aux_loss``: what training back-propagates."""
        assert self.loss is not None, "total_loss needs labels"
        return self.loss + self.aux_loss


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
    """The token-embedding table (V * D)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares of bf16 activations loses the small entries.
        x32_BSD = x_BSD.float()
        normed_BSD = x32_BSD * torch.rsqrt(x32_BSD.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed_BSD.type_as(x_BSD) * self.weight


def rope_table(head_dim: int, max_seq_len: int, *, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos_SA, sin_SA)`` for positions ``0..max_seq_len-1``; each frequency is repeated in
    both halves of the head dim (rotate-half layout)."""
    inv_freq_A2 = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles_SA2 = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq_A2)
    angles_SA = torch.cat([angles_SA2, angles_SA2], dim=-1)
    return angles_SA.cos().float(), angles_SA.sin().float()


def apply_rope(x_BHSA: torch.Tensor, cos_SA: torch.Tensor, sin_SA: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + A/2) pair of features by its position's angle, in fp32."""
    x1, x2 = x_BHSA.float().chunk(2, dim=-1)
    rotated_BHSA = torch.cat([-x2, x1], dim=-1)
    return (x_BHSA.float() * cos_SA + rotated_BHSA * sin_SA).type_as(x_BHSA)


class Attention(nn.Module):
    """Causal self-attention; G < H key/value heads is grouped-query attention."""

    def __init__(self, dim: int, *, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.wq = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(num_heads * self.head_dim, dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos_SA: torch.Tensor, sin_SA: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H, G, A = self.num_heads, self.num_kv_heads, self.head_dim
        q_BHSA = self.wq(x_BSD).view(B, S, H, A).transpose(1, 2)
        k_BGSA = self.wk(x_BSD).view(B, S, G, A).transpose(1, 2)
        v_BGSA = self.wv(x_BSD).view(B, S, G, A).transpose(1, 2)
        q_BHSA, k_BGSA = apply_rope(q_BHSA, cos_SA, sin_SA), apply_rope(k_BGSA, cos_SA, sin_SA)
        o_BHSA = F.scaled_dot_product_attention(q_BHSA, k_BGSA, v_BGSA, is_causal=True, enable_gqa=G != H)
        return self.wo(o_BHSA.transpose(1, 2).reshape(B, S, H * A))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, moe: MoEConfig, *, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_moe = config.is_moe_layer(layer_id)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config.dim, num_heads=config.num_heads,
                                   num_kv_heads=config.resolved_num_kv_heads)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward: nn.Module = (
            MoELayer(config.dim, moe) if self.is_moe
            else FeedForward(config.dim, config.resolved_dense_hidden_dim, activation=config.activation,
                             init_std=config.init_std))

    def forward(self, x_BSD: torch.Tensor, cos_SA: torch.Tensor,
                sin_SA: torch.Tensor) -> tuple[torch.Tensor, MoEAux | None]:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), cos_SA, sin_SA)
        if self.is_moe:
            y_BSD, aux = self.feed_forward(self.ffn_norm(h_BSD))
            return h_BSD + y_BSD, aux
        return h_BSD + self.feed_forward(self.ffn_norm(h_BSD)), None


class Transformer(nn.Module):
    """``forward(input_ids_BS, labels=None) -> TransformerOutput``.

    ``config.vocab_size`` must be set (``ModelConfig.with_vocab_size(tokenizer.vocab_size)``).
    The weights are initialised at construction from ``seed`` (see ``init_weights``), except
    when built on the meta device: then call ``init_weights`` after ``to_empty``.
    """

    def __init__(self, config: ModelConfig, *, moe: MoEConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        require(config.vocab_size is not None, "model.vocab_size", config.vocab_size,
                "must be set before building the model (ModelConfig.with_vocab_size(tokenizer vocab size))")
        moe = MoEConfig() if moe is None else moe
        self.config, self.moe_config = config, moe
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, moe, layer_id=i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        if config.head == "classifier":
            self.output = nn.Linear(config.dim, config.num_classes, bias=False)
        else:
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
            if config.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight
        # Rotary tables: derived from the config, so not saved in checkpoints.
        cos_SA, sin_SA = rope_table(config.head_dim, config.max_seq_len, theta=config.rope_theta)
        self.register_buffer("rope_cos_SA", cos_SA, persistent=False)
        self.register_buffer("rope_sin_SA", sin_SA, persistent=False)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights(seed)

    # --- forward ----------------------------------------------------------------------------------

    def forward(self, input_ids_BS: torch.Tensor, labels: torch.Tensor | None = None) -> TransformerOutput:
        """``labels``: for the lm head ``[B, S]`` next-token ids already shifted by the loader
        (``labels[b, s]`` follows ``input_ids[b, s]``; ``IGNORE_INDEX`` = not scored); for the
        classifier head ``[B]`` class ids of each sequence (read at its last position)."""
        S = input_ids_BS.shape[1]
        require(S <= self.config.max_seq_len, "sequence length", S,
                f"must be <= model.max_seq_len ({self.config.max_seq_len})")
        cos_SA, sin_SA = self.rope_cos_SA[:S], self.rope_sin_SA[:S]
        h_BSD = self.tok_embeddings(input_ids_BS)
        moe_aux: list[MoEAux] = []
        for layer in self.layers:
            h_BSD, aux = layer(h_BSD, cos_SA, sin_SA)
            if aux is not None:
                moe_aux.append(aux)
        h_BSD = self.norm(h_BSD)

        if self.config.head == "classifier":
            # Pool the last position: the only one that has attended to the whole sequence.
            logits = self.output(h_BSD[:, -1])  # [B, C]
        else:
            logits = self.output(h_BSD)  # [B, S, V]
        loss = None
        if labels is not None:
            # Cross-entropy in fp32 whatever the compute dtype: the log-softmax over V in bf16
            # loses the small probabilities the loss is made of.
            loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)
        if moe_aux:
            aux_loss = torch.stack([a.loss.float() for a in moe_aux]).sum()
        else:
            aux_loss = torch.zeros((), dtype=torch.float32, device=h_BSD.device)
        return TransformerOutput(logits=logits, loss=loss, aux_loss=aux_loss, moe_aux=moe_aux)

    # --- init -------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Draw every parameter from ``seed``, independent of the global RNG, the device and the
        parallel layout.

        Each parameter gets its own CPU generator seeded from ``(seed, parameter name)`` and is
        drawn whole, then copied (or, for a DTensor, sharded) into place. Stacked expert weights
        ``[E, ...]`` are drawn in global expert order, so expert e is the same whatever expert-
        parallel layout later holds it. Weights are normal(init_std), the residual output
        projections (attention out, FFN/expert down) normal(init_std / sqrt(2 * num_layers)) as
        GPT-2/Megatron, routers normal(moe.router_init_std), norm scales 1.
        """
        cfg = self.config
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        std_of: dict[int, float | None] = {}  # id(param) -> std; None = ones
        for module in self.modules():
            if isinstance(module, RMSNorm):
                std_of[id(module.weight)] = None
            elif isinstance(module, TopKRouter):
                std_of[id(module.gate.weight)] = module.init_std
            elif isinstance(module, Attention):
                std_of[id(module.wo.weight)] = out_std
            elif isinstance(module, FeedForward):
                std_of[id(module.w2.weight)] = out_std
            elif isinstance(module, GroupedExperts):
                std_of[id(module.w2)] = out_std
        for name, param in self.named_parameters():
            p_std = std_of.get(id(param), std)
            if p_std is None:
                full = torch.ones(param.shape)
            else:
                full = torch.empty(param.shape).normal_(0.0, p_std, generator=_generator(seed, name))
            _copy_full(param, full)
        cos_SA, sin_SA = rope_table(cfg.head_dim, cfg.max_seq_len, theta=cfg.rope_theta)
        self.rope_cos_SA.copy_(cos_SA)
        self.rope_sin_SA.copy_(sin_SA)

    # --- counting ---------------------------------------------------------------------------------

    def param_counts(self) -> ParamCounts:
        """Counts of the instantiated model (global sizes, also when sharded)."""
        total = sum(p.numel() for p in self.parameters())
        expert = active_expert = 0
        for layer in self.layers:
            if layer.is_moe:
                n = sum(p.numel() for p in layer.feed_forward.experts.parameters())
                expert += n
                active_expert += n * self.moe_config.top_k // self.moe_config.num_experts
        return ParamCounts(total=total, active=total - expert + active_expert, expert=expert,
                           non_expert=total - expert, embedding=self.tok_embeddings.weight.numel())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward); see ``flops_per_token``."""
        return flops_per_token(self.config, self.moe_config, seq_len=seq_len)


def count_params(config: ModelConfig, moe: MoEConfig, *, vocab_size: int | None = None) -> ParamCounts:
    """Parameter counts from the configs alone (no tensors): for planning the large presets.
    ``vocab_size`` replaces ``config.vocab_size`` when that is None."""
    V = config.vocab_size if config.vocab_size is not None else vocab_size
    require(V is not None, "model.vocab_size", V, "must be set (or vocab_size given) to count parameters")
    D, L, A = config.dim, config.num_layers, config.head_dim
    attention = D * config.num_heads * A * 2 + D * config.resolved_num_kv_heads * A * 2  # wq, wo; wk, wv
    norms = 2 * D
    mats = {"gelu": 2, "swiglu": 3}
    dense_ffn = mats[config.activation] * D * config.resolved_dense_hidden_dim
    one_expert = mats[moe.activation] * D * moe.expert_hidden_dim
    shared = mats[moe.activation] * D * moe.resolved_shared_hidden_dim if moe.num_shared_experts > 0 else 0
    router = D * moe.num_experts
    num_moe = len(config.moe_layer_ids)

    embedding = V * D
    head = D * config.num_classes if config.head == "classifier" else (0 if config.tie_embeddings else V * D)
    non_expert = (embedding + head + D + L * (attention + norms)
                  + (L - num_moe) * dense_ffn + num_moe * (shared + router))
    expert = num_moe * moe.num_experts * one_expert
    active = non_expert + num_moe * moe.top_k * one_expert
    return ParamCounts(total=non_expert + expert, active=active, expert=expert, non_expert=non_expert,
                       embedding=embedding)


def flops_per_token(config: ModelConfig, moe: MoEConfig, *, seq_len: int | None = None,
                    vocab_size: int | None = None) -> int:
    """Training FLOPs per token, forward + backward, for MFU: ``6 * N + 12 * L * D * S``.

    N is the active parameters that do matmul work (the embedding lookup does none, unless the
    table is tied to the LM head); the second term is attention scores and values (QK^T and AV,
    2 * 2 * S * D per layer forward, x3 for backward) at sequence length S (default
    ``max_seq_len``), counted without the causal half as PaLM and torchtitan do.
    """
    counts = count_params(config, moe, vocab_size=vocab_size)
    tied_lm = config.head == "lm" and config.tie_embeddings
    matmul_params = counts.active - (0 if tied_lm else counts.embedding)
    S = config.max_seq_len if seq_len is None else seq_len
    return 6 * matmul_params + 12 * config.num_layers * config.num_heads * config.head_dim * S


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full-size CPU tensor into ``param``; a DTensor gets only its own shard
    (every rank drew the same full tensor, so no communication: ``src_data_rank=None``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                 src_data_rank=None)
    param.copy_(full)
