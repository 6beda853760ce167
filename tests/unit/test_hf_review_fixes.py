"""config.json variants transformers loads that the import read differently or refused: a
rope_scaling beside rope_parameters (transformers reads the rope_scaling), keys its config classes
default, a Mixtral head_dim other than hidden / heads, and linear rope with an
original_max_position_embeddings key (which transformers ignores). transformers' logits are the
reference."""

import json
import warnings

import torch
import transformers

from moetrain.cli import main
from moetrain.interop.export import build_model, read_export
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
