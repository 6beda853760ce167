"""Qwen2-MoE (``Qwen2MoeForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``).

Both: softmax top-k routing (``norm_topk_prob`` = moe.renormalize), MoE in the blocks with
``(L + 1) % decoder_sparse_step == 0`` that are not in ``mlp_only_layers``, dense SwiGLU MLPs of
``intermediate_size`` elsewhere, experts of ``moe_intermediate_size``. Qwen2-MoE adds biases on
q, k, v (``qkv_bias``) and one shared expert of ``shared_expert_intermediate_size`` whose output
is scaled by ``sigmoid(shared_expert_gate(x))``; Qwen3-MoE adds an RMSNorm over each head of q
and k (before rope) and an explicit ``head_dim``.

HF names beyond the common ones (``L`` layer, ``e`` expert):

    model.layers.L.self_attn.{q,k,v}_proj.bias         layers.L.attention.w{q,k,v}.bias       (Qwen2)
    model.layers.L.self_attn.{q,k}_norm.weight         layers.L.attention.{q,k}_norm.weight   (Qwen3)
    model.layers.L.mlp.gate.weight                     layers.L.feed_forward.router.gate.weight
    model.layers.L.mlp.experts.e.{gate,up,down}_proj   layers.L.feed_forward.experts.{w1,w3,w2}[e]  (transposed)
    model.layers.L.mlp.shared_expert.{gate,up,down}_proj  layers.L.feed_forward.shared_experts.{w1,w3,w2}  (Qwen2)
    model.layers.L.mlp.shared_expert_gate.weight       layers.L.feed_forward.shared_gate.weight  (Qwen2)
    model.layers.L.mlp.{gate,up,down}_proj             layers.L.feed_forward.{w1,w3,w2}  (dense blocks)

On export every block pattern is written as ``decoder_sparse_step = 1`` plus ``mlp_only_layers``
(the dense blocks), which expresses any moetrain layout.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

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
    check_no_sliding_window,
    embedding_entries,
    hf_require,
    mlp_entries,
    norm_entries,
    softmax_routing_problems,
)


def _layout_fields(hf: dict, num_layers: int) -> dict:
    """moe_every / moe_layer_offset / dense_layers of decoder_sparse_step and mlp_only_layers."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    hf_require(1 <= step <= num_layers, hf, "decoder_sparse_step", f"must be in [1, num_hidden_layers ({num_layers})]")
    only = sorted(int(i) for i in (hf.get("mlp_only_layers") or []))
    hf_require(all(0 <= i < num_layers for i in only), hf, "mlp_only_layers",
               f"must list block ids in [0, {num_layers})")
    # HF: block L is MoE when (L + 1) % step == 0, i.e. L = step - 1, 2 * step - 1, ...
    moe_ids = [i for i in range(num_layers) if (i + 1) % step == 0]
    return {"moe_every": step, "moe_layer_offset": step - 1, "dense_layers": tuple(i for i in only if i in moe_ids)}


class _QwenMoe(Family):
    shared_expert = False
    qk_norm = "none"

    @abstractmethod
    def _attention_fields(self, hf: dict, fields: dict) -> dict:
        """ModelConfig fields of the family's attention."""

    def configs_from_hf(self, hf: dict) -> tuple[ModelConfig, MoEConfig]:
        fields = backbone_fields(hf)
        check_no_sliding_window(hf)
        # Qwen3-MoE's config class stores num_experts as num_local_experts (its attribute_map).
        num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        hf_require(num_experts > 0, hf, "num_experts", "must be > 0 (a model without experts is not an MoE)")
        fields.update(_layout_fields(hf, fields["num_layers"]), dense_hidden_dim=int(hf["intermediate_size"]))
        fields.update(self._attention_fields(hf, fields))
        model = ModelConfig(**fields)
        top_k = int(hf.get("num_experts_per_tok", 4))
        norm = bool(hf.get("norm_topk_prob", False))
        hf_require(not (norm and top_k == 1), hf, "norm_topk_prob",
                   "must be false with num_experts_per_tok 1 (moetrain keeps the router probability of a single "
                   "expert, HF renormalises it to 1)")
        shared: dict[str, Any] = {}
        if self.shared_expert:
            size = int(hf.get("shared_expert_intermediate_size", 0) or 0)
            hf_require(size > 0, hf, "shared_expert_intermediate_size", "must be > 0")
            shared = {"num_shared_experts": 1, "shared_hidden_dim": size, "shared_expert_gate": True}
        moe = MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden_dim=int(hf["moe_intermediate_size"]),
                        activation="swiglu", capacity_factor=None, renormalize=norm,
                        router_init_std=fields["init_std"], aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                        z_loss_coef=0.0, **shared)
        return model, moe

    def problems(self, model: ModelConfig, moe: MoEConfig) -> list[str]:
        out = backbone_problems(model, moe, family=self.title)
        out += attention_problems(model, family=self.title, qk_norm=self.qk_norm, qkv_bias=self.shared_expert)
        out += softmax_routing_problems(moe, family=self.title, shared_gate=self.shared_expert)
        if not model.is_moe:
            out.append(f"model.moe_every (0): {self.title} needs MoE blocks")
        if self.shared_expert and not (moe.num_shared_experts > 0 and moe.shared_expert_gate):
            out.append(f"moe.num_shared_experts ({moe.num_shared_experts}) / moe.shared_expert_gate "
                       f"({moe.shared_expert_gate}): every {self.title} MoE block has one shared expert with a "
                       "sigmoid gate")
        if not self.shared_expert and moe.num_shared_experts:
            out.append(f"moe.num_shared_experts ({moe.num_shared_experts}) must be 0 ({self.title} has no shared "
                       "experts)")
        return out

    def hf_config(self, model: ModelConfig, moe: MoEConfig) -> dict:
        dense = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
        out = {**backbone_config(model, family=self), "head_dim": model.resolved_head_dim,
               "intermediate_size": model.resolved_dense_hidden_dim, "moe_intermediate_size": moe.expert_hidden_dim,
               "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize,
               "decoder_sparse_step": 1, "mlp_only_layers": dense, "use_sliding_window": False,
               "sliding_window": None, "router_aux_loss_coef": moe.aux_loss_coef}
        if self.shared_expert:
            out.update(qkv_bias=model.qkv_bias, shared_expert_intermediate_size=moe.resolved_shared_hidden_dim)
        else:
            out.update(attention_bias=False)
        return out

    def tensor_map(self, model: ModelConfig, moe: MoEConfig, *, fused: bool) -> list[Entry]:
        out = embedding_entries(model)
        for i in range(model.num_layers):
            hf, mt = f"model.layers.{i}.mlp", f"layers.{i}.feed_forward"
            out += norm_entries(i) + attention_entries(i, model)
            if not model.is_moe_layer(i):
                out += mlp_entries(hf, mt)
                continue
            out.append(Copy(f"{hf}.gate.weight", f"{mt}.router.gate.weight"))
            out.append(Experts(f"{hf}.experts", f"{mt}.experts", ("gate_proj", "up_proj", "down_proj"),
                               moe.num_experts, fused))
            if self.shared_expert:
                out += mlp_entries(f"{hf}.shared_expert", f"{mt}.shared_experts")
                out.append(Copy(f"{hf}.shared_expert_gate.weight", f"{mt}.shared_gate.weight"))
        return out


class Qwen2Moe(_QwenMoe):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "num_experts_per_tok": 4, "norm_topk_prob": False, "qkv_bias": True,
                   "decoder_sparse_step": 1, "max_position_embeddings": 32768, "num_experts": 60,
                   "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}
    title = "Qwen2-MoE"
    shared_expert = True

    def _attention_fields(self, hf: dict, fields: dict) -> dict:
        head_dim = hf.get("head_dim")
        return {"qkv_bias": bool(hf.get("qkv_bias", True)),
                "head_dim": None if head_dim in (None, fields["dim"] // fields["num_heads"]) else int(head_dim)}


class Qwen3Moe(_QwenMoe):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "num_experts_per_tok": 8, "norm_topk_prob": False,
                   "decoder_sparse_step": 1, "max_position_embeddings": 32768, "num_local_experts": 128,
                   "intermediate_size": 6144, "moe_intermediate_size": 768}
    title = "Qwen3-MoE"
    qk_norm = "head"

    def _attention_fields(self, hf: dict, fields: dict) -> dict:
        # attention_bias puts a bias on the output projection too, which moetrain lacks.
        hf_require(not hf.get("attention_bias", False), hf, "attention_bias",
                   "must be false (moetrain has no bias on the attention output projection)")
        head_dim = hf.get("head_dim")
        return {"qk_norm": "head",
                "head_dim": None if head_dim in (None, fields["dim"] // fields["num_heads"]) else int(head_dim)}
