"""A model trained with ``data.document_mask`` generates with the same mask: the trainer resolves
the separator (its tokenizer's end-of-text id) when it builds the model and the saved config keeps
``document_separator: null``, so ``moetrain generate`` must resolve it again. Before, a prompt
holding the separator was read across documents (the review's probe: logits 0.04 apart)."""

from __future__ import annotations

import dataclasses

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import train_bpe
from moetrain.interop.generation import apply_document_mask
from moetrain.models.transformer import Transformer


def test_generation_reads_documents_as_training_did():
    tokenizer = train_bpe(["to be or not to be", "that is the question"], vocab_size=300)
    assert tokenizer.eos_id is not None
    cfg = ModelConfig(vocab_size=300, dim=32, num_layers=2, num_heads=4, max_seq_len=32)
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16)
    trained = Transformer(dataclasses.replace(cfg, document_separator=tokenizer.eos_id), moe=moe, seed=0).eval()
    loaded = Transformer(cfg, moe=moe, seed=0).eval()  # as built from the saved config
    ids = torch.tensor([tokenizer.encode("to be or") + [tokenizer.eos_id] + tokenizer.encode("that is")])
    with torch.no_grad():
        assert not torch.allclose(loaded(ids).logits, trained(ids).logits)  # the mask matters here
        apply_document_mask(loaded, {"data": {"document_mask": False}}, tokenizer)
        assert loaded.config.document_separator is None  # a run trained without it stays without
        apply_document_mask(loaded, {"data": {"document_mask": True}}, tokenizer)
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=0)
