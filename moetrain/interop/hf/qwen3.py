"""Dense Qwen3 (``Qwen3ForCausalLM``): Llama's blocks plus an RMSNorm over each head of q and k
(before rope, ``model.qk_norm = "head"``) and an explicit ``head_dim`` (often not hidden_size /
num_attention_heads: Qwen3-0.6B has 1024 / 16 heads of 128).

HF names beyond Llama's (``L`` layer):

    model.layers.L.self_attn.{q,k}_norm.weight         layers.L.attention.{q,k}_norm.weight
"""

from __future__ import annotations

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.hf.family import check_no_sliding_window, hf_require
from moetrain.interop.hf.llama import DenseFamily


class Qwen3(DenseFamily):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / num_attention_heads.
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "intermediate_size": 22016,
                   "head_dim": 128}
    title = "Qwen3"
    qk_norm = "head"

    def _attention_fields(self, hf: dict, fields: dict) -> dict:
        check_no_sliding_window(hf)
        kinds = hf.get("layer_types") or []
        hf_require(all(k == "full_attention" for k in kinds), hf, "layer_types",
                   'must all be "full_attention" (moetrain has no sliding-window attention)')
        head_dim = hf.get("head_dim")
        return {"qk_norm": "head",
                "head_dim": None if head_dim in (None, fields["dim"] // fields["num_heads"]) else int(head_dim)}

    def hf_config(self, model: ModelConfig, moe: MoEConfig) -> dict:
        return {**self.dense_config(model), "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": model.num_layers}
