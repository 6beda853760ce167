"""DeepSeek-V3 (``DeepseekV3ForCausalLM``), also with V2-Lite-style sizes (``q_lora_rank`` None).

Multi-head latent attention (moetrain ``attention="mla"``): q through a low-rank pair with an
RMSNorm between (or one projection when ``q_lora_rank`` is None), k and v from a shared
compressed ``kv_lora_rank`` latent plus one rope key shared by the heads; rope on the
``qk_rope_head_dim`` part only, interleaved pairs when ``rope_interleave``. Routing: sigmoid
scores, the fp32 ``e_score_correction_bias`` added for the selection only (moetrain
``moe.expert_bias``), group-limited to ``topk_group`` of ``n_group`` groups scored by their two
best, weights renormalised (``norm_topk_prob``) then scaled by ``routed_scaling_factor``; shared
experts of ``n_shared_experts * moe_intermediate_size``; the first ``first_k_dense_replace``
blocks dense. Multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``, ``N`` below,
``num_nextn_predict_layers`` of them; always MoE blocks) are moetrain's ``mtp.{i}`` modules
(``model.mtp_depth``); a checkpoint that stores fewer than its config.json promises (transformers'
``save_pretrained`` writes none) is imported with those it holds, and a warning.

HF names beyond the common ones (``L`` layer, ``e`` expert):

    model.layers.L.self_attn.q_proj.weight              layers.L.attention.wq.weight     (q_lora_rank None)
    model.layers.L.self_attn.q_a_proj.weight            layers.L.attention.wq_a.weight
    model.layers.L.self_attn.q_a_layernorm.weight       layers.L.attention.q_norm.weight
    model.layers.L.self_attn.q_b_proj.weight            layers.L.attention.wq_b.weight
    model.layers.L.self_attn.kv_a_proj_with_mqa.weight  layers.L.attention.wkv_a.weight
    model.layers.L.self_attn.kv_a_layernorm.weight      layers.L.attention.kv_norm.weight
    model.layers.L.self_attn.kv_b_proj.weight           layers.L.attention.wkv_b.weight
    model.layers.L.self_attn.o_proj.weight              layers.L.attention.wo.weight
    model.layers.L.mlp.gate.weight                      layers.L.feed_forward.router.gate.weight
    model.layers.L.mlp.gate.e_score_correction_bias     layers.L.feed_forward.router.expert_bias  (fp32)
    model.layers.L.mlp.experts.e.{gate,up,down}_proj    layers.L.feed_forward.experts.{w1,w3,w2}[e]  (transposed)
    model.layers.L.mlp.shared_experts.{gate,up,down}_proj  layers.L.feed_forward.shared_experts.{w1,w3,w2}
    model.layers.L.mlp.{gate,up,down}_proj              layers.L.feed_forward.{w1,w3,w2}  (dense blocks)
    model.layers.N.{enorm,hnorm}.weight                 mtp.i.{enorm,hnorm}.weight
    model.layers.N.eh_proj.weight                       mtp.i.eh_proj.weight  (column halves swapped)
    model.layers.N.shared_head.norm.weight              mtp.i.norm.weight
    model.layers.N.{embed_tokens,shared_head.head}      tok_embeddings, output  (copies: written, not read)
    model.layers.N.<block tensors as above>             mtp.i.block.<...>
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.hf.family import (
    Copy,
    Entry,
    Experts,
    Family,
    backbone_config,
    backbone_fields,
    backbone_problems,
    embedding_entries,
    hf_require,
    mlp_entries,
    top_k_problems,
)


class DeepseekV3(Family):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "num_experts_per_tok": 8, "norm_topk_prob": True, "n_group": 8,
                   "topk_group": 4, "routed_scaling_factor": 2.5, "rope_interleave": True,
                   "max_position_embeddings": 4096, "n_routed_experts": 256, "n_shared_experts": 1,
                   "first_k_dense_replace": 3, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                   "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                   "v_head_dim": 128}
    keep_fp32 = ("mlp.gate.weight", "e_score_correction_bias")  # the router: bf16 would re-route tokens
    title = "DeepSeek-V3"

    def configs_from_hf(self, hf: dict) -> tuple[ModelConfig, MoEConfig]:
        fields = backbone_fields(hf, softmax_mscale=True)  # MLA scales the softmax by mscale_all_dim
        hf_require(not hf.get("attention_bias", False), hf, "attention_bias",
                   "must be false (moetrain's MLA projections have no biases)")
        heads = fields["num_heads"]
        hf_require(int(hf.get("num_key_value_heads") or heads) == heads, hf, "num_key_value_heads",
                   f"must equal num_attention_heads ({heads}): MLA has one key and value per head")
        fields["num_kv_heads"] = None
        num_layers = fields["num_layers"]
        first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
        hf_require(0 <= first_dense < num_layers, hf, "first_k_dense_replace",
                   f"must be in [0, num_hidden_layers ({num_layers}))")
        q_lora = hf.get("q_lora_rank")
        model = ModelConfig(
            **fields, moe_every=1, moe_layer_offset=first_dense, dense_hidden_dim=int(hf["intermediate_size"]),
            attention="mla", q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]), rope_interleave=bool(hf.get("rope_interleave", True)),
            mtp_depth=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0))
        num_experts = int(hf["n_routed_experts"])
        top_k = int(hf.get("num_experts_per_tok", 8))
        norm = bool(hf.get("norm_topk_prob", True))
        hf_require(not (norm and top_k == 1), hf, "norm_topk_prob",
                   "must be false with num_experts_per_tok 1 (moetrain keeps the router probability of a single "
                   "expert, HF renormalises it to 1)")
        groups, top_groups = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        hf_require(num_experts % groups == 0 and num_experts // groups >= 2, hf, "n_group",
                   f"must divide n_routed_experts ({num_experts}) into groups of >= 2 experts")
        num_shared = int(hf.get("n_shared_experts", 0) or 0)
        hf_require(num_shared >= 1, hf, "n_shared_experts", "must be >= 1 (DeepSeek-V3 always has shared experts)")
        moe = MoEConfig(
            num_experts=num_experts, top_k=top_k, expert_hidden_dim=int(hf["moe_intermediate_size"]),
            activation="swiglu", capacity_factor=None, renormalize=norm, router="sigmoid", expert_bias=True,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), num_expert_groups=groups,
            top_groups=top_groups, group_score="top2_sum", num_shared_experts=num_shared,
            router_init_std=fields["init_std"], aux_loss_coef=0.0, z_loss_coef=0.0)
        return model, moe

    def fit_to_tensors(self, model: ModelConfig, hf: dict, names: set[str]) -> ModelConfig:
        held = 0
        while held < model.mtp_depth and f"model.layers.{model.num_layers + held}.eh_proj.weight" in names:
            held += 1
        if held < model.mtp_depth:
            warnings.warn(f"config.json num_nextn_predict_layers ({model.mtp_depth}): the checkpoint holds {held} "
                          f"multi-token-prediction layers (transformers' save_pretrained writes none); imported with "
                          f"model.mtp_depth {held}", stacklevel=3)
            model = replace(model, mtp_depth=held)
        return model

    def problems(self, model: ModelConfig, moe: MoEConfig) -> list[str]:
        t = self.title
        out = backbone_problems(model, moe, family=t, mtp=True) + top_k_problems(moe, family=t)
        if model.attention != "mla":
            out.append(f"model.attention ({model.attention!r}) must be \"mla\" (DeepSeek-V3's attention)")
        if model.qkv_bias or model.qk_norm != "none" or model.clip_qkv is not None:
            out.append("model.qkv_bias / model.qk_norm / model.clip_qkv must be off (DeepSeek-V3 has none of them)")
        k = model.moe_layer_offset
        if model.moe_layer_ids != list(range(k, model.num_layers)):
            out.append(f"MoE blocks {model.moe_layer_ids} must be all blocks from model.moe_layer_offset ({k}) on "
                       "(DeepSeek-V3's first_k_dense_replace)")
        if moe.router != "sigmoid":
            out.append(f"moe.router ({moe.router!r}) must be \"sigmoid\" (DeepSeek-V3's scores)")
        if not moe.has_expert_bias:
            out.append("moe.expert_bias (false) must be true: DeepSeek-V3 selects with e_score_correction_bias "
                       "(a zero bias routes the same)")
        if moe.num_expert_groups > 1 and moe.group_score != "top2_sum":
            out.append(f"moe.group_score ({moe.group_score!r}) must be \"top2_sum\" (DeepSeek-V3's group score)")
        if moe.num_expert_groups > 1 and moe.num_experts // moe.num_expert_groups < 2:
            out.append(f"moe.num_expert_groups ({moe.num_expert_groups}) must leave >= 2 experts per group")
        if moe.num_shared_experts == 0 or moe.shared_expert_gate:
            out.append("moe.num_shared_experts must be > 0 and moe.shared_expert_gate false (DeepSeek-V3's shared "
                       "experts are ungated)")
        elif moe.resolved_shared_hidden_dim % moe.expert_hidden_dim:
            out.append(f"moe.shared_hidden_dim ({moe.shared_hidden_dim}) must be a multiple of moe.expert_hidden_dim "
                       f"({moe.expert_hidden_dim}): n_shared_experts * moe_intermediate_size")
        return out

    def hf_config(self, model: ModelConfig, moe: MoEConfig) -> dict:
        return {**backbone_config(model, family=self), "num_key_value_heads": model.num_heads,
                "intermediate_size": model.resolved_dense_hidden_dim, "moe_intermediate_size": moe.expert_hidden_dim,
                "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "n_shared_experts": moe.resolved_shared_hidden_dim // moe.expert_hidden_dim,
                "routed_scaling_factor": moe.routed_scaling_factor, "norm_topk_prob": moe.renormalize,
                "n_group": moe.num_expert_groups, "topk_group": moe.top_groups,
                "first_k_dense_replace": model.moe_layer_offset, "q_lora_rank": model.q_lora_rank,
                "kv_lora_rank": model.kv_lora_rank, "qk_nope_head_dim": model.qk_nope_head_dim,
                "qk_rope_head_dim": model.qk_rope_head_dim, "v_head_dim": model.v_head_dim,
                "head_dim": model.qk_rope_head_dim, "rope_interleave": model.rope_interleave,
                "attention_bias": False, "num_nextn_predict_layers": model.mtp_depth,
                # Read by DeepSeek's own modeling code; transformers' implements exactly these.
                "topk_method": "noaux_tc", "scoring_func": "sigmoid"}

    def tensor_map(self, model: ModelConfig, moe: MoEConfig, *, fused: bool) -> list[Entry]:
        out = embedding_entries(model)
        for i in range(model.num_layers):
            out += _block_entries(f"model.layers.{i}.", f"layers.{i}.", model, moe, fused=fused,
                                  is_moe=model.is_moe_layer(i))
        head = "tok_embeddings.weight" if model.tie_embeddings else "output.weight"
        for i in range(model.mtp_depth):
            hf, mt = f"model.layers.{model.num_layers + i}.", f"mtp.{i}."
            out += [Copy(f"{hf}enorm.weight", f"{mt}enorm.weight"), Copy(f"{hf}hnorm.weight", f"{mt}hnorm.weight"),
                    Copy(f"{hf}eh_proj.weight", f"{mt}eh_proj.weight", swap_halves=True),
                    Copy(f"{hf}shared_head.norm.weight", f"{mt}norm.weight"),
                    Copy(f"{hf}embed_tokens.weight", "tok_embeddings.weight", load=False),
                    Copy(f"{hf}shared_head.head.weight", head, load=False)]
            out += _block_entries(hf, f"{mt}block.", model, moe, fused=fused, is_moe=True)
        return out


def _block_entries(hf: str, mt: str, model: ModelConfig, moe: MoEConfig, *, fused: bool, is_moe: bool) -> list[Entry]:
    """One block: ``hf`` like ``model.layers.L.``, ``mt`` like ``layers.L.``."""
    out: list[Entry] = [Copy(f"{hf}input_layernorm.weight", f"{mt}attention_norm.weight"),
                        Copy(f"{hf}post_attention_layernorm.weight", f"{mt}ffn_norm.weight")]
    out += _mla_entries(hf + "self_attn.", mt + "attention.", model)
    hf, mt = hf + "mlp", mt + "feed_forward"
    if not is_moe:
        return out + mlp_entries(hf, mt)
    out += [Copy(f"{hf}.gate.weight", f"{mt}.router.gate.weight"),
            Copy(f"{hf}.gate.e_score_correction_bias", f"{mt}.router.expert_bias")]
    out.append(Experts(f"{hf}.experts", f"{mt}.experts", ("gate_proj", "up_proj", "down_proj"), moe.num_experts, fused))
    return out + mlp_entries(f"{hf}.shared_experts", f"{mt}.shared_experts")


def _mla_entries(hf: str, mt: str, model: ModelConfig) -> list[Entry]:
    q: list[Entry]
    if model.q_lora_rank is None:
        q = [Copy(f"{hf}q_proj.weight", f"{mt}wq.weight")]
    else:
        q = [Copy(f"{hf}q_a_proj.weight", f"{mt}wq_a.weight"), Copy(f"{hf}q_a_layernorm.weight", f"{mt}q_norm.weight"),
             Copy(f"{hf}q_b_proj.weight", f"{mt}wq_b.weight")]
    return q + [Copy(f"{hf}kv_a_proj_with_mqa.weight", f"{mt}wkv_a.weight"),
                Copy(f"{hf}kv_a_layernorm.weight", f"{mt}kv_norm.weight"),
                Copy(f"{hf}kv_b_proj.weight", f"{mt}wkv_b.weight"), Copy(f"{hf}o_proj.weight", f"{mt}wo.weight")]
