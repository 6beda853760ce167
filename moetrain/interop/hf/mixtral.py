"""Mixtral (``MixtralForCausalLM``): every block a softmax top-k SwiGLU MoE, renormalised
top-k weights, no shared experts, plain grouped-query attention.

HF names (``L`` layer, ``e`` expert), in the per-expert layout ``save_pretrained`` writes; the
fused layout of transformers-5 modules names the block ``mlp`` instead of ``block_sparse_moe``:

    model.layers.L.block_sparse_moe.gate.weight         layers.L.feed_forward.router.gate.weight
    model.layers.L.block_sparse_moe.experts.e.w1.weight  layers.L.feed_forward.experts.w1[e]  (transposed)
    model.layers.L.block_sparse_moe.experts.e.w3.weight  layers.L.feed_forward.experts.w3[e]  (transposed)
    model.layers.L.block_sparse_moe.experts.e.w2.weight  layers.L.feed_forward.experts.w2[e]  (transposed)
    model.layers.L.mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F]   (fused)
"""

from __future__ import annotations

import warnings

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.hf.family import (
    Copy,
    Entry,
    Experts,
    Family,
    attention_entries,
    attention_problems,
    backbone_config,
    backbone_fields,
    backbone_problems,
    embedding_entries,
    hf_require,
    norm_entries,
    softmax_routing_problems,
)


class Mixtral(Family):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-5, "num_experts_per_tok": 2, "max_position_embeddings": 131072,
                   "num_local_experts": 8, "intermediate_size": 14336}
    title = "Mixtral"

    def configs_from_hf(self, hf: dict) -> tuple[ModelConfig, MoEConfig]:
        fields = backbone_fields(hf, default_theta=1e6)
        head_dim = hf.get("head_dim")  # transformers' Mixtral projects to heads x head_dim, as moetrain does
        if head_dim not in (None, fields["dim"] // fields["num_heads"]):
            fields["head_dim"] = int(head_dim)
        top_k = int(hf.get("num_experts_per_tok", 2))
        hf_require(top_k >= 2, hf, "num_experts_per_tok", "must be >= 2 (Mixtral renormalises top-1 to weight 1)")
        window = hf.get("sliding_window")
        if window is not None and int(window) < fields["max_seq_len"]:
            # Within the window, sliding-window attention is plain causal attention.
            warnings.warn(f"config.json sliding_window ({window}) < max_position_embeddings "
                          f"({fields['max_seq_len']}): model.max_seq_len set to {window}, where both attentions "
                          "agree", stacklevel=3)
            fields["max_seq_len"] = int(window)
        if float(hf.get("router_jitter_noise", 0.0) or 0.0) > 0:
            warnings.warn("config.json router_jitter_noise is ignored (moetrain routes without noise)", stacklevel=3)
        std = fields["init_std"]
        model = ModelConfig(**fields, moe_every=1, moe_layer_offset=0)
        moe = MoEConfig(num_experts=int(hf["num_local_experts"]), top_k=top_k,
                        expert_hidden_dim=int(hf["intermediate_size"]), activation="swiglu", capacity_factor=None,
                        renormalize=True, router_init_std=std, num_shared_experts=0,
                        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), z_loss_coef=0.0)
        return model, moe

    def problems(self, model: ModelConfig, moe: MoEConfig) -> list[str]:
        out = backbone_problems(model, moe, family=self.title) + attention_problems(model, family=self.title)
        if not all(model.is_moe_layer(i) for i in range(model.num_layers)):
            out.append("every block must be MoE (model.moe_every 1, model.moe_layer_offset 0, no "
                       f"model.dense_layers): got MoE blocks {model.moe_layer_ids}")
        out += softmax_routing_problems(moe, family=self.title)
        if not moe.renormalize:
            out.append("moe.renormalize (false) must be true (Mixtral renormalises the top-k weights)")
        if moe.num_shared_experts:
            out.append(f"moe.num_shared_experts ({moe.num_shared_experts}) must be 0 (Mixtral has no shared experts)")
        return out

    def hf_config(self, model: ModelConfig, moe: MoEConfig) -> dict:
        return {**backbone_config(model, family=self), "head_dim": model.resolved_head_dim,
                "intermediate_size": moe.expert_hidden_dim, "sliding_window": None,
                "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "router_aux_loss_coef": moe.aux_loss_coef, "router_jitter_noise": 0.0}

    def tensor_map(self, model: ModelConfig, moe: MoEConfig, *, fused: bool) -> list[Entry]:
        out = embedding_entries(model)
        block = "mlp" if fused else "block_sparse_moe"
        for i in range(model.num_layers):
            hf = f"model.layers.{i}.{block}"
            out += norm_entries(i) + attention_entries(i, model)
            out.append(Copy(f"{hf}.gate.weight", f"layers.{i}.feed_forward.router.gate.weight"))
            out.append(Experts(f"{hf}.experts", f"layers.{i}.feed_forward.experts", ("w1", "w3", "w2"),
                               moe.num_experts, fused))
        return out

