"""config.json variants transformers loads that the import read differently or refused: a
rope_scaling beside rope_parameters (transformers reads the rope_scaling), keys its config classes
default, a Mixtral head_dim other than hidden / heads, and linear rope with an
original_max_position_embeddings key (which transformers ignores). transformers' logits are the
reference."""

import dataclasses
import json
import warnings

import pytest
import torch
import transformers

from moetrain.cli import main
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import build_model, read_export, write_export
from moetrain.models.transformer import Transformer
from tests.helpers.hf_tiny_dense import tiny_dense
from tests.helpers.hf_tiny_models import input_ids, tiny_model


def _reference(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _edit_config(folder, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _assert_imports_to_transformers_logits(tmp_path, seq: int = 24) -> None:
    ref = _reference(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    cfg, sd, _ = read_export(tmp_path / "mt")
    ids = input_ids(seq=seq)
    with torch.no_grad():
        torch.testing.assert_close(build_model(cfg, sd).eval()(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)


def test_a_rope_scaling_beside_rope_parameters_is_the_one_read_as_in_transformers(tmp_path):
    # Qwen's long-context instructions add a yarn rope_scaling to a config.json whose
    # rope_parameters (transformers 5) say "default"; the import read rope_parameters (logits off by 0.15).
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    _edit_config(tmp_path / "hf", lambda c: c.update(rope_scaling=yarn))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    _assert_imports_to_transformers_logits(tmp_path, seq=48)  # past the original 16 positions
    cfg, _, _ = read_export(tmp_path / "mt")
    assert cfg["model"]["rope_scaling"]["rope_type"] == "yarn"


# Each model sets the dropped key to transformers' default, so the weights fit what both read.
@pytest.mark.parametrize(("family", "key", "overrides"), [
    ("mixtral", "num_local_experts", {"num_local_experts": 8}),
    ("mixtral", "intermediate_size", {"intermediate_size": 14336, "hidden_size": 16}),
    ("olmoe", "num_experts", {"num_experts": 64}),
    ("olmoe", "intermediate_size", {"intermediate_size": 2048}),
    ("qwen2_moe", "num_experts", {"num_experts": 60}),
    ("qwen2_moe", "intermediate_size", {"intermediate_size": 5632}),
    ("qwen2_moe", "moe_intermediate_size", {"moe_intermediate_size": 1408}),
    ("qwen2_moe", "shared_expert_intermediate_size", {"shared_expert_intermediate_size": 5632}),
    ("qwen3_moe", "num_experts", {"num_experts": 128}),
    ("qwen3_moe", "intermediate_size", {"intermediate_size": 6144}),
    ("qwen3_moe", "moe_intermediate_size", {"moe_intermediate_size": 768}),
    ("deepseek_v3", "n_routed_experts", {"n_routed_experts": 256}),
    ("deepseek_v3", "n_shared_experts", {"n_shared_experts": 1}),
    ("deepseek_v3", "first_k_dense_replace", {"first_k_dense_replace": 3, "num_hidden_layers": 4}),
    ("deepseek_v3", "intermediate_size", {"intermediate_size": 18432}),
    ("deepseek_v3", "moe_intermediate_size", {"moe_intermediate_size": 2048}),
    ("deepseek_v3", "q_lora_rank", {"q_lora_rank": 1536}),
    ("deepseek_v3", "kv_lora_rank", {"kv_lora_rank": 512}),
    ("deepseek_v3", "qk_nope_head_dim", {"qk_nope_head_dim": 128}),
    ("deepseek_v3", "qk_rope_head_dim", {"qk_rope_head_dim": 64}),
    ("deepseek_v3", "v_head_dim", {"v_head_dim": 128}),
])
def test_a_config_json_without_a_size_key_imports_with_transformers_default(tmp_path, family, key, overrides):
    # These raised a bare KeyError (or refused Qwen2-MoE's shared expert, or read DeepSeek's
    # q_lora_rank / shared experts / dense blocks as none), where transformers fills in its default.
    tiny_model(family, **overrides).save_pretrained(tmp_path / "hf")
    dropped = {key, "num_local_experts"} if key == "num_experts" else {key}  # Qwen3-MoE's alias
    _edit_config(tmp_path / "hf", lambda c: [c.pop(k, None) for k in dropped])
    _assert_imports_to_transformers_logits(tmp_path)


def test_a_mixtral_with_its_own_head_dim_goes_to_hugging_face_and_back(tmp_path):
    # --to-hf wrote head_dim 12 (dim 32, 4 heads) and transformers ran it; --from-hf refused it.
    model_cfg = ModelConfig(vocab_size=96, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
                            activation="swiglu", max_seq_len=64)
    moe_cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, activation="swiglu", capacity_factor=None)
    model = Transformer(model_cfg, moe=moe_cfg, seed=3).eval()
    config = {"model": json.loads(json.dumps(dataclasses.asdict(model_cfg), default=list)),
              "moe": dataclasses.asdict(moe_cfg)}
    write_export(tmp_path / "mt", config=config, state_dict=model.state_dict())
    assert main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["head_dim"] == 12
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "back")]) == 0
    cfg, sd, _ = read_export(tmp_path / "back")
    assert cfg["model"]["head_dim"] == 12
    ids = input_ids()
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(build_model(cfg, sd).eval()(ids).logits, expected)
        torch.testing.assert_close(_reference(tmp_path / "hf")(ids).logits, expected, atol=1e-5, rtol=0)


def test_linear_rope_with_an_original_max_position_embeddings_key_imports_as_transformers_runs_it(tmp_path):
    # transformers ignores the key for linear scaling; the import refused it (moetrain's linear
    # scaling has no original length).
    tiny_dense("llama").save_pretrained(tmp_path / "hf")
    linear = {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500.0}
    _edit_config(tmp_path / "hf", lambda c: c.update(rope_parameters=linear, rope_scaling=None))
    with pytest.warns(UserWarning, match=r"original_max_position_embeddings \(16\) is ignored"):
        _assert_imports_to_transformers_logits(tmp_path, seq=48)
    cfg, _, _ = read_export(tmp_path / "mt")
    assert cfg["model"]["rope_scaling"]["rope_type"] == "linear" and cfg["model"]["rope_scaling"]["factor"] == 4.0
