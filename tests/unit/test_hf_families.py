"""Every Hugging Face family both ways, both on-disk expert layouts: a tiny random model built by
`transformers` from its config class (no download) converted to moetrain gives the same logits as
transformers' own forward, and a moetrain model (moetrain's own init, then perturbed) converted to
the Hugging Face layout loads in ``AutoModelForCausalLM.from_pretrained`` with no missing or
unexpected weights and gives moetrain's logits. transformers is the independent reference: each
family's modeling code is a separate implementation of the same math."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from moetrain.cli import main as cli_main
from moetrain.interop.export import build_model, read_export, write_export
from moetrain.interop.hf.registry import FAMILIES
from moetrain.models.transformer import Transformer
from moetrain.utils.safetensors_io import SafetensorsFolder
from tests.helpers.hf_tiny_models import VOCAB, hf_config, input_ids, tiny_model

TOL = 1e-4
FAMILY_CASES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2_lite"]
LAYOUTS = ["per-expert", "fused"]


def _model_type(case: str) -> str:
    return "deepseek_v3" if case == "deepseek_v2_lite" else case


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_from_hf_gives_transformers_logits(tmp_path, case, layout):
    hf = tiny_model(case)
    # transformers 5 writes per-expert tensors by default (its "original format"), fused on request.
    hf.save_pretrained(tmp_path / "hf", save_original_format=layout == "per-expert")
    names = SafetensorsFolder(tmp_path / "hf").names()
    assert any(n.endswith("experts.gate_up_proj") for n in names) == (layout == "fused")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0

    config, sd, info = read_export(tmp_path / "mt")
    assert info["hf_family"] == _model_type(case)
    model = build_model(config, sd).eval()
    x = input_ids()
    with torch.no_grad():
        want, got = hf(x).logits, model(x).logits
    assert got.shape == want.shape == (2, 24, VOCAB)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def _perturbed_moetrain_model(case: str):
    """A moetrain model of the family's configs with moetrain's own init, made as telling as the
    HF one: norm gains and biases away from their init, decisive routers, a non-zero bias."""
    family = FAMILIES[_model_type(case)]
    model_cfg, moe_cfg = family.configs_from_hf(hf_config(case).to_dict())
    model = Transformer(model_cfg, moe=moe_cfg, seed=3).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith((".bias", "expert_bias")):
                t.copy_((torch.rand(t.shape, generator=g) - 0.5) * 0.2)
            elif name.endswith(("router.gate.weight", "shared_gate.weight")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_to_hf_loads_in_transformers_with_moetrain_logits(tmp_path, case, layout):
    ours = _perturbed_moetrain_model(case)
    config = {"model": json.loads(json.dumps(ours.config.__dict__, default=list)),
              "moe": dict(ours.moe_config.__dict__)}
    write_export(tmp_path / "mt", config=config, state_dict=ours.state_dict())
    fused = ["--fused"] if layout == "fused" else []
    args = ["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "hf"), *fused]
    assert cli_main(args) == 0

    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["model_type"] == _model_type(case)
    names = SafetensorsFolder(tmp_path / "hf").names()
    assert any(n.endswith("experts.gate_up_proj") for n in names) == (layout == "fused")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    # DeepSeek-V3's multi-token-prediction layers (model.mtp_depth, from num_nextn_predict_layers)
    # are MtpModel's, not the main model's: its ignore pattern names layer 61 alone (tests/unit/test_hf_mtp.py).
    mtp_layers = tuple(f"model.layers.{ours.config.num_layers + i}." for i in range(ours.config.mtp_depth))
    info["unexpected_keys"] = {k for k in info["unexpected_keys"] if not k.startswith(mtp_layers)}
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    hf.eval()
    x = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x).logits, atol=TOL, rtol=0)
