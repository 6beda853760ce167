"""``model.dropout``: off by default (no dropout module in the graph), active only in training, and
a dropout model in eval mode is the dropout-free model with the same seed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.models.transformer import Transformer

MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16)


def _model(dropout: float, **kw) -> Transformer:
    return Transformer(ModelConfig(vocab_size=50, dim=16, num_layers=2, num_heads=2, max_seq_len=8, moe_every=2,
                                   dropout=dropout, **kw), moe=MOE, seed=3)


def test_default_has_no_dropout_modules():
    assert not any(isinstance(m, nn.Dropout) for m in _model(0.0).modules())
    # Embedding output plus the attention and FFN/MoE outputs of each of the 2 blocks.
    assert sum(isinstance(m, nn.Dropout) and m.p == 0.25 for m in _model(0.25).modules()) == 3


def test_dropout_acts_in_training_only():
    ids = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(0))
    model, plain = _model(0.3), _model(0.0)
    model.train()
    a, b = model(ids).logits, model(ids).logits
    assert not torch.equal(a, b)  # two draws of the masks
    model.eval()
    plain.eval()
    assert torch.equal(model(ids).logits, plain(ids).logits)


def test_dropout_reaches_the_classifier_and_is_validated():
    ids = torch.randint(1, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    model = _model(0.5, head="classifier", num_classes=3, pooling="mean", causal=False)
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match=r"model\.dropout .* must be a number in \[0, 1\)"):
            ModelConfig(dropout=bad)
