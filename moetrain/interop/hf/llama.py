"""Dense Llama (``LlamaForCausalLM``): every block a SwiGLU MLP, grouped-query attention with
plain RoPE, no biases. The family of dense models ``moetrain upcycle`` turns into MoEs
(``moetrain.interop.upcycle``); ``DenseFamily`` is what it shares with dense Qwen3.

A dense model is ``model.moe_every = 0`` with ``dense_hidden_dim = intermediate_size``; its moe
section is unused (SwiGLU experts of the MLP's size, dropless: the family's own kind of FFN).

HF names beyond the common ones (``L`` layer):

    model.layers.L.mlp.{gate,up,down}_proj.weight      layers.L.feed_forward.{w1,w3,w2}.weight
"""

from __future__ import annotations

from abc import abstractmethod

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.hf.family import (
    Entry,
    Family,
    attention_entries,
    attention_problems,
    backbone_config,
    backbone_fields,
    backbone_problems,
    embedding_entries,
    hf_require,
    mlp_entries,
    norm_entries,
)


class DenseFamily(Family):
    """A dense decoder: embeddings, (norm, attention, norm, SwiGLU MLP) per block, final norm, head."""

    qk_norm = "none"

    @abstractmethod
    def _attention_fields(self, hf: dict, fields: dict) -> dict:
        """ModelConfig fields of the family's attention (head_dim, q/k norm)."""

    def configs_from_hf(self, hf: dict) -> tuple[ModelConfig, MoEConfig]:
        fields = backbone_fields(hf)
        # attention_bias puts a bias on the output projection too, which moetrain lacks.
        hf_require(not hf.get("attention_bias", False), hf, "attention_bias",
                   "must be false (moetrain has no bias on the attention output projection)")
        hf_require(isinstance(hf.get("intermediate_size"), int) and hf["intermediate_size"] > 0, hf,
                   "intermediate_size", "must be a positive int")
        fields.update(self._attention_fields(hf, fields))
        size = hf["intermediate_size"]
        model = ModelConfig(**fields, moe_every=0, dense_hidden_dim=size)
        moe = MoEConfig(activation="swiglu", expert_hidden_dim=size, capacity_factor=None,
                        router_init_std=fields["init_std"])
        return model, moe

    def problems(self, model: ModelConfig, moe: MoEConfig) -> list[str]:
        # The moe section of a dense model is unused: the backbone is checked against SwiGLU
        # experts, so that only the model's own fields count.
        out = backbone_problems(model, MoEConfig(activation="swiglu"), family=self.title)
        out += attention_problems(model, family=self.title, qk_norm=self.qk_norm)
        if model.is_moe:
            out.append(f"model.moe_every ({model.moe_every}) must be 0: {self.title} is dense (MoE blocks "
                       f"{model.moe_layer_ids})")
        return out

    def hf_config_from(self, model: ModelConfig, moe: MoEConfig) -> dict:
        # No capacity warning: a dense model has no experts to drop tokens from.
        found = self.problems(model, moe)
        if found:
            raise ValueError(f"this model cannot be written as {self.title} ({self.model_type}): " + "; ".join(found))
        return self.hf_config(model, moe)

    def dense_config(self, model: ModelConfig) -> dict:
        """The config.json entries of a dense model (no router keys)."""
        out = {k: v for k, v in backbone_config(model, family=self).items() if k != "output_router_logits"}
        return {**out, "head_dim": model.resolved_head_dim, "intermediate_size": model.resolved_dense_hidden_dim,
                "attention_bias": False}

    def tensor_map(self, model: ModelConfig, moe: MoEConfig, *, fused: bool) -> list[Entry]:
        out = embedding_entries(model)
        for i in range(model.num_layers):
            out += norm_entries(i) + attention_entries(i, model)
            out += mlp_entries(f"model.layers.{i}.mlp", f"layers.{i}.feed_forward")
        return out


class Llama(DenseFamily):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "intermediate_size": 11008}
    title = "Llama"

    def _attention_fields(self, hf: dict, fields: dict) -> dict:
        hf_require(not hf.get("mlp_bias", False), hf, "mlp_bias", "must be false (moetrain's MLPs have no biases)")
        head_dim = hf.get("head_dim")
        return {"head_dim": None if head_dim in (None, fields["dim"] // fields["num_heads"]) else int(head_dim)}

    def hf_config(self, model: ModelConfig, moe: MoEConfig) -> dict:
        return {**self.dense_config(model), "mlp_bias": False, "pretraining_tp": 1}
