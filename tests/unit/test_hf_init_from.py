"""``checkpoint.init_from`` in one process: ``load_initial_weights`` copies an export into a
fresh model exactly (fp32 buffers stay fp32 even from a bf16 export), lists every missing,
unexpected and mis-shaped name in one error, and leaves the model untouched when it refuses."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import write_export
from moetrain.models.transformer import Transformer
from moetrain.train.init_from import load_initial_weights

MODEL = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=32, tie_embeddings=True)
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=24, activation="swiglu", expert_bias=True)


def _export(tmp_path, model: Transformer, *, dtype=None, max_shard_bytes=None):
    sd = model.state_dict()
    if dtype is not None:
        sd = {k: (v if k.endswith("expert_bias") else v.to(dtype)) for k, v in sd.items()}
    return write_export(tmp_path / "export", config={}, state_dict=sd, max_shard_bytes=max_shard_bytes)


def _source_model() -> Transformer:
    src = Transformer(MODEL, moe=MOE, seed=1)
    with torch.no_grad():
        for name, b in src.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.linspace(-0.1, 0.1, b.numel()) + 1e-4)  # not representable in bf16
    return src


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_a_fresh_model_gets_every_tensor_exactly(tmp_path, max_shard_bytes):
    src = _source_model()
    path = _export(tmp_path, src, max_shard_bytes=max_shard_bytes)
    assert (path / "model.safetensors.index.json").is_file() == (max_shard_bytes is not None)
    dst = Transformer(MODEL, moe=MOE, seed=2)
    assert not torch.equal(dst.tok_embeddings.weight, src.tok_embeddings.weight)
    load_initial_weights(dst, path)
    want, got = src.state_dict(), dst.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert dst.output.weight is dst.tok_embeddings.weight  # still tied


def test_fp32_buffers_stay_fp32_from_a_bf16_export(tmp_path):
    src = _source_model()
    path = _export(tmp_path, src, dtype=torch.bfloat16)
    dst = Transformer(MODEL, moe=MOE, seed=2)
    load_initial_weights(dst, path)
    bias = dst.layers[0].feed_forward.router.expert_bias
    assert bias.dtype == torch.float32
    assert torch.equal(bias, src.layers[0].feed_forward.router.expert_bias)
    w = dst.layers[0].attention.wq.weight
    assert w.dtype == torch.float32 and torch.equal(w, src.layers[0].attention.wq.weight.to(torch.bfloat16).float())


def test_every_mismatch_is_listed_and_nothing_is_copied(tmp_path):
    src = _source_model()
    sd = src.state_dict()
    del sd["layers.1.ffn_norm.weight"]
    sd["layers.0.attention.extra"] = torch.zeros(3)
    sd["layers.0.attention.wq.weight"] = torch.zeros(8, 32)
    path = write_export(tmp_path / "export", config={}, state_dict=sd)
    dst = Transformer(MODEL, moe=MOE, seed=2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_initial_weights(dst, path)
    msg = str(err.value)
    assert "missing: layers.1.ffn_norm.weight" in msg
    assert "not in this model: layers.0.attention.extra" in msg
    assert "layers.0.attention.wq.weight (export (8, 32), model (32, 32))" in msg
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    with pytest.raises(ValueError, match="checkpoint.init_from"):
        load_initial_weights(dst, tmp_path / "nowhere")
