"""Tiny random dense Hugging Face models (Llama, Qwen3), built by `transformers` from its own
config classes (no download), with weights that make a wrong mapping show: norm gains away from
1, and projections of std 1/sqrt(fan-in) rather than HF's 0.02, so that every block (its MLP
above all) moves the logits by O(1), not by a rounding error."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never reach for the Hub
import transformers

from tests.helpers.hf_tiny_models import eager_model

VOCAB = 96
DENSE_FAMILIES = ["llama", "qwen3"]


def dense_config(family: str, **overrides):
    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 48, "num_hidden_layers": 3, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "rope_theta": 500.0}
    if family == "llama":
        kw = dict(common, bos_token_id=None, eos_token_id=None)
        cls = transformers.LlamaConfig
    elif family == "qwen3":
        # head_dim 12 != 32 / 4 and tied embeddings, as Qwen3-0.6B has.
        kw = dict(common, head_dim=12, tie_word_embeddings=True)
        cls = transformers.Qwen3Config
    else:
        raise ValueError(family)
    kw.update(overrides)
    theta = kw.pop("rope_theta")
    # ``rope_parameters`` in ``overrides`` (a rope scaling) keeps the base unless it names its own.
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **kw.get("rope_parameters", {})}
    return cls(**kw)


@torch.no_grad()
def tiny_dense(family: str, *, seed: int = 0, **overrides):
    model, g = eager_model(dense_config(family, **overrides), seed=seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif name.endswith("proj.weight"):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model


def input_ids(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
