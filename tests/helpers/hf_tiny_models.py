"""Tiny random Hugging Face MoE models of every family moetrain converts, built by `transformers`
from its own config classes (no download), with weights that make a wrong mapping show: norm
gains away from 1, non-zero biases, decisive routers (no top-k decided by a near-tie), and a
non-zero DeepSeek-V3 e_score_correction_bias that re-routes tokens."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never reach for the Hub
import transformers

VOCAB = 96


def hf_config(family: str, **overrides):
    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    if family == "mixtral":
        kw = dict(common, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, rope_theta=500.0, sliding_window=None)
        cls = transformers.MixtralConfig
    elif family == "qwen2_moe":
        # Block 1 dense (mlp_only_layers), blocks 0 and 2 MoE with the gated shared expert.
        kw = dict(common, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=36,
                  num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                  decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, qkv_bias=True)
        cls = transformers.Qwen2MoeConfig
    elif family == "qwen3_moe":
        # head_dim 12 != 32 / 4; decoder_sparse_step 2: blocks 1 and 3 MoE, 0 and 2 dense.
        kw = dict(common, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=4, num_key_value_heads=2,
                  head_dim=12, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True)
        cls = transformers.Qwen3MoeConfig
    elif family == "olmoe":
        kw = dict(common, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, clip_qkv=0.6, norm_topk_prob=False, pad_token_id=None, eos_token_id=None)
        cls = transformers.OlmoeConfig
    elif family in ("deepseek_v3", "deepseek_v2_lite"):
        # V3: low-rank q; V2-Lite style: q_lora_rank None (one q projection).
        kw = dict(common, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
                  num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                  q_lora_rank=16 if family == "deepseek_v3" else None, kv_lora_rank=12, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8, rope_interleave=True, bos_token_id=0, eos_token_id=1)
        cls = transformers.DeepseekV3Config
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def eager_model(cfg, *, seed: int):
    """transformers' model of ``cfg`` (eager attention, its own init under ``seed``) and the
    generator that perturbs its weights next."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), torch.Generator().manual_seed(seed + 1)


@torch.no_grad()
def tiny_model(family: str, *, seed: int = 0, **overrides):
    model, g = eager_model(hf_config(family, **overrides), seed=seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)  # decisive routing
        elif name.endswith("shared_expert_gate.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((torch.rand(b.shape, generator=g) - 0.5) * 0.2)
    return model


def input_ids(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
