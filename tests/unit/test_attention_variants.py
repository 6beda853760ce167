"""Attention variants against transformers' own implementations (the independent reference):
Qwen2-MoE (q/k/v bias), Qwen3-MoE (per-head q/k norm, head_dim != dim / heads), OLMoE (q/k norm
over the whole projection, clip_qkv) and DeepSeek-V3 multi-head latent attention (with and
without the query latent, rotary pairs interleaved or not). Each test builds transformers'
attention module from its config class (tiny sizes, eager attention), draws every one of its
parameters at random (norm scales and biases too, so that a missing or misplaced one shows),
copies them into moetrain's module, and compares outputs on the same hidden states with
transformers' rotary tables, in fp32."""

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek
from transformers.models.olmoe import modeling_olmoe as hf_olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe as hf_qwen2
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3

from moetrain.models.attention import Attention, apply_rope, rope_table
from moetrain.models.mla import MultiHeadLatentAttention

B, S, D = 2, 7, 32
TOL = {"rtol": 1e-5, "atol": 1e-5}


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter at random: matrices and biases normal(0, 0.2), norm scales 1 + normal(0, 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1 + noise if "norm" in name else noise)


def hidden_states(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(seed))


def run_hf(attn, rotary, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' output with its own causal mask and rotary tables; returns (out, cos_SA, sin_SA)."""
    cos_BSA, sin_BSA = rotary(x_BSD, torch.arange(S)[None].expand(B, -1))
    causal_11SS = torch.full((S, S), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attn(x_BSD, position_embeddings=(cos_BSA, sin_BSA), attention_mask=causal_11SS)
    return out, cos_BSA[0], sin_BSA[0]


def load_mha(ours: Attention, hf_attn) -> None:
    """transformers' q/k/v/o_proj (and q/k_norm) into ours; strict: every tensor has a place."""
    sd = {k.replace("q_proj", "wq").replace("k_proj", "wk").replace("v_proj", "wv").replace("o_proj", "wo"): v
          for k, v in hf_attn.state_dict().items()}
    ours.load_state_dict(sd, strict=True)


def test_qwen2_moe_qkv_bias():
    cfg = transformers.Qwen2MoeConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=1, qkv_bias=True, attn_implementation="eager")
    hf_attn = hf_qwen2.Qwen2MoeAttention(cfg, 0).eval()
    randomize(hf_attn, seed=1)
    ours = Attention(D, num_heads=4, num_kv_heads=2, qkv_bias=True)
    assert ours.wq.bias.shape == (32,) and ours.wk.bias.shape == (16,) and ours.wo.bias is None
    load_mha(ours, hf_attn)
    x = hidden_states()
    ref, cos_SA, sin_SA = run_hf(hf_attn, hf_qwen2.Qwen2MoeRotaryEmbedding(cfg), x)
    torch.testing.assert_close(ours(x, cos_SA, sin_SA), ref, **TOL)


def test_qwen3_moe_per_head_qk_norm_and_explicit_head_dim():
    A = 12  # != D / heads = 8
    cfg = transformers.Qwen3MoeConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=A,
                                      num_hidden_layers=1, rms_norm_eps=1e-6, attn_implementation="eager")
    hf_attn = hf_qwen3.Qwen3MoeAttention(cfg, 0).eval()
    randomize(hf_attn, seed=2)
    ours = Attention(D, num_heads=4, num_kv_heads=2, head_dim=A, qk_norm="head", norm_eps=1e-6)
    assert ours.q_norm.weight.shape == (A,) and ours.k_norm.weight.shape == (A,)
    assert ours.wq.weight.shape == (4 * A, D) and ours.wo.weight.shape == (D, 4 * A)
    load_mha(ours, hf_attn)
    x = hidden_states()
    ref, cos_SA, sin_SA = run_hf(hf_attn, hf_qwen3.Qwen3MoeRotaryEmbedding(cfg), x)
    torch.testing.assert_close(ours(x, cos_SA, sin_SA), ref, **TOL)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_olmoe_full_qk_norm_and_clip_qkv(clip):
    cfg = transformers.OlmoeConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, clip_qkv=clip, rms_norm_eps=1e-5,
                                   attn_implementation="eager")
    hf_attn = hf_olmoe.OlmoeAttention(cfg, 0).eval()
    randomize(hf_attn, seed=3)
    ours = Attention(D, num_heads=4, num_kv_heads=2, qk_norm="full", clip_qkv=clip, norm_eps=1e-5)
    assert ours.q_norm.weight.shape == (32,) and ours.k_norm.weight.shape == (16,)
    load_mha(ours, hf_attn)
    x = hidden_states()
    ref, cos_SA, sin_SA = run_hf(hf_attn, hf_olmoe.OlmoeRotaryEmbedding(cfg), x)
    out = ours(x, cos_SA, sin_SA)
    torch.testing.assert_close(out, ref, **TOL)
    if clip is not None:  # the clamp acts at this size: without it the output differs
        ours.clip_qkv = None
        assert not torch.allclose(ours(x, cos_SA, sin_SA), out, atol=1e-3)


def deepseek_config(*, q_lora_rank, interleave):
    return transformers.DeepseekV3Config(
        hidden_size=D, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rope_interleave=interleave,
        rms_norm_eps=1e-5, attn_implementation="eager")


MLA_NAMES = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
             "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}


@pytest.mark.parametrize("q_lora_rank", [None, 12], ids=["plain-q", "q-latent"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
@pytest.mark.parametrize("scale", [1.0, 3e-3], ids=["unit", "small"])
def test_deepseek_v3_multi_head_latent_attention(q_lora_rank, interleave, scale):
    """``scale`` 3e-3 makes the latents' mean square comparable to the latent norms' eps, so the
    eps (1e-6 in transformers whatever rms_norm_eps says) shows in the output; the latent norms
    bring the values back to order 1."""
    cfg = deepseek_config(q_lora_rank=q_lora_rank, interleave=interleave)
    hf_attn = hf_deepseek.DeepseekV3Attention(cfg, 0).eval()
    randomize(hf_attn, seed=4)
    ours = MultiHeadLatentAttention(D, num_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
                                    qk_rope_head_dim=6, v_head_dim=10, rope_interleave=interleave)
    sd = {}
    for key, value in hf_attn.state_dict().items():
        module, _, leaf = key.rpartition(".")
        sd[f"{MLA_NAMES[module]}.{leaf}"] = value
    ours.load_state_dict(sd, strict=True)
    x = hidden_states() * scale
    ref, cos_SP, sin_SP = run_hf(hf_attn, hf_deepseek.DeepseekV3RotaryEmbedding(cfg), x)
    assert cos_SP.shape == (S, 6)  # the rotary table is built for the rotary part only
    torch.testing.assert_close(ours(x, cos_SP, sin_SP), ref, **TOL)


def test_mla_parameter_names_and_shapes():
    H, Q, R, N, P, U = 4, 12, 16, 8, 6, 10
    shapes = {k: tuple(v.shape) for k, v in MultiHeadLatentAttention(
        D, num_heads=H, q_lora_rank=Q, kv_lora_rank=R, qk_nope_head_dim=N, qk_rope_head_dim=P,
        v_head_dim=U).state_dict().items()}
    assert shapes == {"wq_a.weight": (Q, D), "q_norm.weight": (Q,), "wq_b.weight": (H * (N + P), Q),
                      "wkv_a.weight": (R + P, D), "kv_norm.weight": (R,), "wkv_b.weight": (H * (N + U), R),
                      "wo.weight": (D, H * U)}
    plain = MultiHeadLatentAttention(D, num_heads=H, q_lora_rank=None, kv_lora_rank=R, qk_nope_head_dim=N,
                                     qk_rope_head_dim=P, v_head_dim=U).state_dict()
    assert tuple(plain["wq.weight"].shape) == (H * (N + P), D) and "wq_a.weight" not in plain


def test_interleaved_rope_is_rotate_half_on_features_regrouped_evens_then_odds():
    """Interleaved pairs (2i, 2i+1) on weights W give what rotate-half pairs (i, i+A/2) give on W
    with each head's rows regrouped evens-then-odds: a reference that shares no rope code path."""
    torch.manual_seed(0)
    H, G, A = 4, 2, 8
    inter = Attention(D, num_heads=H, num_kv_heads=G, rope_interleave=True)
    half = Attention(D, num_heads=H, num_kv_heads=G)
    regroup_A = torch.cat([torch.arange(0, A, 2), torch.arange(1, A, 2)])
    with torch.no_grad():
        half.wq.weight.copy_(inter.wq.weight.view(H, A, D)[:, regroup_A].reshape(H * A, D))
        half.wk.weight.copy_(inter.wk.weight.view(G, A, D)[:, regroup_A].reshape(G * A, D))
        half.wv.weight.copy_(inter.wv.weight)
        half.wo.weight.copy_(inter.wo.weight)
    cos_SA, sin_SA = rope_table(A, S, theta=100.0)
    x = hidden_states()
    torch.testing.assert_close(inter(x, cos_SA, sin_SA), half(x, cos_SA, sin_SA), rtol=1e-6, atol=1e-6)
    # The layout matters: the same weights with rotate-half pairs give another output.
    same_weights = Attention(D, num_heads=H, num_kv_heads=G)
    same_weights.load_state_dict(inter.state_dict())
    assert not torch.allclose(inter(x, cos_SA, sin_SA), same_weights(x, cos_SA, sin_SA), atol=1e-3)


def test_interleaved_rope_rotates_adjacent_pairs_by_hand():
    """Hand-worked: A = 4, one position at angles (a, b) for the two pairs."""
    a, b = 0.3, 0.05
    cos_SA = torch.tensor([[torch.cos(torch.tensor(a)), torch.cos(torch.tensor(b))] * 2])
    sin_SA = torch.tensor([[torch.sin(torch.tensor(a)), torch.sin(torch.tensor(b))] * 2])
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    out = apply_rope(x, cos_SA, sin_SA, interleave=True).flatten()
    ca, sa, cb, sb = cos_SA[0, 0], sin_SA[0, 0], cos_SA[0, 1], sin_SA[0, 1]
    # Pair (x0, x1) turns by a, pair (x2, x3) by b; the output lists first and then second members.
    expected = torch.stack([1 * ca - 2 * sa, 3 * cb - 4 * sb, 2 * ca + 1 * sa, 4 * cb + 3 * sb])
    torch.testing.assert_close(out, expected)
