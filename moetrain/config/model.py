"""Config of the transformer backbone: sizes, positions, head. The MoE FFN itself is the `moe` section."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace

from moetrain.config._checks import is_int, require_bool, require_int
from moetrain.config.base import require, require_active, require_choice, require_positive
from moetrain.config.moe import MoEConfig
from moetrain.config.rope import RopeScaling, rope_scaling_from


@dataclass
class ModelConfig:
    preset: str | None = None
    """Name of a preset in ``moetrain.config.presets`` ("tiny", "tiny-dense", "mixtral-mini", "mixtral-8x7b",
    "deepseek-moe-16b"). ``load_config`` checks and applies it: the preset's model and moe values
    come first and every field written in the file or on the command line overrides them, even with
    the preset given on the command line. A command-line preset over a file that writes every model
    and moe field (a saved run config) would change only the label and is refused. (Built directly in
    Python, a ModelConfig only records the name.)"""

    vocab_size: int | None = None
    """Vocabulary size V. None = take it from the tokenizer when the model is built."""

    dim: int = 128
    """Model (residual stream) dimension D."""

    num_layers: int = 4
    """Number of transformer blocks."""

    num_heads: int = 4
    """Query heads. Without an explicit head_dim, dim must be divisible by num_heads and the head
    dim dim / num_heads must be even (rotary)."""

    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None = num_heads (multi-head attention).
    Must divide num_heads."""

    max_seq_len: int = 256
    """Longest sequence the rotary table is built for; data.seq_len must not exceed it."""

    moe_every: int = 1
    """MoE FFN in every n-th block (counting from moe_layer_offset), dense FFN elsewhere.
    1 = every block is MoE, 2 = every other block, 0 = no MoE at all (a dense model)."""

    moe_layer_offset: int = 0
    """Index of the first MoE block; the blocks before it are dense (DeepSeekMoE: 1)."""

    dense_hidden_dim: int | None = None
    """Hidden size of the dense FFN blocks; None = 4 * dim."""

    activation: str = "gelu"
    """Activation of the dense FFN blocks: "gelu" or "swiglu". The experts' is moe.activation."""

    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""

    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""

    rope_scaling: RopeScaling | None = None
    """How the rotary frequencies are stretched for a context longer than pretraining's
    (``moetrain.config.rope.RopeScaling``: "linear", "llama3", "yarn" or "dynamic" with their parameters),
    as the long-context checkpoints' ``rope_parameters`` say; None = plain RoPE. "yarn" also
    scales cos and sin, and with ``mscale_all_dim`` the softmax (``softmax_scale``)."""

    tie_embeddings: bool = False
    """Share the token-embedding matrix with the LM head (GPT-2 style); ignored by the classifier head."""

    dropout: float = 0.0
    """Dropout probability on the token embeddings and on every attention and FFN/MoE output
    before its residual add, while training (0 = off: LLM pretraining, torchtitan's and
    Megatron's default). A regulariser for small supervised tasks (classification). The masks
    are drawn per rank, so runs of one job at different layouts differ by them."""

    init_std: float = 0.02
    """Std of the normal init of all weight matrices. Residual output projections (attention out,
    FFN/expert down-projections) use init_std / sqrt(2 * num_layers), as GPT-2 and Megatron."""

    head: str = "lm"
    """Output head: "lm" (next-token logits over the vocabulary) or "classifier" (the last token's
    hidden state -> num_classes logits)."""

    num_classes: int | None = None
    """Number of classes of the classifier head; required (>= 2) when head is "classifier"."""

    head_dim: int | None = None
    """Per-head dim A of q, k and v (even: rotary); None = dim // num_heads. Qwen3-MoE sets it apart
    from dim / num_heads: the projections are then [H*A, D] and the output [D, H*A]. Read the value
    in effect from ``resolved_head_dim``. Must stay None with attention "mla" (its own dims below)."""

    qkv_bias: bool = False
    """Bias on the q, k and v projections (Qwen2-MoE); the output projection has none. Not with "mla"."""

    qk_norm: str = "none"
    """RMSNorm of q and k before rotary (eps norm_eps): "none"; "head", over each head's A features
    (Qwen3-MoE, weights [A]); "full", over the whole q projection [H*A] and k projection [G*A]
    (OLMoE). Not with "mla"."""

    clip_qkv: float | None = None
    """Clamp q, k and v to [-clip_qkv, clip_qkv] after the q/k norm and before rotary (OLMoE);
    None = no clamp. Not with "mla"."""

    attention: str = "mha"
    """"mha": multi-head attention with num_kv_heads grouped key/value heads; "mla": DeepSeek's
    multi-head latent attention (q_lora_rank .. v_head_dim below; num_kv_heads, head_dim, qkv_bias,
    qk_norm and clip_qkv must stay unset)."""

    q_lora_rank: int | None = None
    """MLA: rank of the query latent (wq_a [Q, D], q_norm, wq_b); None = one plain query projection
    (DeepSeek-V2-Lite). Only with attention "mla"."""

    kv_lora_rank: int = 64
    """MLA: rank R of the key/value latent every head's no-rotary key part and value come from.
    Only with attention "mla" (it must keep its default otherwise)."""

    qk_nope_head_dim: int = 32
    """MLA: per-head q/k features without rotary positions. Only with attention "mla"."""

    qk_rope_head_dim: int = 16
    """MLA: per-head q/k features with rotary positions (even); the key's are shared by all heads.
    The scores are scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim). Only with attention "mla"."""

    v_head_dim: int = 32
    """MLA: per-head value dim; the output projection is [D, num_heads * v_head_dim]. Only with
    attention "mla"."""

    rope_interleave: bool = False
    """Rotary pairs are adjacent features (2i, 2i+1), as DeepSeek's checkpoints and transformers'
    rope_interleave; False = the (i, i + A/2) pairs of the "rotate half" layout (Llama, Mixtral,
    Qwen, OLMoE). Applies to whatever gets rotary: q and k, or MLA's rotary parts."""

    dense_layers: tuple[int, ...] = ()
    """Block ids (0-based) with a dense FFN whatever moe_every and moe_layer_offset say (Qwen2-MoE's
    mlp_only_layers). Each must be < num_layers, none twice."""

    pooling: str = "last"
    """Classifier pooling of the final hidden states: "last", the last real token (with causal
    attention the only one that saw the whole sequence); "mean", the mean over the real tokens;
    "attention", a weighted mean over the real tokens whose weights are a softmax of each hidden
    state's dot product with a learnt query (one vector of ``dim``, initialised to zero, so training
    starts from the mean): the model can learn to weigh the words that tell the classes apart above
    the frequent ones, which a plain mean of normalised states cannot. Only with head "classifier"."""

    causal: bool = True
    """Causal attention. False (only with head "classifier"): every real token attends to every
    real token of its sequence; padded keys are masked out."""

    document_separator: int | None = None
    """Token id that ends each document of a packed LM sequence (the tokenizer's end-of-text id).
    Set, attention is block-diagonal causal: a token sees only the earlier tokens of its own
    document, the separator counting in the document it ends. Rotary positions stay those of the
    packed sequence. None = plain causal attention across documents. Only with head "lm"."""

    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3): D sequential modules after the last block, module k
    predicting the token k + 1 places after the next one from the previous depth's hidden state
    and the embedding of the token k places ahead (``moetrain.models.mtp``; docs/mtp.md). Each has
    its own norms, a [2 dim -> dim] projection and one block (MoE when the model has MoE blocks),
    and shares the embedding and the output head. 0 = off. Only with head "lm"; must be less than
    the sequence length. Not split by parallel.tp nor by parallel.pp (refused by name)."""

    mtp_loss_weight: float = 0.3
    """Weight of the multi-token loss: the mean over the depths of each one's cross-entropy, times
    this, is added to the next-token loss (DeepSeek-V3: 0.3, then 0.1). Acts with mtp_depth > 0."""

    ngram_buckets: int = 0
    """Hashed n-gram input features (fastText's bigram/trigram buckets; ``moetrain.models.ngram``,
    docs/classification.md): at each position the n-grams of token ids ending there, n = 2 ..
    ngram_max_order, are hashed into this many rows of one [ngram_buckets, dim] table (initialised
    to zero), whose rows are added to the token embedding. 0 = off. Only with head "classifier"
    (decoding and multi-token prediction would need the previous tokens); not with parallel.tp
    nor parallel.pp > 1, nor in a Hugging Face conversion (refused by name)."""

    ngram_max_order: int = 3
    """Longest n-gram hashed by ngram_buckets (>= 2: bigrams, 3 adds trigrams, ...). Acts with
    ngram_buckets > 0."""

    def __post_init__(self) -> None:
        # The name is checked where it is applied (config_from_dict): the presets are built from
        # this class, so it cannot consult them.
        require(self.preset is None or (isinstance(self.preset, str) and self.preset != ""), "model.preset",
                self.preset, "must be None or a preset name")
        require_int("model.vocab_size", self.vocab_size, min_value=2, none_ok=True,
                    note=" (None = from the tokenizer)")
        for name in ("dim", "num_layers", "num_heads", "max_seq_len"):
            require_int(f"model.{name}", getattr(self, name), min_value=1)
        require_choice("model.attention", self.attention, ("mha", "mla"))
        if self.attention == "mla":
            self._check_mla()
        else:
            self._check_mha()
        require_bool("model.rope_interleave", self.rope_interleave)
        require_int("model.moe_every", self.moe_every, note=" (0 = dense model)")
        require_int("model.moe_layer_offset", self.moe_layer_offset)
        require_active(self.moe_every > 0 or self.moe_layer_offset == 0, "model.moe_layer_offset",
                       self.moe_layer_offset,
                       "acts only with model.moe_every > 0 (model.moe_every is 0, a dense model): leave it at 0")
        require(self.moe_every == 0 or self.moe_layer_offset < self.num_layers, "model.moe_layer_offset",
                self.moe_layer_offset, f"must be < model.num_layers ({self.num_layers}) so that some block "
                "is MoE (set model.moe_every=0 for a dense model)")
        require_int("model.dense_hidden_dim", self.dense_hidden_dim, min_value=1, none_ok=True,
                    note=" (None = 4 * dim)")
        require_choice("model.activation", self.activation, ("gelu", "swiglu"))
        require_positive("model.norm_eps", self.norm_eps)
        require_positive("model.rope_theta", self.rope_theta)
        if isinstance(self.rope_scaling, Mapping):
            self.rope_scaling = rope_scaling_from(self.rope_scaling)  # Python callers and JSON write a dict
        require(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling), "model.rope_scaling",
                self.rope_scaling, "must be None or a mapping of rope_type, factor, ... (RopeScaling)")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "dynamic":
            require(self.rope_dim > 2, "model.rope_scaling.rope_type", "dynamic",
                    f"needs more than 2 rotary dims per head (it has {self.rope_dim}): its exponent is P / (P - 2)")
        require_bool("model.tie_embeddings", self.tie_embeddings)
        require_positive("model.init_std", self.init_std)
        require(isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
                and 0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "must be a number in [0, 1)")
        require_choice("model.head", self.head, ("lm", "classifier"))
        require_active(self.head == "classifier" or self.num_classes is None, "model.num_classes", self.num_classes,
                       f'acts only with model.head "classifier" (model.head is {self.head!r}): leave it null')
        if self.head == "classifier":
            require_int("model.num_classes", self.num_classes, min_value=2,
                        note=' (required when model.head is "classifier")')
        self._check_layers_and_heads()
        self._check_mtp()
        self._check_ngram()

    def _check_ngram(self) -> None:
        require_int("model.ngram_buckets", self.ngram_buckets, min_value=0, note=" (0 = no n-gram features)")
        require(self.ngram_buckets != 1 and self.ngram_buckets < NGRAM_MODULUS, "model.ngram_buckets",
                self.ngram_buckets, f"must be 0 (off) or in [2, {NGRAM_MODULUS}): the hash's range")
        require(self.ngram_buckets == 0 or self.head == "classifier", "model.ngram_buckets", self.ngram_buckets,
                f'must be 0 with model.head {self.head!r}: the n-gram features are built for the classifier '
                "(decoding and multi-token prediction would need the previous tokens)")
        require_int("model.ngram_max_order", self.ngram_max_order, min_value=2, note=" (2 = bigrams)")
        require_active(self.ngram_buckets > 0 or self.ngram_max_order == _NGRAM_ORDER, "model.ngram_max_order",
                       self.ngram_max_order, f"acts only with model.ngram_buckets > 0: leave it at {_NGRAM_ORDER}")

    def _check_mtp(self) -> None:
        require_int("model.mtp_depth", self.mtp_depth, min_value=0, note=" (0 = no multi-token prediction)")
        require(self.mtp_depth == 0 or self.head == "lm", "model.mtp_depth", self.mtp_depth,
                f'must be 0 with model.head {self.head!r}: multi-token prediction predicts tokens (head "lm")')
        require(self.mtp_depth < self.max_seq_len, "model.mtp_depth", self.mtp_depth,
                f"must be < model.max_seq_len ({self.max_seq_len}): depth k scores the tokens k + 1 places ahead")
        require(isinstance(self.mtp_loss_weight, (int, float)) and not isinstance(self.mtp_loss_weight, bool)
                and self.mtp_loss_weight >= 0, "model.mtp_loss_weight", self.mtp_loss_weight, "must be a number >= 0")
        require_active(self.mtp_depth > 0 or self.mtp_loss_weight == _MTP_WEIGHT, "model.mtp_loss_weight",
                       self.mtp_loss_weight, f"acts only with model.mtp_depth > 0: leave it at {_MTP_WEIGHT}")

    def _check_mha(self) -> None:
        require_int("model.head_dim", self.head_dim, min_value=2, none_ok=True, note=" (None = dim // num_heads)")
        if self.head_dim is None:
            require(self.dim % self.num_heads == 0, "model.dim", self.dim,
                    f"must be divisible by model.num_heads ({self.num_heads})")
            A = self.dim // self.num_heads
            require(A % 2 == 0, "model.dim", self.dim,
                    f"/ model.num_heads ({self.num_heads}) = head dim {A} must be even (rotary)")
        else:
            require(self.head_dim % 2 == 0, "model.head_dim", self.head_dim, "must be even (rotary)")
        require_int("model.num_kv_heads", self.num_kv_heads, min_value=1, none_ok=True)
        if self.num_kv_heads is not None:
            require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
                    f"must divide model.num_heads ({self.num_heads})")
        require_bool("model.qkv_bias", self.qkv_bias)
        require_choice("model.qk_norm", self.qk_norm, ("none", "head", "full"))
        c = self.clip_qkv
        require(c is None or (isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0),
                "model.clip_qkv", c, "must be None or a finite number > 0")
        for name in _MLA_FIELDS:
            default = _DEFAULTS[name]
            require_active(getattr(self, name) == default, f"model.{name}", getattr(self, name),
                           f'acts only with model.attention "mla" (model.attention is "mha"): leave it at {default!r}')

    def _check_mla(self) -> None:
        for name in _MHA_FIELDS:
            default = _DEFAULTS[name]
            require(getattr(self, name) == default, f"model.{name}", getattr(self, name),
                    f'must be {default!r} with model.attention "mla" (the latent attention has its own dims)')
        require_int("model.q_lora_rank", self.q_lora_rank, min_value=1, none_ok=True,
                    note=" (None = a plain query projection)")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require_int(f"model.{name}", getattr(self, name), min_value=1)
        require(self.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", self.qk_rope_head_dim,
                "must be even (rotary)")

    def _check_layers_and_heads(self) -> None:
        if isinstance(self.dense_layers, list):
            self.dense_layers = tuple(self.dense_layers)  # YAML and Python callers write lists
        ok = isinstance(self.dense_layers, tuple) and all(
            is_int(i) and 0 <= i < self.num_layers for i in self.dense_layers)
        require(ok, "model.dense_layers", self.dense_layers,
                f"must be a list of block ids in [0, model.num_layers ({self.num_layers}))")
        require(len(set(self.dense_layers)) == len(self.dense_layers), "model.dense_layers", self.dense_layers,
                "must not name a block twice")
        require_choice("model.pooling", self.pooling, ("last", "mean", "attention"))
        require_active(self.pooling == "last" or self.head == "classifier", "model.pooling", self.pooling,
                       f'acts only with model.head "classifier" (model.head is {self.head!r})')
        require_bool("model.causal", self.causal)
        require(self.causal or self.head == "classifier", "model.causal", self.causal,
                f'may be false only with model.head "classifier" (model.head is {self.head!r}): '
                "a language model must not see the tokens it predicts")
        require_int("model.document_separator", self.document_separator, none_ok=True,
                    note=" (a token id; None = attention across documents)")
        if self.document_separator is not None:
            require_active(self.head == "lm", "model.document_separator", self.document_separator,
                           f'acts only with model.head "lm" (model.head is {self.head!r})')
            require(self.vocab_size is None or self.document_separator < self.vocab_size,
                    "model.document_separator", self.document_separator,
                    f"must be < model.vocab_size ({self.vocab_size})")

    @property
    def resolved_head_dim(self) -> int:
        """Per-head q.k dim A: head_dim, else dim // num_heads; with "mla",
        qk_nope_head_dim + qk_rope_head_dim (values have v_head_dim)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.dim // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Features per head that get rotary positions: the whole head, or MLA's rotary part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.resolved_head_dim

    @property
    def softmax_scale(self) -> float | None:
        """The attention softmax scale when rope scaling changes it (yarn's ``mscale_all_dim``):
        ``softmax_multiplier / sqrt(A)``; None = attention's own ``1/sqrt(A)``."""
        multiplier = 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_multiplier
        return None if multiplier == 1.0 else multiplier / self.resolved_head_dim ** 0.5

    @property
    def resolved_vocab_size(self) -> int:
        """``vocab_size``, which must be set by now (``with_vocab_size``)."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size (None) must be set here: ModelConfig.with_vocab_size(tokenizer's)")
        return self.vocab_size

    @property
    def num_outputs(self) -> int:
        """Logits per position of the head: ``num_classes`` for a classifier, else the vocabulary."""
        if self.head == "classifier":
            assert self.num_classes is not None, "__post_init__ requires num_classes for a classifier"
            return self.num_classes
        return self.resolved_vocab_size

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_dense_hidden_dim(self) -> int:
        return 4 * self.dim if self.dense_hidden_dim is None else self.dense_hidden_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` (0-based) has an MoE FFN."""
        return (self.moe_every > 0 and layer_id >= self.moe_layer_offset
                and (layer_id - self.moe_layer_offset) % self.moe_every == 0
                and layer_id not in self.dense_layers)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layer_ids)

    def with_vocab_size(self, tokenizer_vocab_size: int) -> ModelConfig:
        """This config with ``vocab_size`` resolved from the tokenizer (when None), else checked
        to hold every token id the tokenizer can produce."""
        if self.vocab_size is None:
            return replace(self, vocab_size=tokenizer_vocab_size)
        require(self.vocab_size >= tokenizer_vocab_size, "model.vocab_size", self.vocab_size,
                f"must be >= the tokenizer's vocabulary ({tokenizer_vocab_size})")
        return self



def tensor_parallel_errors(model: ModelConfig, tp: int, *, moe: MoEConfig | None = None) -> list[str]:
    """What tensor parallelism over ``tp`` ranks cannot split in ``model``, one message each (none
    at tp = 1): the classifier head pools along the sharded sequence, latent attention's
    projections read the whole input outside the column-wise layers, heads and key/value heads
    split evenly, a norm across all heads cannot see them, the dense blocks' FFNs split their
    hidden dim (the shared experts stay whole). With ``moe`` (the model's MoE settings): the
    multi-token modules' padded positions leave the tp ranks unequal token counts, which a
    capacity factor cannot share out."""
    if tp == 1:
        return []
    errors = []
    if model.head != "lm":
        errors.append(f"model.head ({model.head!r}) must be 'lm' with parallel.tp > 1: the classifier pools "
                      "along the sequence, which tensor parallelism shards")
    if model.ngram_buckets > 0:
        errors.append(f"model.ngram_buckets ({model.ngram_buckets}) must be 0 with parallel.tp > 1: an n-gram reads "
                      "the tokens before it, which sequence parallelism puts on another rank")
    if model.attention == "mla":
        errors.append("model.attention ('mla') is not split by parallel.tp: its latent projections read the whole "
                      "input outside the column-wise layers")
    else:
        if model.num_heads % tp or model.resolved_num_kv_heads % tp:
            errors.append(f"parallel.tp ({tp}) must divide model.num_heads ({model.num_heads}) and the key/value "
                          f"heads ({model.resolved_num_kv_heads})")
        if model.qk_norm == "full":
            errors.append("model.qk_norm ('full') normalises across all heads, which parallel.tp splits: use 'head' "
                          "or 'none'")
    if model.mtp_depth > 0 and model.is_moe and moe is not None and moe.capacity_factor is not None:
        errors.append(f"moe.capacity_factor ({moe.capacity_factor}) must be null with model.mtp_depth > 0 and "
                      "parallel.tp > 1: depth k pads its last k positions, which leaves the tp ranks unequal token "
                      "counts, and capacity is shared out over equal ones")
    hidden = model.resolved_dense_hidden_dim
    if len(model.moe_layer_ids) < model.num_layers and hidden % tp:
        errors.append(f"parallel.tp ({tp}) must divide the dense FFN hidden dim ({hidden}, model.dense_hidden_dim)")
    return errors


_DEFAULTS = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
_MTP_WEIGHT = _DEFAULTS["mtp_loss_weight"]
_NGRAM_ORDER = _DEFAULTS["ngram_max_order"]
NGRAM_MODULUS = 2**31 - 1
"""The n-gram hash's modulus (``moetrain.models.ngram``): its values, hence the buckets, stay below it."""
_MHA_FIELDS = ("head_dim", "num_kv_heads", "qkv_bias", "qk_norm", "clip_qkv")
"""Fields of multi-head attention that latent attention has no use for."""
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""Fields that only latent attention reads."""
