"""Dense Hugging Face families (Llama, Qwen3) both ways: a tiny random model built by
`transformers` from LlamaConfig / Qwen3Config (no download) converted to moetrain gives
transformers' logits, and a dense moetrain model (moetrain's own init, norms perturbed) converted
to the Hugging Face layout loads in ``AutoModelForCausalLM.from_pretrained`` with no missing or
unexpected weights and gives moetrain's logits. What the families cannot hold is refused, naming
the field."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from moetrain.cli import main as cli_main
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import build_model, read_export, write_export
from moetrain.interop.hf.registry import FAMILIES, choose_family
from moetrain.models.transformer import Transformer
from tests.helpers.hf_tiny_dense import DENSE_FAMILIES, VOCAB, dense_config, input_ids, tiny_dense

TOL = 1e-4


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_from_hf_gives_transformers_logits(tmp_path, family):
    hf = tiny_dense(family)
    hf.save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0

    config, sd, info = read_export(tmp_path / "mt")
    assert info["hf_family"] == family
    assert config["model"]["moe_every"] == 0 and config["model"]["dense_hidden_dim"] == 48
    assert config["model"]["qk_norm"] == ("head" if family == "qwen3" else "none")
    assert config["model"]["head_dim"] == (12 if family == "qwen3" else None)
    assert not any(".router." in n or ".experts." in n for n in sd)
    model = build_model(config, sd).eval()
    x = input_ids()
    with torch.no_grad():
        want, got = hf(x).logits, model(x).logits
    assert got.shape == want.shape == (2, 24, VOCAB)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def _perturbed_dense_model(family: str) -> Transformer:
    model_cfg, moe_cfg = FAMILIES[family].configs_from_hf(dense_config(family).to_dict())
    model = Transformer(model_cfg, moe=moe_cfg, seed=3).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
    return model


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_to_hf_loads_in_transformers_with_moetrain_logits(tmp_path, family):
    ours = _perturbed_dense_model(family)
    config = {"model": json.loads(json.dumps(ours.config.__dict__, default=list)),
              "moe": dict(ours.moe_config.__dict__)}
    write_export(tmp_path / "mt", config=config, state_dict=ours.state_dict())
    assert cli_main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "hf")]) == 0

    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["model_type"] == family  # the one family that fits, chosen without --family
    assert "num_experts" not in hf_cfg and "output_router_logits" not in hf_cfg
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    hf.eval()
    x = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x).logits, atol=TOL, rtol=0)


@pytest.mark.parametrize(("family", "key", "value"), [
    ("llama", "attention_bias", True),
    ("llama", "mlp_bias", True),
    ("llama", "hidden_act", "gelu"),
    ("qwen3", "use_sliding_window", True),
    ("qwen3", "layer_types", ["full_attention", "sliding_attention", "full_attention"]),
    ("qwen3", "attention_bias", True),
])
def test_configs_it_cannot_hold_are_refused_naming_the_key(family, key, value):
    hf = dense_config(family).to_dict()
    hf[key] = value
    with pytest.raises(ValueError, match=key):
        FAMILIES[family].configs_from_hf(hf)


def test_a_rope_scaling_moetrain_lacks_is_refused():
    hf = dense_config("llama").to_dict()
    hf["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(ValueError, match="rope_type"):
        FAMILIES["llama"].configs_from_hf(hf)


def test_dense_families_refuse_moe_models_and_moe_families_refuse_dense_ones():
    dense_cfg, moe_cfg = FAMILIES["llama"].configs_from_hf(dense_config("llama").to_dict())
    # The MoE families say why a dense model is not theirs; only Llama fits it.
    assert choose_family(dense_cfg, moe_cfg).model_type == "llama"
    moe_model = ModelConfig(**{**dense_cfg.__dict__, "moe_every": 1})
    moe = MoEConfig(num_experts=4, top_k=2, activation="swiglu", expert_hidden_dim=24)
    assert any("must be 0: Llama is dense" in p for p in FAMILIES["llama"].problems(moe_model, moe))
    assert choose_family(moe_model, moe).model_type == "mixtral"
    with pytest.raises(ValueError, match="must be 0: Qwen3 is dense"):
        FAMILIES["qwen3"].hf_config_from(ModelConfig(**{**moe_model.__dict__, "qk_norm": "head"}), moe)


def test_dense_model_with_gelu_mlps_is_refused():
    dense_cfg, moe_cfg = FAMILIES["llama"].configs_from_hf(dense_config("llama").to_dict())
    gelu = ModelConfig(**{**dense_cfg.__dict__, "activation": "gelu"})
    with pytest.raises(ValueError, match="model.activation"):
        FAMILIES["llama"].hf_config_from(gelu, moe_cfg)
