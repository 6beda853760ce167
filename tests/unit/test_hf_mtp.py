"""DeepSeek-V3's multi-token-prediction layers through `moetrain convert`, against transformers' own
MTP modules (``transformers.modeling_layers.MtpModel``, what its ``generate(use_mtp=True)`` drafts
with): a tiny checkpoint with two MTP layers (``model.layers.{3, 4}``) imports into ``mtp.{0, 1}``,
each depth's logits equal transformers' within 1e-5 and the training loss per depth is their
cross-entropy; the export writes back every tensor unchanged (``eh_proj`` with its halves in the
checkpoint's order, the embedding and head copies included); a checkpoint whose config.json
promises layers it does not store imports without them, with a warning."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

from moetrain.cli import main as cli_main
from moetrain.interop.export import build_model, read_export
from moetrain.utils.safetensors_io import SafetensorsFolder
from tests.helpers.hf_tiny_models import input_ids, tiny_model

NUM_LAYERS, DEPTH = 3, 2


@torch.no_grad()
def _hf_with_mtp(tmp_path):
    """transformers' tiny DeepSeek-V3 and its MtpModel (weights perturbed as tiny_model's), saved
    in DeepSeek's checkpoint layout: the MTP layers after the main ones."""
    hf = tiny_model("deepseek_v3", num_mtp_layers=DEPTH)
    mtp = MtpModel(hf, DEPTH).eval()
    g = torch.Generator().manual_seed(7)
    for name, p in mtp.layers.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    for name, b in mtp.layers.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((torch.rand(b.shape, generator=g) - 0.5) * 0.2)
    hf.save_pretrained(tmp_path / "hf")
    path = str(tmp_path / "hf" / "model.safetensors")
    tensors = load_file(path)
    for name, t in mtp.layers.state_dict().items():
        i, rest = name.split(".", 1)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        prefix = f"model.layers.{NUM_LAYERS + int(i)}."
        if rest.endswith("experts.gate_up_proj"):  # save_pretrained writes per-expert tensors: so do we
            F_ = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :F_].contiguous()
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, F_:].contiguous()
        elif rest.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors[prefix + rest] = t.contiguous()
    for i in range(DEPTH):  # DeepSeek's checkpoints repeat the shared embedding and head per MTP layer
        tensors[f"model.layers.{NUM_LAYERS + i}.embed_tokens.weight"] = hf.model.embed_tokens.weight.clone()
        tensors[f"model.layers.{NUM_LAYERS + i}.shared_head.head.weight"] = hf.lm_head.weight.clone()
    save_file(tensors, path, metadata={"format": "pt"})
    return hf, mtp, tensors


@torch.no_grad()
def _hf_depth_logits(hf, mtp, ids_BS) -> list[torch.Tensor]:
    """transformers' drafting step run over whole sequences: depth k reads the previous depth's
    state at positions 0..S-k-1 and the tokens k places ahead, at their positions."""
    h = hf.model(ids_BS).last_hidden_state
    S, out = ids_BS.shape[1], []
    for k in range(1, DEPTH + 1):
        L = S - k
        h = mtp.forward_layer(k - 1, h[:, :L], torch.arange(k, k + L)[None], None, input_ids=ids_BS[:, k:])
        out.append(mtp._project_to_logits(h))
    return out


def test_import_matches_transformers_mtp_and_exports_back(tmp_path):
    hf, mtp, tensors = _hf_with_mtp(tmp_path)
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    config, sd, _ = read_export(tmp_path / "mt")
    assert config["model"]["mtp_depth"] == DEPTH
    model = build_model(config, sd).eval()

    ids = input_ids(2, 12)
    want = _hf_depth_logits(hf, mtp, ids)
    labels = torch.cat([ids[:, 1:], torch.randint(0, 96, (2, 1))], dim=1)
    with torch.no_grad():
        out = model(ids, labels)
        h = out.hidden_BSD
        for k, (module, ref) in enumerate(zip(model.mtp, want, strict=True), start=1):
            L = ids.shape[1] - k
            x, _ = module(h[:, :L], model.tok_embeddings(ids[:, k:]), model.rope_cos_SA[:L], model.rope_sin_SA[:L])
            h = module.norm(x)
            torch.testing.assert_close(model.output(h), ref, atol=1e-5, rtol=0)
    assert out.mtp_losses is not None
    ref_losses = torch.stack([F.cross_entropy(w.flatten(0, 1), labels[:, k:].flatten())
                              for k, w in enumerate(want, start=1)])
    torch.testing.assert_close(out.mtp_losses, ref_losses, atol=1e-5, rtol=0)

    assert cli_main(["convert", str(tmp_path / "mt"), "--to-hf", str(tmp_path / "back")]) == 0
    back = SafetensorsFolder(tmp_path / "back")
    assert set(back.names()) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(back.get(name), t), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == DEPTH


def test_promised_but_absent_layers_import_without_them(tmp_path):
    hf = tiny_model("deepseek_v3", num_mtp_layers=1)  # save_pretrained writes no MTP tensors
    hf.save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match=r"num_nextn_predict_layers \(1\): the checkpoint holds 0"):
        assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 0
    config, sd, _ = read_export(tmp_path / "mt")
    assert config["model"]["mtp_depth"] == 0 and not any(k.startswith("mtp.") for k in sd)


def test_a_partial_mtp_layer_is_listed(tmp_path, capsys):
    hf = tiny_model("deepseek_v3", num_mtp_layers=1)
    hf.save_pretrained(tmp_path / "hf")
    path = str(tmp_path / "hf" / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "mt")]) == 2
    assert "tensors it lacks: model.layers.3.enorm.weight, model.layers.3.hnorm.weight" in capsys.readouterr().err


def test_other_families_refuse_mtp_by_name():
    from moetrain.config.model import ModelConfig
    from moetrain.config.moe import MoEConfig
    from moetrain.interop.hf.registry import FAMILIES

    model = ModelConfig(vocab_size=64, dim=32, num_heads=4, activation="swiglu", mtp_depth=1)
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, activation="swiglu")
    with pytest.raises(ValueError, match=r"model.mtp_depth \(1\) must be 0: Mixtral"):
        FAMILIES["mixtral"].hf_config_from(model, moe)
