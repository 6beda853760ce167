"""Hugging Face interop beyond the logits (tests/unit/test_hf_families.py has those): configs
both ways and every refusal naming its field, family detection, sharded inputs and outputs, a
bf16 export that keeps the fp32 router bias, missing and unexpected tensors listed (DeepSeek's
multi-token-prediction layers: tests/unit/test_hf_mtp.py), and the streaming reader/writer itself."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from moetrain.cli import main as cli_main
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import write_export
from moetrain.interop.hf.registry import FAMILIES, choose_family
from moetrain.utils.safetensors_io import SafetensorsFolder, ShardedWriter, TensorSpec, parse_size
from tests.helpers.hf_tiny_models import input_ids, tiny_model

MIXTRAL = FAMILIES["mixtral"]


def test_mixtral_config_round_trip_and_refusals():
    model, moe = MIXTRAL.configs_from_hf(MIXTRAL.hf_config_from(
        ModelConfig(vocab_size=300, dim=64, num_heads=8, num_kv_heads=2, rope_theta=1e6, tie_embeddings=True,
                    activation="swiglu"),
        MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=96, activation="swiglu")))
    assert (model.dim, model.num_heads, model.resolved_num_kv_heads, model.rope_theta, model.tie_embeddings) \
        == (64, 8, 2, 1e6, True)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden_dim, moe.activation) == (8, 2, 96, "swiglu")
    with pytest.raises(ValueError, match="moe.activation"):
        MIXTRAL.hf_config_from(ModelConfig(vocab_size=300), MoEConfig(activation="gelu"))
    with pytest.raises(ValueError, match="moe.num_shared_experts"):
        MIXTRAL.hf_config_from(ModelConfig(vocab_size=300), MoEConfig(activation="swiglu", num_shared_experts=1))
    with pytest.raises(ValueError, match="every block must be MoE"):
        MIXTRAL.hf_config_from(ModelConfig(vocab_size=300, moe_every=2, activation="swiglu"),
                               MoEConfig(activation="swiglu"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MIXTRAL.configs_from_hf({"model_type": "mixtral", "hidden_size": 32, "num_attention_heads": 4,
                                 "vocab_size": 50, "num_hidden_layers": 1, "num_local_experts": 4,
                                 "num_experts_per_tok": 1, "intermediate_size": 8})


@pytest.mark.parametrize("family, hf_overrides, field", [
    ("mixtral", {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ("olmoe", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob"),
])
def test_import_refuses_what_moetrain_lacks_by_name(family, hf_overrides, field):
    from tests.helpers.hf_tiny_models import hf_config

    hf = hf_config(family).to_dict()
    hf.update(hf_overrides)
    with pytest.raises(ValueError, match=f"config.json {field}"):
        FAMILIES[family].configs_from_hf(hf)


def test_export_family_detection():
    plain = ModelConfig(vocab_size=80, dim=32, num_heads=4, activation="swiglu")
    assert choose_family(plain, MoEConfig(activation="swiglu")).model_type == "mixtral"
    head_norm = ModelConfig(vocab_size=80, dim=32, num_heads=4, qk_norm="head", activation="swiglu")
    assert choose_family(head_norm, MoEConfig(activation="swiglu", renormalize=False)).model_type == "qwen3_moe"
    with pytest.raises(ValueError, match="no Hugging Face family can express this model") as err:
        choose_family(plain, MoEConfig(activation="swiglu", router="sigmoid"))
    assert "deepseek_v3: model.attention ('mha') must be \"mla\"" in str(err.value)
    with pytest.raises(ValueError, match="--family"):
        choose_family(plain, MoEConfig(activation="swiglu"), "gpt2")
    with pytest.raises(ValueError, match=r"cannot be written as Qwen2-MoE.*moe.num_shared_experts"):
        FAMILIES["qwen2_moe"].hf_config_from(plain, MoEConfig(activation="swiglu"))


def test_sharded_input_and_output(tmp_path):
    hf = tiny_model("qwen2_moe")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt"),
                     "--max-shard-size", "50KB"]) == 0
    index = json.loads((tmp_path / "mt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert cli_main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "back"), "--max-shard-size",
                     "60KB"]) == 0
    files = sorted(p.name for p in (tmp_path / "back").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-4, rtol=0)


def test_bf16_export_keeps_the_fp32_router_bias_and_says_what_it_cast(tmp_path, capsys):
    hf = tiny_model("deepseek_v3")
    hf.save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    assert cli_main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    printed = capsys.readouterr().out
    folder = SafetensorsFolder(tmp_path / "bf16")
    # The router (selection bias and gate) stays fp32, as transformers keeps it.
    router = [n for n in folder.names() if n.endswith(("e_score_correction_bias", "mlp.gate.weight"))]
    assert len(router) == 4 and all(folder.info(n).dtype == torch.float32 for n in router)
    assert all(folder.info(n).dtype == torch.bfloat16 for n in folder.names() if n not in router)
    record = json.loads((tmp_path / "bf16" / "moetrain_conversion.json").read_text())
    assert record["dtype"] == "bfloat16" and len(record["kept_fp32"]) == 4
    assert len(record["cast"]) == len(SafetensorsFolder(tmp_path / "mt").names()) - 4  # moetrain names
    assert "kept in fp32: layers.1.feed_forward.router.expert_bias" in printed
    # The bias went through unrounded (it is not a bf16 number).
    want = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(folder.get("model.layers.1.mlp.gate.e_score_correction_bias"), want)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_missing_and_unexpected_tensors_are_listed(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf = tiny_model("olmoe")
    hf.save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 2
    err = capsys.readouterr().err
    assert "tensors it lacks: model.layers.1.self_attn.q_norm.weight" in err
    assert "tensors with no moetrain place: model.layers.0.mlp.surprise.weight" in err
    assert not (tmp_path / "mt").exists() or not any((tmp_path / "mt").iterdir())


def test_export_refuses_state_the_family_cannot_hold(tmp_path):
    from moetrain.models.transformer import Transformer

    model_cfg = ModelConfig(vocab_size=80, dim=32, num_layers=1, num_heads=4, activation="swiglu")
    moe_cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, activation="swiglu")
    sd = Transformer(model_cfg, moe=moe_cfg).state_dict()
    sd["layers.0.feed_forward.router.expert_bias"] = torch.zeros(4)
    config = {"model": {"vocab_size": 80, "dim": 32, "num_layers": 1, "num_heads": 4, "activation": "swiglu"},
              "moe": {"num_experts": 4, "top_k": 2, "expert_hidden_dim": 16, "activation": "swiglu"}}
    write_export(tmp_path / "mt", config=config, state_dict=sd)
    with pytest.raises(ValueError, match="tensors Mixtral has no place for: layers.0.feed_forward.router.expert_bias"):
        from moetrain.interop.hf import export_hf

        export_hf(tmp_path / "mt", tmp_path / "hf")


def test_streaming_writer_and_reader(tmp_path):
    tensors = {"a": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(2, dtype=torch.bfloat16),
               "c": torch.zeros(0, 5), "d": torch.tensor(7, dtype=torch.int64)}
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    with ShardedWriter(tmp_path, specs, metadata={"format": "pt"}, max_shard_bytes=40) as w:
        for k, v in tensors.items():
            w.write(k, v)
        files = w.close()
    assert [p.name for p in files][-1] == "model.safetensors.index.json"
    from safetensors.torch import load_file

    for f in files[:-1]:
        load_file(str(f))  # the reference reader accepts every shard
    folder = SafetensorsFolder(tmp_path)
    for k, v in tensors.items():
        assert folder.get(k).dtype == v.dtype and torch.equal(folder.get(k), v)
    assert torch.equal(folder.get_rows("a", 1, 3), tensors["a"][1:3])
    with pytest.raises(ValueError, match="does not match its planned"), \
            ShardedWriter(tmp_path / "x", specs, metadata={}) as w:
        w.write("a", torch.zeros(3, 3))
    assert not list((tmp_path / "x").iterdir())  # the partial file is gone
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20
    with pytest.raises(ValueError, match="--max-shard-size"):
        parse_size("lots")


def test_convert_cli_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["convert", "--from-hf", str(tmp_path)])  # no --to
    with pytest.raises(SystemExit):
        cli_main(["convert", "--from-hf", str(tmp_path), "--to", str(tmp_path / "o"), "--fused"])
    assert cli_main(["convert", "--from-hf", str(tmp_path), "--to", str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
