"""transformers keeps DeepSeek-V3's router (gate.weight, e_score_correction_bias) in fp32 in a bf16
model (``_keep_in_fp32_modules_strict``); a bf16 round trip through moetrain keeps it too. Before,
--dtype bf16 rounded gate.weight to bf16 on the way in and out, and the round trip re-routed tokens."""

from __future__ import annotations

import warnings

import torch
import transformers
from safetensors import safe_open

from moetrain.cli import main
from moetrain.interop.export import read_export
from moetrain.interop.hf.convert import export_hf, import_hf
from tests.helpers.hf_tiny_models import tiny_model


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def test_a_bf16_deepseek_v3_round_trip_keeps_its_fp32_router_bit_for_bit(tmp_path):
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(
            tmp_path / "hf")
    source = _tensors(tmp_path / "hf")
    router = sorted(k for k in source if k.endswith("mlp.gate.weight"))
    assert router and all(source[k].dtype == torch.float32 for k in router)  # transformers' own choice
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt"), "--dtype", "bf16"]) == 0
    _, state, _ = read_export(tmp_path / "mt")
    assert state["layers.1.feed_forward.router.gate.weight"].dtype == torch.float32
    assert main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "back"), "--dtype", "bf16"]) == 0
    back = _tensors(tmp_path / "back")
    assert back.keys() == source.keys()
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_the_reports_list_the_router_weights_kept_in_fp32(tmp_path):
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = import_hf(tmp_path / "hf", tmp_path / "mt", dtype=torch.bfloat16)
    router = [f"layers.{i}.feed_forward.router.{n}" for i in (1, 2) for n in ("expert_bias", "gate.weight")]
    assert report.kept_fp32 == router
    assert export_hf(tmp_path / "mt", tmp_path / "back", dtype=torch.bfloat16).kept_fp32 == router
