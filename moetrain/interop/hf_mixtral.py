"""Hugging Face Mixtral <-> moetrain, for models whose every block is a dropless top-k SwiGLU MoE.

Names (HF on the left, the layout ``transformers`` writes and reads, ``L`` layer, ``e`` expert):

    model.embed_tokens.weight                          tok_embeddings.weight
    model.layers.L.input_layernorm.weight              layers.L.attention_norm.weight
    model.layers.L.self_attn.{q,k,v,o}_proj.weight     layers.L.attention.w{q,k,v,o}.weight
    model.layers.L.post_attention_layernorm.weight     layers.L.ffn_norm.weight
    model.layers.L.block_sparse_moe.gate.weight        layers.L.feed_forward.router.gate.weight
    model.layers.L.block_sparse_moe.experts.e.w1       layers.L.feed_forward.experts.w1[e]  (transposed)
    model.layers.L.block_sparse_moe.experts.e.w2       layers.L.feed_forward.experts.w2[e]  (transposed)
    model.layers.L.block_sparse_moe.experts.e.w3       layers.L.feed_forward.experts.w3[e]  (transposed)
    model.norm.weight                                  norm.weight
    lm_head.weight                                     output.weight

HF stores each expert as ``nn.Linear`` weights ``[out, in]``; moetrain stacks them as ``[E, in,
out]`` for grouped matmuls, hence the transposes. Reading also accepts the fused layout of
transformers 5 modules (``mlp.experts.gate_up_proj [E, 2F, D]``, ``mlp.experts.down_proj [E, D, F]``).
Both models compute the same function: RMSNorm in fp32, rotate-half RoPE, softmax routing over
all experts with the top-k weights renormalised, SwiGLU experts ``w2(silu(w1 x) * w3 x)``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import load_source, model_configs, write_export
from moetrain.utils.files import atomic_write_text, atomic_write_with

HF_WEIGHTS = "model.safetensors"


def _require(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field} ({value!r}) {rule}")


# --- configs ---------------------------------------------------------------------------------------


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    _require(rope_type == "default", "config.json rope_type", rope_type,
             'must be "default" (moetrain implements plain RoPE, no scaling)')
    theta = params.get("rope_theta", hf.get("rope_theta", 1e6))
    return float(theta)


def configs_from_hf(hf: dict) -> tuple[ModelConfig, MoEConfig]:
    """moetrain model and moe configs of a Mixtral ``config.json`` (as a dict)."""
    archs = hf.get("architectures") or []
    _require(hf.get("model_type") == "mixtral" or "MixtralForCausalLM" in archs, "config.json model_type",
             hf.get("model_type"), 'must be "mixtral" (architectures MixtralForCausalLM)')
    act = hf.get("hidden_act", "silu")
    _require(act in ("silu", "swish"), "config.json hidden_act", act, 'must be "silu" (SwiGLU experts)')
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    _require(head_dim in (None, dim // heads), "config.json head_dim", head_dim,
             f"must be hidden_size / num_attention_heads = {dim // heads} (moetrain derives it)")
    top_k = int(hf.get("num_experts_per_tok", 2))
    # HF renormalises the top-k weights even for k = 1 (weight 1.0); moetrain keeps the router
    # probability there so that the router still gets a gradient: the models would differ.
    _require(top_k >= 2, "config.json num_experts_per_tok", top_k, "must be >= 2")
    max_seq_len = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    if window is not None and int(window) < max_seq_len:
        # Within the window, sliding-window attention is plain causal attention.
        warnings.warn(f"config.json sliding_window ({window}) < max_position_embeddings ({max_seq_len}): "
                      f"model.max_seq_len set to {window}, where both attentions agree", stacklevel=2)
        max_seq_len = int(window)
    if float(hf.get("router_jitter_noise", 0.0) or 0.0) > 0:
        warnings.warn("config.json router_jitter_noise is ignored (moetrain routes without noise)",
                      stacklevel=2)
    std = float(hf.get("initializer_range", 0.02))
    model = ModelConfig(
        vocab_size=int(hf["vocab_size"]), dim=dim, num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), max_seq_len=max_seq_len, moe_every=1,
        moe_layer_offset=0, activation="swiglu", norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=_rope_theta(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=std,
        head="lm")
    moe = MoEConfig(
        num_experts=int(hf["num_local_experts"]), top_k=top_k, expert_hidden_dim=int(hf["intermediate_size"]),
        activation="swiglu", capacity_factor=None, renormalize=True, router_init_std=std,
        num_shared_experts=0, aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), z_loss_coef=0.0)
    return model, moe


def hf_config_from(model: ModelConfig, moe: MoEConfig) -> dict:
    """A Mixtral ``config.json`` (dict) for moetrain configs; ValueError naming the field that
    Mixtral cannot express."""
    _require(model.moe_every == 1 and model.moe_layer_offset == 0, "model.moe_every / model.moe_layer_offset",
             (model.moe_every, model.moe_layer_offset), "must be 1 / 0: every Mixtral block is MoE")
    _require(model.head == "lm", "model.head", model.head, 'must be "lm" for MixtralForCausalLM')
    _require(moe.activation == "swiglu", "moe.activation", moe.activation,
             'must be "swiglu" (Mixtral experts)')
    _require(moe.num_shared_experts == 0, "moe.num_shared_experts", moe.num_shared_experts,
             "must be 0 (Mixtral has no shared experts)")
    _require(moe.renormalize, "moe.renormalize", moe.renormalize, "must be true (Mixtral renormalises top-k)")
    _require(moe.top_k >= 2, "moe.top_k", moe.top_k, "must be >= 2 (Mixtral renormalises top-1 to weight 1)")
    for name in ("routing", "score_func"):
        value = getattr(moe, name, None)
        if value not in (None, "token_choice", "softmax"):
            raise ValueError(f"moe.{name} ({value!r}) has no Mixtral equivalent "
                             "(softmax token-choice routing)")
    if moe.capacity_factor is not None:
        warnings.warn(f"moe.capacity_factor ({moe.capacity_factor}) is dropped: Mixtral is dropless, so "
                      "outputs differ wherever capacity would have dropped tokens", stacklevel=2)
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": model.vocab_size, "hidden_size": model.dim, "intermediate_size": moe.expert_hidden_dim,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.resolved_num_kv_heads, "head_dim": model.head_dim, "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,  # read by transformers 4
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},  # transformers 5
        "sliding_window": None, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef, "router_jitter_noise": 0.0, "output_router_logits": False,
        "tie_word_embeddings": model.tie_embeddings, "initializer_range": model.init_std,
        "attention_dropout": 0.0, "use_cache": True, "dtype": "float32", "torch_dtype": "float32",
    }


# --- weights ---------------------------------------------------------------------------------------

_PER_LAYER = {  # HF suffix -> moetrain suffix (plain copies)
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
}


def state_dict_to_hf(sd: dict[str, torch.Tensor], model: ModelConfig,
                     moe: MoEConfig) -> dict[str, torch.Tensor]:
    """HF Mixtral tensors of a moetrain state dict. Every moetrain entry must map somewhere:
    state Mixtral cannot hold (an expert bias, say) is an error, not a silent drop."""
    sd = dict(sd)
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise ValueError(f"moetrain state dict has no {name!r}")
        return sd.pop(name)

    out["model.embed_tokens.weight"] = take("tok_embeddings.weight")
    out["model.norm.weight"] = take("norm.weight")
    head = take("output.weight")
    if not model.tie_embeddings:
        out["lm_head.weight"] = head
    for i in range(model.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        for hf_suffix, mt_suffix in _PER_LAYER.items():
            out[hf + hf_suffix] = take(mt + mt_suffix)
        out[hf + "block_sparse_moe.gate.weight"] = take(mt + "feed_forward.router.gate.weight")
        for w in ("w1", "w2", "w3"):
            stacked = take(mt + f"feed_forward.experts.{w}")  # [E, in, out]
            for e in range(moe.num_experts):
                out[hf + f"block_sparse_moe.experts.{e}.{w}.weight"] = stacked[e].t().contiguous()
    if sd:
        raise ValueError("these moetrain entries have no place in a Mixtral checkpoint (the model uses "
                         f"features Mixtral lacks): {', '.join(sorted(sd))}")
    return out


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], model: ModelConfig,
                       moe: MoEConfig) -> dict[str, torch.Tensor]:
    """moetrain tensors of HF Mixtral tensors (legacy per-expert or transformers-5 fused layout)."""
    hf_sd = dict(hf_sd)

    def take(name: str) -> torch.Tensor:
        if name not in hf_sd:
            raise ValueError(f"Hugging Face checkpoint has no {name!r}")
        return hf_sd.pop(name)

    E, F = moe.num_experts, moe.expert_hidden_dim
    sd: dict[str, torch.Tensor] = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
                                   "norm.weight": take("model.norm.weight")}
    if model.tie_embeddings:
        hf_sd.pop("lm_head.weight", None)  # transformers may write the tied copy too
        sd["output.weight"] = sd["tok_embeddings.weight"]
    else:
        sd["output.weight"] = take("lm_head.weight")
    for i in range(model.num_layers):
        hf, mt = f"model.layers.{i}.", f"layers.{i}."
        for hf_suffix, mt_suffix in _PER_LAYER.items():
            sd[mt + mt_suffix] = take(hf + hf_suffix)
        moe_prefix = hf + ("mlp." if hf + "mlp.experts.gate_up_proj" in hf_sd else "block_sparse_moe.")
        sd[mt + "feed_forward.router.gate.weight"] = take(moe_prefix + "gate.weight")
        if moe_prefix.endswith("mlp."):
            gate_up = take(moe_prefix + "experts.gate_up_proj")  # [E, 2F, D]: gate rows, then up rows
            down = take(moe_prefix + "experts.down_proj")  # [E, D, F]
            sd[mt + "feed_forward.experts.w1"] = gate_up[:, :F, :].transpose(1, 2).contiguous()
            sd[mt + "feed_forward.experts.w3"] = gate_up[:, F:, :].transpose(1, 2).contiguous()
            sd[mt + "feed_forward.experts.w2"] = down.transpose(1, 2).contiguous()
        else:
            for w in ("w1", "w2", "w3"):
                sd[mt + f"feed_forward.experts.{w}"] = torch.stack(
                    [take(moe_prefix + f"experts.{e}.{w}.weight").t() for e in range(E)]).contiguous()
    leftover = [k for k in hf_sd if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        shown = ", ".join(sorted(leftover)[:10])
        if len(leftover) > 10:
            shown += f", ... ({len(leftover)} in all)"
        raise ValueError(f"Hugging Face entries with no moetrain equivalent: {shown}")
    return sd


# --- files -----------------------------------------------------------------------------------------


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / HF_WEIGHTS).is_file():
        files = [HF_WEIGHTS]
    else:
        raise ValueError(f"{str(hf_dir)!r} has no {HF_WEIGHTS} or model.safetensors.index.json "
                         "(PyTorch .bin checkpoints are not read: re-save them with safe_serialization)")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if not (hf_dir / name).is_file():
            raise ValueError(f"{str(hf_dir)!r}: shard {name} named in the index is missing")
        out.update(load_file(str(hf_dir / name)))
    return out


def import_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
              dtype: torch.dtype = torch.float32) -> Path:
    """``moetrain convert --from-hf HF_DIR --to OUT``: a Mixtral folder (config.json + safetensors)
    as a moetrain export (model.safetensors + config.yaml with the model and moe sections)."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{str(hf_dir)!r} has no config.json: not a Hugging Face model folder")
    hf = json.loads(config_path.read_text())
    model, moe = configs_from_hf(hf)
    sd = state_dict_from_hf(read_hf_weights(hf_dir), model, moe)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    config = {"model": _plain(model), "moe": _plain(moe)}
    return write_export(out_dir, config=config, state_dict=sd, info={"source": str(hf_dir)})


def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """``moetrain convert SRC --to-hf OUT``: a run, checkpoint or export as a Mixtral folder that
    ``MixtralForCausalLM.from_pretrained(OUT)`` loads (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    config, sd, _ = load_source(source)
    model, moe = model_configs(config)
    hf_config = hf_config_from(model, moe)
    hf_sd = state_dict_to_hf(sd, model, moe)
    dtypes = {v.dtype for v in hf_sd.values()}
    if len(dtypes) == 1:
        hf_config["dtype"] = hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in hf_sd.items()}
    atomic_write_with(out / HF_WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
                      shared=True)
    atomic_write_text(out / "config.json", json.dumps(hf_config, indent=2, sort_keys=True) + "\n", durable=True)
    return out


def _plain(cfg) -> dict:
    import dataclasses

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}
