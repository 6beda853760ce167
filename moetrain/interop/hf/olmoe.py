"""OLMoE (``OlmoeForCausalLM``): every block a softmax top-k SwiGLU MoE (``norm_topk_prob`` =
moe.renormalize), no shared experts; attention with an RMSNorm over the whole q projection
``[H*A]`` and the whole k projection ``[G*A]`` (moetrain ``qk_norm="full"``), then q, k, v
clamped to ``[-clip_qkv, clip_qkv]`` when set.

HF names beyond the common ones (``L`` layer, ``e`` expert):

    model.layers.L.self_attn.{q,k}_norm.weight         layers.L.attention.{q,k}_norm.weight
    model.layers.L.mlp.gate.weight                     layers.L.feed_forward.router.gate.weight
    model.layers.L.mlp.experts.e.{gate,up,down}_proj   layers.L.feed_forward.experts.{w1,w3,w2}[e]  (transposed)
"""

from __future__ import annotations

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


class Olmoe(Family):
    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-5, "num_experts_per_tok": 8, "norm_topk_prob": False,
                   "max_position_embeddings": 4096, "num_experts": 64, "intermediate_size": 2048}
    title = "OLMoE"

    def configs_from_hf(self, hf: dict) -> tuple[ModelConfig, MoEConfig]:
        fields = backbone_fields(hf)
        hf_require(not hf.get("attention_bias", False), hf, "attention_bias",
                   "must be false (moetrain has no bias on the attention output projection)")
        head_dim = hf.get("head_dim")
        hf_require(head_dim in (None, fields["dim"] // fields["num_heads"]), hf, "head_dim",
                   "must be hidden_size / num_attention_heads (OLMoE's q norm spans hidden_size)")
        clip = hf.get("clip_qkv")
        model = ModelConfig(**fields, moe_every=1, moe_layer_offset=0, qk_norm="full",
                            clip_qkv=None if clip is None else float(clip))
        top_k = int(hf.get("num_experts_per_tok", 8))
        norm = bool(hf.get("norm_topk_prob", False))
        hf_require(not (norm and top_k == 1), hf, "norm_topk_prob",
                   "must be false with num_experts_per_tok 1 (moetrain keeps the router probability of a single "
                   "expert, HF renormalises it to 1)")
        moe = MoEConfig(num_experts=int(hf["num_experts"]), top_k=top_k, expert_hidden_dim=int(hf["intermediate_size"]),
                        activation="swiglu", capacity_factor=None, renormalize=norm, router_init_std=fields["init_std"],
                        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)), z_loss_coef=0.0)
        return model, moe

    def problems(self, model: ModelConfig, moe: MoEConfig) -> list[str]:
        out = backbone_problems(model, moe, family=self.title)
        out += attention_problems(model, family=self.title, qk_norm="full", clip_qkv=True, head_dim=False)
        out += softmax_routing_problems(moe, family=self.title)
        if not all(model.is_moe_layer(i) for i in range(model.num_layers)):
            out.append(f"every block must be MoE for OLMoE: got MoE blocks {model.moe_layer_ids}")
        if moe.num_shared_experts:
            out.append(f"moe.num_shared_experts ({moe.num_shared_experts}) must be 0 (OLMoE has no shared experts)")
        return out

    def hf_config(self, model: ModelConfig, moe: MoEConfig) -> dict:
        return {**backbone_config(model, family=self), "intermediate_size": moe.expert_hidden_dim,
                "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize,
                "clip_qkv": model.clip_qkv, "attention_bias": False, "router_aux_loss_coef": moe.aux_loss_coef}

    def tensor_map(self, model: ModelConfig, moe: MoEConfig, *, fused: bool) -> list[Entry]:
        out = embedding_entries(model)
        for i in range(model.num_layers):
            hf, mt = f"model.layers.{i}.mlp", f"layers.{i}.feed_forward"
            out += norm_entries(i) + attention_entries(i, model)
            out.append(Copy(f"{hf}.gate.weight", f"{mt}.router.gate.weight"))
            out.append(Experts(f"{hf}.experts", f"{mt}.experts", ("gate_proj", "up_proj", "down_proj"),
                               moe.num_experts, fused))
        return out
