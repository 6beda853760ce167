"""Named model presets: a ``ModelConfig`` and a ``MoEConfig`` each.

Select one with ``model.preset`` in a config file or ``--model.preset=<name>``; fields set
explicitly override the preset's (``moetrain.config.convert.config_from_dict`` applies them). The
large presets are for planning and GPU runs; their parameter counts are checked analytically in
the tests, never by building them. The job files that use them (``--config tiny``) are
``moetrain/configs/*.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig


@dataclass(frozen=True)
class Preset:
    model: ModelConfig
    moe: MoEConfig
    description: str


_TINY_MODEL: dict[str, Any] = {"dim": 128, "num_layers": 4, "num_heads": 4, "max_seq_len": 256, "activation": "gelu",
               "tie_embeddings": True}
_TINY_MOE = MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=256, activation="gelu")

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        model=ModelConfig(**_TINY_MODEL, moe_every=1),
        moe=_TINY_MOE,
        description="CPU demo: 4 blocks of dim 128, 8 experts top-2 (hidden 256) in every block; vocabulary "
                    "from the tokenizer (~4096). Trains a few hundred steps on 2 cores in minutes.",
    ),
    "tiny-dense": Preset(
        # Dense twin of "tiny" with the same active parameters per token: the dense hidden dim is
        # top_k * expert_hidden_dim = 2 * 256 (the only difference is tiny's 128x8 router per block).
        model=ModelConfig(**_TINY_MODEL, moe_every=0,
                          dense_hidden_dim=_TINY_MOE.top_k * _TINY_MOE.expert_hidden_dim),
        moe=_TINY_MOE,
        description="Dense baseline for the MoE-vs-dense comparison: tiny with one FFN of hidden 512 "
                    "per block.",
    ),
    "mixtral-8x7b": Preset(
        model=ModelConfig(vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                          max_seq_len=32768, moe_every=1, activation="swiglu", norm_eps=1e-5,
                          rope_theta=1e6, tie_embeddings=False),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=14336, activation="swiglu", renormalize=True),
        description="Mixtral 8x7B: 46.7B parameters, 12.9B active per token.",
    ),
    "mixtral-mini": Preset(
        # Mixtral's structure at dim 256 (swiglu experts 3.5x dim, 8 experts top-2, 4:1 grouped-query
        # heads, untied head): small enough to build and measure on a CPU, larger than tiny in every
        # way. The planner's activation estimate is checked against it.
        model=ModelConfig(vocab_size=2048, dim=256, num_layers=4, num_heads=8, num_kv_heads=2, max_seq_len=256,
                          moe_every=1, activation="swiglu", norm_eps=1e-5, rope_theta=1e6, tie_embeddings=False),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=896, activation="swiglu", renormalize=True),
        description="Mixtral-shaped model at dim 256 (24M parameters) for CPU planning checks and GPU smoke runs.",
    ),
    "deepseek-moe-16b": Preset(
        model=ModelConfig(vocab_size=102400, dim=2048, num_layers=28, num_heads=16, max_seq_len=4096,
                          moe_every=1, moe_layer_offset=1, dense_hidden_dim=10944, activation="swiglu",
                          norm_eps=1e-6, rope_theta=10000.0, tie_embeddings=False),
        # Fine-grained experts: 64 routed of hidden 1408, top-6, plus 2 always-on shared experts;
        # the top-k weights are not renormalised (DeepSeekMoE), the first block is dense.
        moe=MoEConfig(num_experts=64, top_k=6, expert_hidden_dim=1408, activation="swiglu",
                      num_shared_experts=2, renormalize=False, aux_loss_coef=0.001),
        description="DeepSeekMoE 16B-like: 16.4B parameters, 2.8B active per token.",
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"model.preset ({name!r}) must be one of {', '.join(map(repr, PRESETS))}")
    return PRESETS[name]
