"""Rope scaling (``model.rope_scaling``: linear, llama3, yarn, dynamic) against transformers, the independent
reference, at positions past the pretraining context the scaling stretches: the rotary tables
against transformers' rotary embedding; DeepSeek-V3's latent attention with its yarn temperatures
(mscale on cos/sin, mscale_all_dim on the softmax) against transformers' attention module; decoding
with the latent cache against the full forward; every Hugging Face family converted both ways
(logits and config.json's rope parameters); a Llama-3.1-style dense model upcycled. Then the rules:
every bad field named, and the rope types moetrain lacks refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek
from transformers.models.llama import modeling_llama as hf_llama

from moetrain.cli import main as cli_main
from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.convert import config_from_dict, config_to_dict
from moetrain.config.rope import RopeScaling
from moetrain.interop.export import build_model, read_export
from moetrain.interop.hf.family import rope_fields
from moetrain.interop.hf.registry import FAMILIES
from moetrain.models.attention import rope_rows, rope_table, rope_table_for
from moetrain.models.transformer import Transformer, build_attention
from tests.helpers import hf_tiny_dense, hf_tiny_models

TOL = {"rtol": 0.0, "atol": 1e-5}
LOGIT_TOL = {"rtol": 0.0, "atol": 1e-4}
SEQ = 48  # past every original context below; the tiny models hold 64 positions
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    # 32 positions of pretraining: at theta 500 and 16 features the pairs fall in all three bands.
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16,
                      "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-exact-ends": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16,
                        "truncate": False},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},  # with max_position_embeddings 16: see tiny_hf
}


def hf_rope(name: str, theta: float = 500.0) -> dict:
    return {**SCALINGS[name], "rope_theta": theta}


def scaling(name: str, *, softmax_mscale: bool = True) -> RopeScaling:
    found = rope_fields({"rope_parameters": hf_rope(name), "max_position_embeddings": 64},
                        softmax_mscale=softmax_mscale)["rope_scaling"]
    assert isinstance(found, RopeScaling)
    return found


# --- the rotary table and attention against transformers ---------------------------------------


@pytest.mark.parametrize("name", [n for n in SCALINGS if n != "dynamic"])
def test_rotary_table_matches_transformers(name):
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                   max_position_embeddings=64, rope_parameters=hf_rope(name))
    cos_1SA, sin_1SA = hf_llama.LlamaRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(64)[None])
    cos_SA, sin_SA = rope_table(16, 64, theta=500.0, scaling=scaling(name))
    torch.testing.assert_close(cos_SA, cos_1SA[0], **TOL)
    torch.testing.assert_close(sin_SA, sin_1SA[0], **TOL)
    plain_cos_SA, _ = rope_table(16, 64, theta=500.0)
    assert (cos_SA[16:] - plain_cos_SA[16:]).abs().max() > 0.1  # the scaling acts past the original context


def test_dynamic_rows_match_transformers_within_and_past_the_original_context():
    """transformers' dynamic NTK recomputes the frequencies for the length of each forward: a
    fresh rotary embedding per length, against ``rope_rows`` of the model's table."""
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                   max_position_embeddings=16, rope_parameters=hf_rope("dynamic"))
    found = rope_fields(cfg.to_dict())
    model_cfg = ModelConfig(vocab_size=8, dim=32, num_heads=2, max_seq_len=found["max_seq_len"],
                            rope_theta=found["rope_theta"], rope_scaling=found["rope_scaling"])
    assert model_cfg.max_seq_len == 64
    table = rope_table_for(model_cfg)
    for length in (12, 16, 17, 48, 64):
        cos_1SA, sin_1SA = hf_llama.LlamaRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(length)[None])
        cos_SA, sin_SA = rope_rows(model_cfg, *table, 0, length)
        torch.testing.assert_close(cos_SA, cos_1SA[0], **TOL)
        torch.testing.assert_close(sin_SA, sin_1SA[0], **TOL)
    plain_cos_SA, _ = rope_table(16, 48, theta=500.0)
    assert (rope_rows(model_cfg, *table, 0, 48)[0] - plain_cos_SA).abs().max() > 0.1


def test_dynamic_decoding_matches_transformers_cached_generation():
    """Each decoded token rotates with the stretch of the sequence so far and the cached keys
    keep theirs, in transformers as here, so the cached logits differ from the full forward's."""
    hf = tiny_hf("llama", "dynamic")
    ids = hf_tiny_models.input_ids(batch=1, seq=40)
    with torch.no_grad():
        out = hf(ids[:, :12], use_cache=True)
        want = [out.logits]
        for t in range(12, 40):
            out = hf(ids[:, t:t + 1], cache=out.past_key_values, use_cache=True)
            want.append(out.logits)
    family = FAMILIES["llama"]
    model_cfg, moe_cfg = family.configs_from_hf(hf.config.to_dict())
    ours = Transformer(model_cfg, moe=moe_cfg).eval()
    names = {e.mt: e.hf for e in family.tensor_map(model_cfg, moe_cfg, fused=False)}
    hf_sd = hf.state_dict()
    ours.load_state_dict({mt: hf_sd[h] for mt, h in names.items()}, strict=True)
    got = decoded_logits(ours, ids)
    torch.testing.assert_close(got, torch.cat(want, dim=1), **LOGIT_TOL)
    with torch.no_grad():
        assert (got[:, 20:] - ours(ids).logits[:, 20:]).abs().max() > 1e-3


def test_llama3_keeps_short_wavelengths_interpolates_long_ones_and_blends_between():
    from moetrain.models.attention import rope_frequencies

    plain = rope_frequencies(16, theta=500.0)
    scaled = rope_frequencies(16, theta=500.0, scaling=scaling("llama3"))
    ratio = (plain / scaled).tolist()
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(8.0)
    assert any(1.0 < r < 8.0 for r in ratio)  # the smooth band is exercised by the table test too


def deepseek_attention_config(name: str):
    return transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, q_lora_rank=12,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rope_interleave=True,
        max_position_embeddings=64, rope_parameters=hf_rope(name), attn_implementation="eager")


MLA_NAMES = {"q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b", "kv_a_proj_with_mqa": "wkv_a",
             "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}


@pytest.mark.parametrize("name", ["yarn-deepseek", "yarn", "linear"])
def test_deepseek_v3_latent_attention_matches_transformers(name):
    """transformers' own attention module and rotary embedding: the yarn temperature on the rotary
    features (cos and sin) and DeepSeek's on the whole softmax (mscale_all_dim) both show."""
    cfg = deepseek_attention_config(name)
    hf_attn = hf_deepseek.DeepseekV3Attention(cfg, 0).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for pname, p in hf_attn.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1 + noise if "norm" in pname else noise)
    model_cfg = ModelConfig(vocab_size=8, dim=32, num_heads=4, max_seq_len=64, attention="mla", q_lora_rank=12,
                            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
                            rope_interleave=True, rope_theta=500.0, rope_scaling=scaling(name))
    ours = build_attention(model_cfg)
    ours.load_state_dict({f"{MLA_NAMES[k.rpartition('.')[0]]}.{k.rpartition('.')[2]}": v
                          for k, v in hf_attn.state_dict().items()}, strict=True)
    x_BSD = torch.randn(2, SEQ, 32, generator=gen)
    cos_1SP, sin_1SP = hf_deepseek.DeepseekV3RotaryEmbedding(cfg)(x_BSD, torch.arange(SEQ)[None])
    causal_11SS = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = hf_attn(x_BSD, position_embeddings=(cos_1SP, sin_1SP), attention_mask=causal_11SS)
        cos_SP, sin_SP = rope_table_for(model_cfg)
        got = ours(x_BSD, cos_SP[:SEQ], sin_SP[:SEQ])
    torch.testing.assert_close(got, want, **TOL)
    if name == "yarn-deepseek":  # the softmax temperature matters: without it the output moves
        assert model_cfg.softmax_scale is not None
        ours.softmax_scale = None
        with torch.no_grad():
            assert (ours(x_BSD, cos_SP[:SEQ], sin_SP[:SEQ]) - want).abs().max() > 1e-3


@torch.no_grad()
def decoded_logits(model: Transformer, ids_BS: torch.Tensor) -> torch.Tensor:
    """A 12-token prefill through the cache, then one token at a time."""
    cache = model.new_cache(ids_BS.shape[0])
    pieces = [model(ids_BS[:, :12], cache=cache).logits]
    pieces += [model(ids_BS[:, s:s + 1], cache=cache).logits for s in range(12, ids_BS.shape[1])]
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_decoding_with_the_cache_equals_the_full_forward(attention):
    """The cache paths (the latent cache's absorbed attention takes the softmax scale itself) give
    the full forward's logits with yarn's temperatures; without the softmax one they do not."""
    dims = ({"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6,
             "v_head_dim": 10} if attention == "mla" else {"num_kv_heads": 2})
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=32, moe_every=0,
                      rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_seq_len=8, mscale=0.707,
                                               mscale_all_dim=1.0), **dims)
    model = Transformer(cfg, seed=3).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # weights drawn large: sharp attention, so a wrong scale or position shows
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            p.copy_(1 + noise if "norm" in name else noise)
        ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))
        full = model(ids).logits
    torch.testing.assert_close(decoded_logits(model, ids), full, rtol=1e-5, atol=2e-5)
    for layer in model.layers:
        layer.attention.softmax_scale = None
    assert (decoded_logits(model, ids) - full).abs().max() > 0.1


# --- Hugging Face: every family both ways, and upcycling -----------------------------------------

FAMILY_ROPE = [("mixtral", "yarn"), ("qwen2_moe", "linear"), ("qwen3_moe", "llama3"), ("olmoe", "yarn-exact-ends"),
               ("deepseek_v3", "yarn-deepseek"), ("deepseek_v2_lite", "yarn"), ("llama", "llama3"),
               ("qwen3", "yarn-deepseek"), ("mixtral", "dynamic"), ("deepseek_v2_lite", "dynamic"),
               ("llama", "dynamic")]


def tiny_hf(case: str, rope_name: str):
    rope = hf_rope(rope_name)
    # transformers' dynamic scaling starts past max_position_embeddings; moetrain then holds 4x.
    extra = {"max_position_embeddings": 16} if rope_name == "dynamic" else {}
    if case in hf_tiny_dense.DENSE_FAMILIES:
        return hf_tiny_dense.tiny_dense(case, rope_parameters=rope, **extra)
    if case == "mixtral":  # transformers' yarn and dynamic read head_dim, which MixtralConfig leaves None
        extra["head_dim"] = 8
    return hf_tiny_models.tiny_model(case, rope_parameters=rope, **extra)


def rope_entries(config: dict) -> dict:
    return {k: v for k, v in config["rope_parameters"].items() if k != "type"}


@pytest.mark.parametrize("case, rope_name", FAMILY_ROPE, ids=[f"{c}-{r}" for c, r in FAMILY_ROPE])
def test_convert_round_trips_each_family(tmp_path, case, rope_name):
    hf = tiny_hf(case, rope_name)
    hf.save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    config, sd, _ = read_export(tmp_path / "mt")
    assert config["model"]["rope_scaling"]["rope_type"] == SCALINGS[rope_name]["rope_type"]
    assert config["model"]["max_seq_len"] == 64  # dynamic: 4x transformers' max_position_embeddings
    ids = hf_tiny_models.input_ids(seq=SEQ)
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(build_model(config, sd).eval()(ids).logits, want, **LOGIT_TOL)

    assert cli_main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "back")]) == 0
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["max_position_embeddings"] == source["max_position_embeddings"]
    if case == "qwen3":  # standard attention: mscale / mscale_all_dim fold into the cos/sin scale
        assert "mscale_all_dim" not in written["rope_parameters"] and "attention_factor" in written["rope_parameters"]
    else:
        assert rope_entries(written) == rope_entries(source)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, **LOGIT_TOL)


def test_a_llama3_dense_model_upcycles_with_the_dense_logits(tmp_path):
    hf = tiny_hf("llama", "llama3")
    hf.save_pretrained(tmp_path / "dense")
    (tmp_path / "dense" / "tokenizer_config.json").write_text("{}")
    args = ["upcycle", "--from-hf", str(tmp_path / "dense"), "--to", str(tmp_path / "up"), "--num-experts", "4",
            "--top-k", "2"]
    assert cli_main(args) == 0
    config, sd, _ = read_export(tmp_path / "up")
    assert config["model"]["rope_scaling"]["rope_type"] == "llama3"
    ids = hf_tiny_models.input_ids(seq=SEQ)
    with torch.no_grad():
        torch.testing.assert_close(build_model(config, sd).eval()(ids).logits, hf(ids).logits, **LOGIT_TOL)


# --- rules ----------------------------------------------------------------------------------------

BAD = [
    ({"rope_type": "longrope"}, r"model\.rope_scaling\.rope_type \('longrope'\) must be one of 'linear'"),
    ({"rope_type": "linear", "factor": 0.5}, r"model\.rope_scaling\.factor \(0\.5\) must be a number >= 1"),
    ({"rope_type": "linear", "factor": 2.0, "original_max_seq_len": 16},
     r"model\.rope_scaling\.original_max_seq_len \(16\) acts only with rope_type 'llama3' or 'yarn'"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_seq_len": 16, "low_freq_factor": 1.0},
     r"model\.rope_scaling\.high_freq_factor \(None\) is required with rope_type 'llama3'"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_seq_len": 16, "low_freq_factor": 4.0,
      "high_freq_factor": 1.0}, r"model\.rope_scaling\.high_freq_factor \(1\.0\) must be > "),
    ({"rope_type": "yarn", "factor": 4.0}, r"model\.rope_scaling\.original_max_seq_len \(None\) is required"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16, "mscale_all_dim": -1.0},
     r"model\.rope_scaling\.mscale_all_dim \(-1\.0\) must be None or a number > 0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16, "mscale": 1.0},
     r"model\.rope_scaling\.mscale \(1\.0\) acts only with mscale_all_dim set and attention_factor None"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16, "low_freq_factor": 1.0},
     r"model\.rope_scaling\.low_freq_factor \(1\.0\) acts only with rope_type 'llama3'"),
    ({"rope_type": "linear", "factor": 2.0, "truncate": False},
     r"model\.rope_scaling\.truncate \(False\) acts only with rope_type 'yarn'"),
    ({"rope_type": "linear", "factor": 2.0, "scale": 3}, r"model\.rope_scaling .* has unknown fields scale"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"model\.rope_scaling\.original_max_seq_len \(None\) is required"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16, "beta_fast": 1.0, "beta_slow": 32.0},
     r"model\.rope_scaling\.beta_fast \(1\.0\) must be > model\.rope_scaling\.beta_slow \(32\.0\)"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16, "beta_slow": 40.0},
     r"model\.rope_scaling\.beta_fast \(32\.0\) must be > model\.rope_scaling\.beta_slow \(40\.0\)"),
]


@pytest.mark.parametrize("values, message", BAD, ids=[str(v) for v, _ in BAD])
def test_bad_rope_scaling_names_field_value_and_rule(values, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(rope_scaling=values)


def test_yaml_values_build_and_write_back():
    raw = {"model": {"rope_scaling": {"rope_type": "yarn", "factor": "40", "original_max_seq_len": 8,
                                                        "mscale_all_dim": 1}}}
    cfg = config_from_dict(raw)
    assert cfg.model.rope_scaling == RopeScaling(rope_type="yarn", factor=40.0, original_max_seq_len=8,
                                                 mscale_all_dim=1.0)
    assert config_from_dict(config_to_dict(cfg)).model == cfg.model
    with pytest.raises(ValueError, match=r"model\.rope_scaling\.factor \('x'\) must be a number"):
        config_from_dict({"model": {"rope_scaling": {"rope_type": "linear", "factor": "x"}}})


def test_no_scaling_keeps_the_plain_table_and_softmax():
    cfg = ModelConfig(vocab_size=64)
    assert cfg.rope_scaling is None and cfg.softmax_scale is None
    for got, want in zip(rope_table_for(cfg), rope_table(cfg.rope_dim, cfg.max_seq_len, theta=cfg.rope_theta),
                         strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["longrope", "proportional"])
def test_rope_types_moetrain_lacks_are_refused_in_one_line(kind):
    hf = hf_tiny_models.hf_config("mixtral").to_dict()
    hf["rope_parameters"] = {"rope_type": kind, "factor": 2.0, "rope_theta": 500.0}
    with pytest.raises(ValueError, match=rf"config.json rope_parameters.rope_type \('{kind}'\) must be") as err:
        FAMILIES["mixtral"].configs_from_hf(hf)
    assert "\n" not in str(err.value)


def test_standard_attention_families_cannot_write_the_softmax_temperature():
    model = ModelConfig(vocab_size=64, dim=32, num_heads=4, activation="swiglu",
                        rope_scaling=scaling("yarn-deepseek"))
    with pytest.raises(ValueError, match=r"model\.rope_scaling\.mscale_all_dim \(1\.0\) must be None: Mixtral"):
        FAMILIES["mixtral"].hf_config_from(model, MoEConfig(activation="swiglu"))


def test_the_released_configs_import_as_written():
    """DeepSeek-V3's and Llama-3.1's config.json rope entries (transformers-4 ``rope_scaling``
    beside a top-level ``rope_theta``) at their real lengths."""
    deepseek = hf_tiny_models.hf_config("deepseek_v3").to_dict()
    del deepseek["rope_parameters"]
    deepseek.update(max_position_embeddings=163840, rope_theta=10000, rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0})
    model, _ = FAMILIES["deepseek_v3"].configs_from_hf(deepseek)
    assert model.max_seq_len == 163840 and model.rope_theta == 10000.0
    assert model.rope_scaling == RopeScaling(rope_type="yarn", factor=40, original_max_seq_len=4096, beta_fast=32,
                                             beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    assert model.rope_scaling.cos_sin_scale == 1.0  # DeepSeek's mscale equals mscale_all_dim
    m = 0.1 * 1.0 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1
    assert model.softmax_scale == pytest.approx(m * m / (8 + 4) ** 0.5)
    llama = hf_tiny_dense.dense_config("llama").to_dict()
    del llama["rope_parameters"]
    llama.update(max_position_embeddings=131072, rope_theta=500000.0, rope_scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"})
    model, _ = FAMILIES["llama"].configs_from_hf(llama)
    assert model.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, original_max_seq_len=8192,
                                             low_freq_factor=1.0, high_freq_factor=4.0)
    assert model.softmax_scale is None


def test_yarn_without_a_factor_takes_the_ratio_of_the_two_lengths():
    found = rope_fields({"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "original_max_position_embeddings": 16, "rope_theta": 1e4}})["rope_scaling"]
    assert found == RopeScaling(rope_type="yarn", factor=4.0, original_max_seq_len=16)


@pytest.mark.parametrize("name", ["yarn-deepseek", "dynamic"])
def test_pipeline_stages_rotate_as_the_whole_model(name):
    """Two stages built on the meta device and materialised (their own rotary table, through
    ``rope_table_for``; positions through ``rope_rows``) give the whole model's logits past the
    original context."""
    from moetrain.distributed.pipeline.stages import build_pipeline_model

    found = rope_fields({"rope_parameters": hf_rope(name), "max_position_embeddings": 16})
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=64, moe_every=0,
                      rope_theta=found["rope_theta"], rope_scaling=found["rope_scaling"])
    whole = Transformer(cfg, seed=3).eval()
    with torch.device("meta"):
        meta = Transformer(cfg, seed=3)
    pm = build_pipeline_model(meta, pp_rank=0, pp=1, virtual_stages=2, device=torch.device("cpu"), seed=3).eval()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = pm.chunks[0](ids)
        torch.testing.assert_close(pm.chunks[1](h), whole(ids).logits, rtol=0, atol=1e-6)
