"""Parameter and FLOP counts: the config formulas equal the instantiated models, and the large
presets (never built here) match their published sizes."""

import pytest

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.presets import PRESETS, get_preset
from moetrain.models.transformer import Transformer, count_params, flops_per_token

TOKENIZER_VOCAB = 4096


@pytest.mark.parametrize("name", ["tiny", "tiny-dense"])
def test_tiny_preset_counts_equal_the_instantiated_model(name):
    p = PRESETS[name]
    model = Transformer(p.model.with_vocab_size(TOKENIZER_VOCAB), moe=p.moe)
    assert model.param_counts() == count_params(p.model, p.moe, vocab_size=TOKENIZER_VOCAB)


VARIANTS = [
    {},
    {"model": {"activation": "swiglu", "dense_hidden_dim": 48, "moe_every": 2},
     "moe": {"activation": "swiglu"}},
    {"model": {"num_kv_heads": 1, "tie_embeddings": True}},
    {"moe": {"num_shared_experts": 2, "top_k": 3}},
    {"moe": {"num_shared_experts": 1, "shared_hidden_dim": 40}},
    {"model": {"moe_layer_offset": 1, "moe_every": 1, "num_layers": 3}},
    {"model": {"moe_every": 0}},
    {"model": {"head": "classifier", "num_classes": 7, "tie_embeddings": True}},
    {"model": {"head": "classifier", "num_classes": 7, "pooling": "attention", "causal": False}},
    {"model": {"num_kv_heads": 2, "qkv_bias": True}},  # Qwen2-MoE
    {"model": {"num_kv_heads": 2, "head_dim": 12, "qk_norm": "head"}},  # Qwen3-MoE
    {"model": {"num_kv_heads": 2, "qk_norm": "full", "clip_qkv": 8.0}},  # OLMoE
    {"model": {"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6,
               "v_head_dim": 10}},  # DeepSeek-V2-Lite
    {"model": {"attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
               "qk_rope_head_dim": 6, "v_head_dim": 10, "rope_interleave": True}},  # DeepSeek-V3
    {"model": {"num_layers": 4, "moe_every": 1, "dense_layers": (0, 3)}},
    {"model": {"num_layers": 3, "moe_every": 2, "moe_layer_offset": 1, "dense_layers": (1,)}},  # all dense
]


@pytest.mark.parametrize("variant", VARIANTS, ids=[str(v) for v in VARIANTS])
def test_count_formula_equals_the_instantiated_model(variant):
    base_model = {"vocab_size": 100, "dim": 32, "num_layers": 2, "num_heads": 4, "max_seq_len": 16}
    model = ModelConfig(**{**base_model, **variant.get("model", {})})
    moe = MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden_dim": 24, **variant.get("moe", {})})
    built = Transformer(model, moe=moe).param_counts()
    assert built == count_params(model, moe)
    assert built.total == built.expert + built.non_expert
    assert built.active == built.non_expert + built.expert * moe.top_k // moe.num_experts


def test_mixtral_8x7b_matches_the_published_size():
    p = get_preset("mixtral-8x7b")
    c = count_params(p.model, p.moe)
    assert c.total == 46_702_792_704  # the released checkpoint's parameter count
    assert c.active / 1e9 == pytest.approx(12.9, abs=0.05)
    assert c.embedding == 32000 * 4096


def test_deepseek_moe_16b_matches_the_published_size():
    p = get_preset("deepseek-moe-16b")
    c = count_params(p.model, p.moe)
    assert c.total / 1e9 == pytest.approx(16.4, abs=0.05)
    assert c.active / 1e9 == pytest.approx(2.8, abs=0.05)
    assert p.model.moe_layer_ids == list(range(1, 28))  # first block dense


def test_tiny_dense_has_the_active_parameters_of_tiny():
    moe, dense = (count_params(PRESETS[n].model, PRESETS[n].moe, vocab_size=TOKENIZER_VOCAB)
                  for n in ("tiny", "tiny-dense"))
    tiny = PRESETS["tiny"]
    routers = tiny.model.num_layers * tiny.model.dim * tiny.moe.num_experts
    assert moe.active - dense.active == routers  # the routers are the only difference
    assert moe.total > 2 * dense.total


def test_flops_per_token():
    p = get_preset("mixtral-8x7b")
    c = count_params(p.model, p.moe)
    attention = 12 * 32 * 4096 * 4096
    assert flops_per_token(p.model, p.moe, seq_len=4096) == 6 * (c.active - c.embedding) + attention
    tiny = PRESETS["tiny"]  # tied: the embedding table is the LM head's matmul
    c = count_params(tiny.model, tiny.moe, vocab_size=TOKENIZER_VOCAB)
    assert flops_per_token(tiny.model, tiny.moe, seq_len=256, vocab_size=TOKENIZER_VOCAB) == \
        6 * c.active + 12 * 4 * 128 * 256
    built = Transformer(tiny.model.with_vocab_size(TOKENIZER_VOCAB), moe=tiny.moe)
    assert built.flops_per_token(256) == 6 * c.active + 12 * 4 * 128 * 256


def test_count_needs_a_vocab_size():
    p = PRESETS["tiny"]
    with pytest.raises(ValueError, match=r"model\.vocab_size \(None\)"):
        count_params(p.model, p.moe)


def test_presets_are_valid_configs():
    for name, p in PRESETS.items():
        assert p.model.preset is None and p.description
        assert p.model.is_moe == (name != "tiny-dense")
    with pytest.raises(ValueError, match=r"model\.preset \('huge'\)"):
        get_preset("huge")


def test_flops_count_the_real_attention_dims():
    """QK^T over H heads of A features and AV over H heads of U value features, forward and backward:
    6 * L * H * (A + U) * S per token."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=24)
    base = {"vocab_size": 100, "dim": 32, "num_layers": 2, "num_heads": 4, "max_seq_len": 16}
    mla = ModelConfig(**base, attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6,
                      v_head_dim=10)
    c = count_params(mla, moe)
    assert flops_per_token(mla, moe, seq_len=16) == 6 * (c.active - c.embedding) + 6 * 2 * 4 * (14 + 10) * 16
    wide = ModelConfig(**base, head_dim=12)  # A = 12 != 32 / 4
    c = count_params(wide, moe)
    assert flops_per_token(wide, moe, seq_len=16) == 6 * (c.active - c.embedding) + 12 * 2 * 4 * 12 * 16


def test_attention_parameter_counts_by_hand():
    """D 32, H 4, G 2; a few terms written out."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=24)
    base = {"vocab_size": 100, "dim": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "max_seq_len": 16}
    plain = count_params(ModelConfig(**base), moe).total
    assert count_params(ModelConfig(**base, qkv_bias=True), moe).total - plain == 32 + 16 + 16
    assert count_params(ModelConfig(**base, qk_norm="head"), moe).total - plain == 8 + 8
    assert count_params(ModelConfig(**base, qk_norm="full"), moe).total - plain == 32 + 16
    # head_dim 12: wq [48, 32], wk and wv [24, 32], wo [32, 48] against 8's [32, 32], [16, 32] x2, [32, 32].
    assert count_params(ModelConfig(**base, head_dim=12), moe).total - plain == (48 + 24 + 24 + 48 - 96) * 32
