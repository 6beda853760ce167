"""``checkpoint.init_from_new_head``: a classifier starts from a language model's export with the encoder
loaded exactly and its own head (output layer, attention-pooling query) as drawn from its seed; without
the flag the mismatch is refused by name; a head tied to the embeddings cannot be started fresh."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import write_export
from moetrain.models.transformer import Transformer
from moetrain.train.init_from import HEAD_NAMES, load_initial_weights

LM = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=32, tie_embeddings=True)
CLS = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=32, head="classifier",
                  num_classes=5, pooling="attention", causal=False)
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=24)


def test_classifier_from_a_language_model_export(tmp_path):
    lm = Transformer(LM, moe=MOE, seed=1)
    path = write_export(tmp_path / "lm", config={}, state_dict=lm.state_dict())
    fresh = Transformer(CLS, moe=MOE, seed=2)
    with torch.no_grad():
        fresh.pool_query.normal_()  # a head value that cannot come from the export by chance
    own_head = {n: t.detach().clone() for n, t in fresh.state_dict().items() if n in HEAD_NAMES}
    assert set(own_head) == set(HEAD_NAMES)
    load_initial_weights(fresh, path, new_head=True)
    lm_sd, got = lm.state_dict(), fresh.state_dict()
    for name, tensor in got.items():
        if name in HEAD_NAMES:
            assert torch.equal(tensor, own_head[name]), name
        else:
            assert torch.equal(tensor, lm_sd[name]), name
    assert got["output.weight"].shape == (5, 32)
    # The loaded classifier trains: its head gets gradients, the encoder too.
    loss = torch.nn.functional.cross_entropy(fresh(torch.randint(0, 64, (2, 8))).logits, torch.tensor([0, 3]))
    loss.backward()
    assert fresh.output.weight.grad.abs().sum() > 0 and fresh.tok_embeddings.weight.grad.abs().sum() > 0


def test_without_the_flag_the_head_mismatch_is_named(tmp_path):
    path = write_export(tmp_path / "lm", config={}, state_dict=Transformer(LM, moe=MOE, seed=1).state_dict())
    model = Transformer(CLS, moe=MOE, seed=2)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"missing: pool_query.*output\.weight \(export \(64, 32\), model \(5, 32\)\)"):
        load_initial_weights(model, path)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())  # nothing copied


def test_a_tied_head_cannot_start_fresh(tmp_path):
    path = write_export(tmp_path / "lm", config={}, state_dict=Transformer(LM, moe=MOE, seed=1).state_dict())
    with pytest.raises(ValueError, match=r"checkpoint\.init_from_new_head \(True\) cannot start a head tied"):
        load_initial_weights(Transformer(LM, moe=MOE, seed=2), path, new_head=True)


def test_the_flag_needs_an_export():
    with pytest.raises(ValueError, match=r"checkpoint\.init_from_new_head \(True\) needs checkpoint\.init_from"):
        CheckpointConfig(init_from_new_head=True)


def test_classifier_from_a_multi_token_language_model_export(tmp_path):
    # The export's multi-token modules (mtp.*) only train the language model: a classifier, which has
    # none, leaves them out; a model that has them (here a language model with a new head) loads them.
    lm_cfg = dataclasses.replace(LM, mtp_depth=1, tie_embeddings=False)
    lm = Transformer(lm_cfg, moe=MOE, seed=1)
    lm_sd = lm.state_dict()
    assert any(n.startswith("mtp.0.block.feed_forward.experts.") for n in lm_sd)
    path = write_export(tmp_path / "lm", config={}, state_dict=lm_sd)
    cls = Transformer(CLS, moe=MOE, seed=2)
    got = cls.state_dict()
    assert not any(n.startswith("mtp.") for n in got)
    assert load_initial_weights(cls, path, new_head=True) == len(got) - len(HEAD_NAMES)
    for name, tensor in got.items():
        if name not in HEAD_NAMES:
            assert torch.equal(tensor, lm_sd[name]), name
    other = Transformer(lm_cfg, moe=MOE, seed=3)
    own_output = other.output.weight.detach().clone()
    load_initial_weights(other, path, new_head=True)
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, own_output if name == "output.weight" else lm_sd[name]), name
