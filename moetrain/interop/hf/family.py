"""What a Hugging Face MoE family is to the converter: its config both ways, what moetrain
features it cannot hold, and the names of its tensors.

A family's ``tensor_map`` lists every tensor pair as ``Copy`` (one HF tensor is one moetrain
tensor, same layout) or ``Experts`` (one layer's routed experts: moetrain's stacked ``w1``/``w3``
``[E, D, F]`` and ``w2`` ``[E, F, D]`` against HF's per-expert ``nn.Linear`` weights ``[out, in]``
or the fused ``gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]`` of transformers 5 modules).
The converter (``moetrain.interop.hf.convert``) streams tensors through that list both ways.

Shape legend: E experts, D model dim, F expert hidden dim.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

from moetrain.config.base import require
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.rope import ROPE_TYPES, RopeScaling


@dataclass(frozen=True)
class Copy:
    """``hf`` and ``mt`` hold the same tensor. ``export=False``: read on import only (the LM head
    of a tied model is the embedding; HF does not store it twice). ``load=False``: written on
    export only, and optional on import (DeepSeek-V3's multi-token-prediction layers store copies
    of the shared embedding and head). ``swap_halves``: the two halves of the last dim trade
    places, both ways (DeepSeek-V3's ``eh_proj`` reads [embedding; hidden], moetrain's [hidden;
    embedding])."""

    hf: str
    mt: str
    export: bool = True
    load: bool = True
    swap_halves: bool = False


@dataclass(frozen=True)
class Experts:
    """One layer's routed experts. Per-expert HF names: ``{hf}.{e}.{gate|up|down}.weight`` with
    ``proj = (gate, up, down)`` (``("w1", "w3", "w2")`` for Mixtral); fused: ``{hf}.gate_up_proj``
    (gate rows, then up rows) and ``{hf}.down_proj``. ``mt``: ``layers.L.feed_forward.experts``."""

    hf: str
    mt: str
    proj: tuple[str, str, str]
    num_experts: int
    fused: bool

    def hf_names(self) -> list[str]:
        if self.fused:
            return [f"{self.hf}.gate_up_proj", f"{self.hf}.down_proj"]
        return [f"{self.hf}.{e}.{p}.weight" for e in range(self.num_experts) for p in self.proj]

    def mt_names(self) -> list[str]:
        return [f"{self.mt}.w1", f"{self.mt}.w3", f"{self.mt}.w2"]


Entry = Copy | Experts


class Family(ABC):
    """Base of the families; a subclass fills in the class attributes and the four abstract methods."""

    model_type: str = ""
    """``config.json`` ``model_type`` this family reads and writes."""
    architecture: str = ""
    """``architectures[0]`` of the written ``config.json``."""
    title: str = ""
    hf_defaults: dict[str, Any] = {}
    """What transformers' config class of the family (5.25) reads for a ``config.json`` key it
    lacks, for the keys whose value changes the model: ``registry.read_hf_config`` fills them in,
    so that a hand-written config.json converts to the model transformers loads from it."""
    keep_fp32: tuple[str, ...] = ()
    """Ends of the HF names of the tensors transformers keeps in fp32 whatever the model's dtype
    (``_keep_in_fp32_modules_strict``): a cast to bf16 leaves them fp32, both ways."""

    @abstractmethod
    def configs_from_hf(self, hf: dict) -> tuple[ModelConfig, MoEConfig]:
        """moetrain's model and moe configs of a ``config.json`` (ValueError for what they cannot hold)."""

    @abstractmethod
    def problems(self, model: ModelConfig, moe: MoEConfig) -> list[str]:
        """What of ``model``/``moe`` this family cannot express, one line each; [] = nothing."""

    @abstractmethod
    def hf_config(self, model: ModelConfig, moe: MoEConfig) -> dict:
        """``config.json`` of ``model``/``moe`` (assumes ``problems`` is empty)."""

    @abstractmethod
    def tensor_map(self, model: ModelConfig, moe: MoEConfig, *, fused: bool) -> list[Entry]:
        """Every tensor of the model: HF name(s), moetrain name, and how one becomes the other."""

    def fit_to_tensors(self, model: ModelConfig, hf: dict, names: set[str]) -> ModelConfig:
        """``model`` as the checkpoint's tensor ``names`` hold it, where config.json may promise
        more than a checkpoint stores (DeepSeek-V3's multi-token-prediction layers)."""
        return model

    def hf_config_from(self, model: ModelConfig, moe: MoEConfig) -> dict:
        """``hf_config`` after checking ``problems``: ValueError naming every moetrain field this
        family cannot express."""
        found = self.problems(model, moe)
        if found:
            raise ValueError(f"this model cannot be written as {self.title} ({self.model_type}): " + "; ".join(found))
        if moe.capacity_factor is not None:
            warnings.warn(f"moe.capacity_factor ({moe.capacity_factor}) is dropped: {self.title} is dropless, so "
                          "outputs differ wherever capacity would have dropped tokens", stacklevel=3)
        return self.hf_config(model, moe)


# --- config helpers shared by the families ---------------------------------------------------------


def hf_require(ok: bool, hf: dict, key: str, rule: str) -> None:
    require(ok, f"config.json {key}", hf.get(key), rule)


_HF_ROPE_FIELDS = {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
                   "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                   "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
                   "mscale_all_dim": "mscale_all_dim", "attention_factor": "attention_factor", "truncate": "truncate"}
"""config.json rope parameter -> ``RopeScaling`` field."""


def rope_fields(hf: dict, default_theta: float = 10000.0, *, softmax_mscale: bool = False) -> dict:
    """``rope_theta`` and ``rope_scaling`` of ``config.json`` (``rope_scaling``, transformers 4, when
    present, else ``rope_parameters``, transformers 5, as transformers picks), and ``max_seq_len``
    with "dynamic" scaling (``_dynamic_fields``). ValueError for a rope type moetrain does not implement.
    ``softmax_mscale``: the family's attention scales the softmax by yarn's ``mscale_all_dim``
    (DeepSeek's MLA); the others only use it in cos and sin, so it is folded into ``attention_factor``."""
    # transformers reads ``rope_scaling or rope_parameters``: a rope_scaling added by hand to a
    # transformers-5 config.json (long-context instructions do) overrides its default rope_parameters.
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(key) or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or default_theta)
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    require(kind in ROPE_TYPES, f"config.json {key}.rope_type", kind,
            f"must be \"default\" or one of {', '.join(ROPE_TYPES)}: moetrain does not implement this rope scaling")
    partial = params.pop("partial_rotary_factor", None)
    require(partial in (None, 1, 1.0), f"config.json {key}.partial_rotary_factor", partial,
            "must be 1: moetrain rotates every rotary feature")
    unknown = sorted(k for k, v in params.items() if k not in _HF_ROPE_FIELDS and v is not None)
    require(not unknown, f"config.json {key}", unknown, f"are keys moetrain does not read for rope_type {kind!r}")
    # A zero mscale means none, as in transformers.
    values = {_HF_ROPE_FIELDS[k]: _rope_value(k, v) for k, v in params.items()
              if v is not None and not (k.startswith("mscale") and not v)}
    if "mscale_all_dim" not in values or "attention_factor" in values:
        values.pop("mscale", None)  # transformers reads it only beside mscale_all_dim, with no attention_factor
    if kind == "dynamic":
        return _dynamic_fields(hf, key, theta, values)
    if kind == "linear" and "original_max_seq_len" in values:  # transformers' linear scaling ignores it too
        warnings.warn(f"config.json {key}.original_max_position_embeddings ({values.pop('original_max_seq_len')}) "
                      "is ignored: linear rope scaling does not read it", stacklevel=3)
    if kind in ("llama3", "yarn") and "original_max_seq_len" not in values:
        values["original_max_seq_len"] = int(hf.get("original_max_position_embeddings")
                                             or hf.get("max_position_embeddings", 4096))
    if kind == "yarn" and "factor" not in values:  # the stretch the two lengths imply (DeepSeek's configs)
        values["factor"] = int(hf.get("max_position_embeddings", 4096)) / values["original_max_seq_len"]
    scaling = RopeScaling(rope_type=kind, **values)
    if not softmax_mscale and scaling.mscale_all_dim is not None:
        scaling = replace(scaling, attention_factor=scaling.cos_sin_scale, mscale=None, mscale_all_dim=None)
    return {"rope_theta": theta, "rope_scaling": scaling}


def _dynamic_fields(hf: dict, key: str, theta: float, values: dict) -> dict:
    """transformers' dynamic NTK stretches past ``max_position_embeddings`` by as much as a
    sequence needs; moetrain's table needs a last position: ``factor`` times that length, the
    stretch the factor is meant for (``max_seq_len``, which overrides the backbone's)."""
    context = int(hf.get("max_position_embeddings", 4096))
    given = values.pop("original_max_seq_len", context)
    require(given == context, f"config.json {key}.original_max_position_embeddings", given,
            f"must be max_position_embeddings ({context}) or absent: dynamic scaling starts there")
    scaling = RopeScaling(rope_type="dynamic", original_max_seq_len=context, **values)
    return {"rope_theta": theta, "rope_scaling": scaling, "max_seq_len": int(context * scaling.factor)}


def _rope_value(key: str, value):
    """A config.json rope parameter as the ``RopeScaling`` field's type (left as is if it is not a
    number: the field's check names it)."""
    if key == "truncate" or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return int(value) if key == "original_max_position_embeddings" and float(value).is_integer() else float(value)


def rope_config(model: ModelConfig) -> dict:
    """The config.json rope entries of ``model``: ``rope_theta`` (transformers 4) and
    ``rope_parameters`` (transformers 5), plus ``rope_scaling`` (transformers 4) when scaled, and
    with "dynamic" scaling ``max_position_embeddings`` (overriding the backbone's)."""
    params: dict = {"rope_type": "default", "rope_theta": model.rope_theta}
    scaling = model.rope_scaling
    if scaling is None:
        return {"rope_theta": model.rope_theta, "rope_parameters": params}
    params["rope_type"] = scaling.rope_type
    dynamic = scaling.rope_type == "dynamic"
    for hf_key, field in _HF_ROPE_FIELDS.items():
        value = getattr(scaling, field)
        if value is not None and not (field == "truncate" and value) and not (dynamic and hf_key.startswith("orig")):
            params[hf_key] = value
    out = {"rope_theta": model.rope_theta, "rope_parameters": params, "rope_scaling": dict(params)}
    if dynamic:  # transformers' dynamic scaling starts past max_position_embeddings
        out["max_position_embeddings"] = scaling.original_max_seq_len
    return out


def backbone_fields(hf: dict, *, default_theta: float = 10000.0, softmax_mscale: bool = False) -> dict:
    """The ModelConfig fields every family reads the same way (``softmax_mscale``: ``rope_fields``)."""
    act = hf.get("hidden_act", "silu")
    hf_require(act in ("silu", "swish"), hf, "hidden_act", 'must be "silu" (SwiGLU MLPs)')
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        hf_require(isinstance(hf.get(key), int) and hf[key] > 0, hf, key, "must be a positive int")
    heads = hf["num_attention_heads"]
    return {"vocab_size": hf["vocab_size"], "dim": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
            "num_heads": heads, "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "max_seq_len": int(hf.get("max_position_embeddings", 4096)), "activation": "swiglu",
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            **rope_fields(hf, default_theta, softmax_mscale=softmax_mscale),  # after max_seq_len: dynamic sets it
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "init_std": float(hf.get("initializer_range", 0.02)), "head": "lm"}


def check_no_sliding_window(hf: dict) -> None:
    if hf.get("use_sliding_window"):
        raise ValueError(f"config.json use_sliding_window ({hf['use_sliding_window']!r}) must be false: "
                         "moetrain has no sliding-window attention")


def backbone_config(model: ModelConfig, *, family: Family) -> dict:
    """The config.json entries every family writes the same way."""
    return {"architectures": [family.architecture], "model_type": family.model_type,
            "vocab_size": model.vocab_size, "hidden_size": model.dim, "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_heads, "num_key_value_heads": model.resolved_num_kv_heads,
            "hidden_act": "silu", "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
            **rope_config(model),  # after max_position_embeddings: dynamic sets it
            "tie_word_embeddings": model.tie_embeddings, "initializer_range": model.init_std,
            "attention_dropout": 0.0, "use_cache": True, "output_router_logits": False,
            # Token ids belong to a tokenizer, not to the model: None unless the converter knows
            # them (from the folder the run was initialised from).
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "dtype": "float32"}


def backbone_problems(model: ModelConfig, moe: MoEConfig, *, family: str, mtp: bool = False) -> list[str]:
    """What no family here can express: a classifier head, hashed n-gram features, GELU MLPs,
    expert-choice routing, multi-token-prediction modules (unless ``mtp``), and the attention
    features checked by each family itself."""
    out = []
    if model.mtp_depth > 0 and not mtp:
        out.append(f"model.mtp_depth ({model.mtp_depth}) must be 0: {family} has no multi-token-prediction layers")
    # Before the head: it is listed first where one reason per family is shown, and a classifier with the
    # table would otherwise read as a plain classifier's refusal.
    if model.ngram_buckets > 0:
        out.append(f"model.ngram_buckets ({model.ngram_buckets}) must be 0: {family} has no hashed n-gram embedding")
    if model.head != "lm":
        out.append(f"model.head ({model.head!r}) must be \"lm\" ({family} is a causal LM)")
    if moe.activation != "swiglu":
        out.append(f"moe.activation ({moe.activation!r}) must be \"swiglu\" ({family} experts are SwiGLU)")
    dense = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
    if dense and model.activation != "swiglu":
        out.append(f"model.activation ({model.activation!r}) must be \"swiglu\" ({family} dense MLPs are SwiGLU)")
    if moe.router == "expert_choice":
        out.append(f"moe.router ({moe.router!r}) has no {family} equivalent (token-choice routing)")
    if model.document_separator is not None:
        out.append(f"model.document_separator ({model.document_separator!r}) must be None ({family} attends "
                   "across documents)")
    return out


def attention_problems(model: ModelConfig, *, family: str, qk_norm: str = "none", qkv_bias: bool = False,
                       clip_qkv: bool = False, head_dim: bool = True) -> list[str]:
    """What standard attention of ``family`` cannot express: MLA, the q/k norm it does not have,
    biases and clipping it lacks, interleaved rope, yarn's softmax scaling (``mscale_all_dim``), a
    head dim other than dim / heads (``head_dim`` False)."""
    out = []
    if model.attention != "mha":
        out.append(f"model.attention ({model.attention!r}) must be \"mha\" ({family} has standard attention)")
    if model.qk_norm != qk_norm:
        out.append(f"model.qk_norm ({model.qk_norm!r}) must be {qk_norm!r} for {family}")
    if model.qkv_bias and not qkv_bias:
        out.append(f"model.qkv_bias (true): {family} has no q/k/v biases")
    if model.clip_qkv is not None and not clip_qkv:
        out.append(f"model.clip_qkv ({model.clip_qkv}) must be None ({family} does not clip)")
    if model.rope_interleave:
        out.append(f"model.rope_interleave (true) must be false ({family} rotates halves)")
    scaling = model.rope_scaling
    if scaling is not None and scaling.mscale_all_dim is not None:
        out.append(f"model.rope_scaling.mscale_all_dim ({scaling.mscale_all_dim}) must be None: {family} does not "
                   "scale the softmax by it (give the cos/sin scale as attention_factor)")
    if not head_dim and model.resolved_head_dim != model.dim // model.num_heads:
        out.append(f"model.head_dim ({model.head_dim}) must be model.dim / model.num_heads "
                   f"({model.dim // model.num_heads}) for {family}")
    return out


def softmax_routing_problems(moe: MoEConfig, *, family: str, shared_gate: bool = False) -> list[str]:
    """What the softmax top-k families (Mixtral, Qwen, OLMoE) cannot express: sigmoid scores, a
    selection bias, group-limited routing, a routed scaling factor, a gated shared expert
    (unless ``shared_gate``)."""
    out = []
    if moe.router != "softmax":
        out.append(f"moe.router ({moe.router!r}) must be \"softmax\" ({family}'s routing)")
    if moe.has_expert_bias:
        out.append(f"moe.expert_bias / moe.router_bias_update_rate: {family} has no selection bias")
    if moe.num_expert_groups != 1:
        out.append(f"moe.num_expert_groups ({moe.num_expert_groups}) must be 1 ({family} has no group-limited "
                   "routing)")
    if moe.routed_scaling_factor != 1:
        out.append(f"moe.routed_scaling_factor ({moe.routed_scaling_factor}) must be 1.0 ({family} does not scale "
                   "the routed output)")
    if moe.shared_expert_gate and not shared_gate:
        out.append(f"moe.shared_expert_gate (true): {family} has no gated shared expert")
    return out + top_k_problems(moe, family=family)


def top_k_problems(moe: MoEConfig, *, family: str) -> list[str]:
    # HF renormalises a single top-1 weight to 1.0; moetrain keeps the router probability there
    # so that the router still gets a gradient: the two models would differ.
    if moe.renormalize and moe.top_k == 1:
        return [(f"moe.top_k (1) with moe.renormalize (true) differs from {family}'s norm_topk_prob "
                 "(weight 1.0): set moe.renormalize=false or top_k >= 2")]
    return []


def layer_kinds(model: ModelConfig) -> list[bool]:
    """Whether each block is MoE."""
    return [model.is_moe_layer(i) for i in range(model.num_layers)]


# --- tensor-map helpers ----------------------------------------------------------------------------


def embedding_entries(model: ModelConfig) -> list[Entry]:
    out: list[Entry] = [Copy("model.embed_tokens.weight", "tok_embeddings.weight"),
                        Copy("model.norm.weight", "norm.weight")]
    if model.tie_embeddings:
        out.append(Copy("model.embed_tokens.weight", "output.weight", export=False))
    else:
        out.append(Copy("lm_head.weight", "output.weight"))
    return out


def norm_entries(i: int) -> list[Entry]:
    return [Copy(f"model.layers.{i}.input_layernorm.weight", f"layers.{i}.attention_norm.weight"),
            Copy(f"model.layers.{i}.post_attention_layernorm.weight", f"layers.{i}.ffn_norm.weight")]


def attention_entries(i: int, model: ModelConfig) -> list[Entry]:
    """Standard (q, k, v, o) attention, with the optional qkv biases and q/k norms."""
    hf, mt = f"model.layers.{i}.self_attn.", f"layers.{i}.attention."
    out: list[Entry] = [Copy(f"{hf}{p}_proj.weight", f"{mt}w{p}.weight") for p in "qkvo"]
    if model.qkv_bias:
        out += [Copy(f"{hf}{p}_proj.bias", f"{mt}w{p}.bias") for p in "qkv"]
    if model.qk_norm != "none":
        out += [Copy(f"{hf}{p}_norm.weight", f"{mt}{p}_norm.weight") for p in "qk"]
    return out


def mlp_entries(hf: str, mt: str) -> list[Entry]:
    """A SwiGLU MLP ``gate_proj``/``up_proj``/``down_proj`` <-> moetrain ``w1``/``w3``/``w2``."""
    return [Copy(f"{hf}.{h}.weight", f"{mt}.{m}.weight")
            for h, m in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))]


def has_fused_experts(names) -> bool:
    """Whether a file stores experts in the fused transformers-5 layout."""
    return any(n.endswith(".experts.gate_up_proj") for n in names)
