"""A config.json without some keys converts to the model transformers loads from it: each family's
``hf_defaults`` are its transformers config class's defaults (checked against the class), and a
DeepSeek-V3 without its routing keys, a Qwen3-MoE without its top-k and a Mixtral without its
norm epsilon give transformers' logits. Before, moetrain read its own defaults for those keys
(1 group, scaling 1.0, top-4, eps 1e-6) and the logits differed with no error."""

import json
import warnings

import pytest
import torch
import transformers

from moetrain.cli import main
from moetrain.interop.export import build_model, read_export
from moetrain.interop.hf.registry import FAMILIES
from tests.helpers.hf_tiny_models import input_ids, tiny_model

CONFIG_CLASSES = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
                  "olmoe": "OlmoeConfig", "deepseek_v3": "DeepseekV3Config", "llama": "LlamaConfig",
                  "qwen3": "Qwen3Config"}


def test_every_family_fills_in_what_its_transformers_config_class_does():
    assert sorted(FAMILIES) == sorted(CONFIG_CLASSES)
    for model_type, family in FAMILIES.items():
        assert family.hf_defaults, model_type
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            defaults = getattr(transformers, CONFIG_CLASSES[model_type])().to_dict()
        assert {k: defaults[k] for k in family.hf_defaults} == family.hf_defaults, model_type


@pytest.mark.parametrize(("family", "overrides", "dropped"), [
    ("deepseek_v3", {"n_routed_experts": 16, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
     ["n_group", "topk_group", "routed_scaling_factor"]),
    ("qwen3_moe", {"num_experts": 12, "num_experts_per_tok": 8}, ["num_experts_per_tok"]),
    ("mixtral", {"rms_norm_eps": 1e-5}, ["rms_norm_eps"]),
])
def test_a_config_json_without_a_key_gives_transformers_logits(tmp_path, family, overrides, dropped):
    tiny_model(family, **overrides).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in config.items() if k not in dropped}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    cfg, sd, _ = read_export(tmp_path / "mt")
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(build_model(cfg, sd).eval()(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


def test_a_run_from_a_hugging_face_checkpoint_may_set_training_settings_not_the_architecture(tmp_path):
    """Dropout, the multi-token loss weight (DeepSeek-V3 lowers it during training) and expert
    rebalancing change how the run trains, not what the weights mean; the width does."""
    from moetrain.interop.hf.train_from import init_from_hf_overrides

    tiny_model("deepseek_v3").save_pretrained(tmp_path / "hf")
    run = [f"--log.run_dir={tmp_path / 'run'}"]
    training = ["--model.dropout=0.1", "--model.mtp_loss_weight=0.1", "--moe.rebalance_every=10"]
    out = init_from_hf_overrides(tmp_path / "hf", config=None, overrides=[*run, *training])
    assert not [o for o in out if o.split("=")[0] in {t.split("=")[0] for t in training}]  # the user's stand
    with pytest.raises(ValueError, match=r"--model\.dim=8 contradicts the Hugging Face checkpoint"):
        init_from_hf_overrides(tmp_path / "hf", config=None, overrides=[*run, "--model.dim=8"])


def test_a_run_from_a_sliding_window_model_may_not_raise_max_seq_len_past_the_window(tmp_path):
    # The import caps max_seq_len at the window, where full and sliding-window attention agree;
    # past it they differ, and moetrain has only full attention.
    from moetrain.interop.hf.train_from import init_from_hf_overrides

    tiny_model("mixtral", sliding_window=16, max_position_embeddings=64).save_pretrained(tmp_path / "hf")
    run = [f"--log.run_dir={tmp_path / 'run'}"]
    with pytest.warns(UserWarning, match="sliding_window"):
        out = init_from_hf_overrides(tmp_path / "hf", config=None, overrides=[*run, "--model.max_seq_len=16"])
    assert "--model.max_seq_len=16" not in out  # the user's value, within the window, stands
    with pytest.raises(ValueError, match=r"--model\.max_seq_len=32 exceeds config\.json sliding_window \(16\)"):
        init_from_hf_overrides(tmp_path / "hf", config=None, overrides=[*run, "--model.max_seq_len=32"])
