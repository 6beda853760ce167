"""A config.json without a key reads as transformers' config class reads it: each family's
``hf_defaults`` hold every default that changes the model (checked by dropping each key of a full
config in turn), and a dense Qwen3 without ``head_dim`` imports with transformers' 128-wide heads.
Before, moetrain read head_dim as hidden_size / num_attention_heads and refused the checkpoint
(tensors of another shape) that transformers loads."""

from __future__ import annotations

import json
import warnings

import torch
import transformers

from moetrain.cli import main
from moetrain.interop.export import build_model, read_export
from moetrain.interop.hf.registry import FAMILIES
from tests.helpers.hf_tiny_dense import input_ids, tiny_dense
from tests.unit.test_hf_defaults import CONFIG_CLASSES

# Keys whose absence moetrain reads on purpose otherwise than the class default, with the reason.
READ_OTHERWISE = {
    # transformers' DeepSeek-V3 builds no multi-token modules whatever this says, and moetrain imports
    # only those the checkpoint holds (DeepseekV3.fit_to_tensors): the default changes no loaded model.
    ("deepseek_v3", "num_nextn_predict_layers"),
}


def test_dropping_any_key_of_a_full_config_reads_the_same_model():
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)
    for model_type, family in FAMILIES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = getattr(transformers, CONFIG_CLASSES[model_type])(**small).to_dict()
            want = family.configs_from_hf({**family.hf_defaults, **full})
            for key in sorted(set(full) - set(small) - {"model_type", "architectures"}):
                if (model_type, key) in READ_OTHERWISE:
                    continue
                rest = {k: v for k, v in full.items() if k != key}
                assert family.configs_from_hf({**family.hf_defaults, **rest}) == want, (model_type, key)


def test_a_dense_qwen3_without_head_dim_gives_transformers_logits(tmp_path):
    # The class default (128) saved, then dropped from config.json: transformers reads 128 again.
    tiny_dense("qwen3", head_dim=128).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    assert config.pop("head_dim") == 128
    path.write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert ref.config.head_dim == 128
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    cfg, sd, _ = read_export(tmp_path / "mt")
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(build_model(cfg, sd).eval()(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
