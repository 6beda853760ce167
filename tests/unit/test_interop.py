"""Hugging Face interop: a tiny random MixtralForCausalLM built by `transformers` (no download)
converted to moetrain gives the same logits, and a moetrain model converted to the Hugging Face
layout loads in `transformers` with no missing or unexpected weights and gives the same logits.
`transformers` is the independent reference: its Mixtral is a separate implementation."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moetrain.cli import main as cli_main
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import build_model, read_export, write_export
from moetrain.interop.hf_mixtral import configs_from_hf, hf_config_from

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never reach for the Hub
transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _tiny_mixtral(*, tie: bool = False):
    cfg = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        rope_theta=500.0, rms_norm_eps=1e-6, sliding_window=None, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            # A decisive router: with near-uniform scores (the default init) a top-2 choice may
            # hinge on the last bit, which is not what this test is about. (transformers 5
            # names the MoE block `mlp`, 4 `block_sparse_moe`.)
            moe_block = getattr(layer, "mlp", None) or layer.block_sparse_moe
            moe_block.gate.weight.mul_(8.0)
            # Norm gains != 1, so that a norm mapped to the wrong place shows.
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def _input_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_matches_transformers_logits(tmp_path, tie):
    hf = _tiny_mixtral(tie=tie)
    hf.save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0

    config, sd, _ = read_export(tmp_path / "mt")
    model = build_model(config, sd).eval()
    assert model.config.tie_embeddings is tie
    x = _input_ids(96)
    with torch.no_grad():
        want = hf(x).logits
        got = model(x).logits
    assert got.shape == want.shape == (2, 24, 96)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    # Expert e of layer 1 is the file's expert e (global order), transposed into [E, D, F].
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for e in range(4):
        w1_FD = saved[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"]
        assert torch.equal(sd["layers.1.feed_forward.experts.w1"][e], w1_FD.t())


def test_to_hf_loads_in_transformers_with_same_logits(tmp_path):
    model_cfg = ModelConfig(vocab_size=80, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64,
                            rope_theta=1000.0, norm_eps=1e-6)
    moe_cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=40, activation="swiglu",
                        router_init_std=0.3)
    from moetrain.models.transformer import Transformer

    ours = Transformer(model_cfg, moe=moe_cfg, seed=3).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    config = {"model": {"vocab_size": 80, "dim": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                        "max_seq_len": 64, "rope_theta": 1000.0, "norm_eps": 1e-6},
              "moe": {"num_experts": 4, "top_k": 2, "expert_hidden_dim": 40, "activation": "swiglu"}}
    write_export(tmp_path / "mt", config=config, state_dict=ours.state_dict())
    assert cli_main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "hf")]) == 0

    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["model_type"] == "mixtral" and hf_cfg["num_local_experts"] == 4
    hf, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf.eval()
    x = _input_ids(80)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x).logits, atol=TOL, rtol=0)


def test_config_round_trip_and_refusals():
    model, moe = configs_from_hf(hf_config_from(
        ModelConfig(vocab_size=300, dim=64, num_heads=8, num_kv_heads=2, rope_theta=1e6, tie_embeddings=True),
        MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=96, activation="swiglu")))
    assert (model.dim, model.num_heads, model.resolved_num_kv_heads, model.rope_theta, model.tie_embeddings) \
        == (64, 8, 2, 1e6, True)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden_dim, moe.activation) == (8, 2, 96, "swiglu")
    with pytest.raises(ValueError, match="moe.activation"):
        hf_config_from(ModelConfig(vocab_size=300), MoEConfig(activation="gelu"))
    with pytest.raises(ValueError, match="moe.num_shared_experts"):
        hf_config_from(ModelConfig(vocab_size=300), MoEConfig(activation="swiglu", num_shared_experts=1))
    with pytest.raises(ValueError, match="model.moe_every"):
        hf_config_from(ModelConfig(vocab_size=300, moe_every=2), MoEConfig(activation="swiglu"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        configs_from_hf({"model_type": "mixtral", "hidden_size": 32, "num_attention_heads": 4,
                         "vocab_size": 50, "num_hidden_layers": 1, "num_local_experts": 4,
                         "num_experts_per_tok": 1, "intermediate_size": 8})


def test_convert_cli_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["convert", "--from-hf", str(tmp_path)])  # no --to
    assert cli_main(["convert", "--from-hf", str(tmp_path), "--to", str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
