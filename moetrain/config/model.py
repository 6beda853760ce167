"""Config of the transformer backbone: sizes, positions, head. The MoE FFN itself is the `moe` section."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require, require_choice, require_positive


@dataclass
class ModelConfig:
    preset: str | None = None
    """Name of a preset in ``moetrain.config.presets`` ("tiny", "tiny-dense", "mixtral-mini", "mixtral-8x7b",
    "deepseek-moe-16b"). ``load_config`` checks and applies it: the preset's model and moe values
    come first and every field written in the file or on the command line overrides them. (Built
    directly in Python, a ModelConfig only records the name.)"""

    vocab_size: int | None = None
    """Vocabulary size V. None = take it from the tokenizer when the model is built."""

    dim: int = 128
    """Model (residual stream) dimension D."""

    num_layers: int = 4
    """Number of transformer blocks."""

    num_heads: int = 4
    """Query heads. dim must be divisible by num_heads; the head dim must be even (rotary)."""

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

    tie_embeddings: bool = False
    """Share the token-embedding matrix with the LM head (GPT-2 style); ignored by the classifier head."""

    init_std: float = 0.02
    """Std of the normal init of all weight matrices. Residual output projections (attention out,
    FFN/expert down-projections) use init_std / sqrt(2 * num_layers), as GPT-2 and Megatron."""

    head: str = "lm"
    """Output head: "lm" (next-token logits over the vocabulary) or "classifier" (the last token's
    hidden state -> num_classes logits)."""

    num_classes: int | None = None
    """Number of classes of the classifier head; required (>= 2) when head is "classifier"."""

    def __post_init__(self) -> None:
        # The name is checked where it is applied (config_from_dict): the presets are built from
        # this class, so it cannot consult them.
        require(self.preset is None or (isinstance(self.preset, str) and self.preset != ""), "model.preset",
                self.preset, "must be None or a preset name")
        require_int("model.vocab_size", self.vocab_size, min_value=2, none_ok=True,
                    note=" (None = from the tokenizer)")
        for name in ("dim", "num_layers", "num_heads", "max_seq_len"):
            require_int(f"model.{name}", getattr(self, name), min_value=1)
        require(self.dim % self.num_heads == 0, "model.dim", self.dim,
                f"must be divisible by model.num_heads ({self.num_heads})")
        require(self.head_dim % 2 == 0, "model.dim", self.dim,
                f"/ model.num_heads ({self.num_heads}) = head dim {self.head_dim} must be even (rotary)")
        require_int("model.num_kv_heads", self.num_kv_heads, min_value=1, none_ok=True)
        if self.num_kv_heads is not None:
            require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
                    f"must divide model.num_heads ({self.num_heads})")
        require_int("model.moe_every", self.moe_every, note=" (0 = dense model)")
        require_int("model.moe_layer_offset", self.moe_layer_offset)
        require(self.moe_every == 0 or self.moe_layer_offset < self.num_layers, "model.moe_layer_offset",
                self.moe_layer_offset, f"must be < model.num_layers ({self.num_layers}) so that some block "
                "is MoE (set model.moe_every=0 for a dense model)")
        require_int("model.dense_hidden_dim", self.dense_hidden_dim, min_value=1, none_ok=True,
                    note=" (None = 4 * dim)")
        require_choice("model.activation", self.activation, ("gelu", "swiglu"))
        require_positive("model.norm_eps", self.norm_eps)
        require_positive("model.rope_theta", self.rope_theta)
        require_bool("model.tie_embeddings", self.tie_embeddings)
        require_positive("model.init_std", self.init_std)
        require_choice("model.head", self.head, ("lm", "classifier"))
        if self.head == "classifier" or self.num_classes is not None:
            require_int("model.num_classes", self.num_classes, min_value=2,
                        note=' (required when model.head is "classifier")')

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_dense_hidden_dim(self) -> int:
        return 4 * self.dim if self.dense_hidden_dim is None else self.dense_hidden_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` (0-based) has an MoE FFN."""
        return (self.moe_every > 0 and layer_id >= self.moe_layer_offset
                and (layer_id - self.moe_layer_offset) % self.moe_every == 0)

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

