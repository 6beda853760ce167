"""Hashed n-gram features (``model.ngram_buckets``, ``moetrain.models.ngram``): the buckets against a
plain-Python reimplementation of the documented hash, causality and padding, the table's gradient,
that the feature off leaves the model as it was, loading it through ``checkpoint.init_from``, and
every refusal by name."""

from __future__ import annotations

import random

import pytest
import torch

from moetrain.config.loader import load_config
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import write_export
from moetrain.interop.hf.family import backbone_problems
from moetrain.interop.hf.registry import choose_family
from moetrain.models.ngram import ngram_buckets
from moetrain.models.transformer import Transformer, count_params
from moetrain.plan.model_states import param_specs
from moetrain.train.init_from import load_initial_weights

MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=24)
SIZES = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=16)
CLS = dict(**SIZES, head="classifier", num_classes=5, pooling="attention", causal=False)
TABLE = "ngram_embeddings.weight"


def reference_buckets(ids: list[int], *, num_buckets: int, max_order: int) -> list[list[int]]:
    """The hash as docs/classification.md states it, in Python integers: [position][order - 2]."""
    rows = []
    for s in range(len(ids)):
        row = []
        for n in range(2, max_order + 1):
            h = n
            for t in range(s - n + 1, s + 1):
                h = (h * 116049371 + (ids[t] + 1 if t >= 0 else 0)) % (2**31 - 1)
            row.append(h % num_buckets)
        rows.append(row)
    return rows


def with_table(seed: int = 0, **fields) -> Transformer:
    """A classifier whose n-gram table is drawn (not the zero init), so that it changes the outputs."""
    model = Transformer(ModelConfig(**{**CLS, "ngram_buckets": 101, **fields}), moe=MOE, seed=seed)
    with torch.no_grad():
        model.ngram_embeddings.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return model


def test_buckets_match_the_documented_hash():
    # Fixed values: the module and the reference above must both reproduce them.
    ids = [5, 0, 63, 5]
    expected = [[26, 971], [247, 192], [455, 813], [829, 137]]
    assert reference_buckets(ids, num_buckets=1000, max_order=3) == expected
    got = ngram_buckets(torch.tensor([ids]), num_buckets=1000, max_order=3)
    assert got.dtype == torch.int64 and got.tolist() == [expected]
    rng = random.Random(0)
    for num_buckets, max_order in ((2, 2), (97, 3), (65536, 5), (2**31 - 2, 4)):
        batch = [[rng.randrange(200_000) for _ in range(9)] for _ in range(3)]
        got = ngram_buckets(torch.tensor(batch, dtype=torch.int32), num_buckets=num_buckets, max_order=max_order)
        assert got.shape == (3, 9, max_order - 1)
        assert got.tolist() == [reference_buckets(r, num_buckets=num_buckets, max_order=max_order) for r in batch]
        assert 0 <= int(got.min()) and int(got.max()) < num_buckets
    # The order starts the hash: a trigram opening before the start is not the bigram it ends with.
    assert len(set(ngram_buckets(torch.tensor([[7]]), num_buckets=2**31 - 2, max_order=3)[0, 0].tolist())) == 2


def test_a_position_reads_only_its_own_and_earlier_tokens():
    table = with_table().ngram_embeddings
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    base = table(ids)
    for s in range(10):
        changed = ids.clone()
        changed[:, s:] = (changed[:, s:] + 1) % 64
        after = table(changed)
        assert torch.equal(after[:, :s], base[:, :s]), s
        assert not torch.equal(after[:, s], base[:, s]), s


def test_the_padding_leaves_the_real_positions_alone():
    model = with_table().eval()
    ids = torch.randint(1, 64, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.arange(12)[None, :] < torch.tensor([[12], [7], [1]])
    logits = model(ids, padding_mask_BS=mask).logits
    for pad in (0, 63):
        padded = ids.masked_fill(~mask, pad)
        assert torch.allclose(model(padded, padding_mask_BS=mask).logits, logits, atol=1e-6, rtol=0)
    # The short rows score as they would alone, without their padding.
    for b, n in ((1, 7), (2, 1)):
        alone = model(ids[b:b + 1, :n]).logits
        assert torch.allclose(alone, logits[b:b + 1], atol=1e-5, rtol=0)


def test_off_is_the_model_without_the_field_and_on_starts_from_it():
    plain = Transformer(ModelConfig(**CLS), moe=MOE, seed=3)
    off = Transformer(ModelConfig(**CLS, ngram_buckets=0), moe=MOE, seed=3)
    on = Transformer(ModelConfig(**CLS, ngram_buckets=101), moe=MOE, seed=3)
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in off.named_parameters()] == names and off.ngram_embeddings is None
    assert sorted(n for n, _ in on.named_parameters()) == sorted([*names, TABLE])
    assert torch.equal(on.ngram_embeddings.weight, torch.zeros(101, 32))  # the zero init
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    for model in (off, on):  # the same draws by name: a zero table adds nothing
        for name, p in plain.named_parameters():
            assert torch.equal(model.get_parameter(name), p), name
        assert torch.equal(model(ids).logits, plain(ids).logits)
    # Counted wherever parameters are: the model, the config-only count and the planner's specs.
    assert count_params(on.config, MOE) == on.param_counts()
    assert on.param_counts().total - plain.param_counts().total == 101 * 32
    assert on.param_counts().embedding == (64 + 101) * 32
    spec = {s.name: s for s in param_specs(on.config, MOE)}[TABLE]
    assert spec.shape == (101, 32) and not spec.expert and not spec.matrix  # replicated, and AdamW's under Muon


def test_the_gradient_of_each_row_sums_its_positions():
    model = with_table(dropout=0.0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    grabbed = {}

    def keep_grad(module, inputs, out):  # returns None: the output stays the embedding's
        out.register_hook(lambda g: grabbed.update(g=g))

    model.tok_embeddings.register_forward_hook(keep_grad)
    loss = torch.nn.functional.cross_entropy(model(ids).logits, torch.tensor([1, 4]))
    loss.backward()
    # The table's rows are added to the token embedding: each row's gradient is the sum of that
    # embedding's gradient over the (position, order) pairs that hash to it.
    expected = torch.zeros(101, 32)
    for b in range(2):
        for s, row in enumerate(reference_buckets(ids[b].tolist(), num_buckets=101, max_order=3)):
            for bucket in row:
                expected[bucket] += grabbed["g"][b, s]
    grad = model.ngram_embeddings.weight.grad
    assert grad.abs().sum() > 0 and torch.allclose(grad, expected, atol=1e-7, rtol=1e-5)


def test_init_from_carries_the_table_and_a_language_model_export_leaves_it_fresh(tmp_path):
    source = with_table(seed=6)
    path = write_export(tmp_path / "cls", config={}, state_dict=source.state_dict())
    model = with_table(seed=7)
    load_initial_weights(model, path, new_head=True)
    assert torch.equal(model.ngram_embeddings.weight, source.ngram_embeddings.weight)
    assert not torch.equal(model.output.weight, source.output.weight)  # the head is the model's own
    load_initial_weights(model := with_table(seed=7), path)
    assert all(torch.equal(t, source.state_dict()[n]) for n, t in model.state_dict().items())
    # A language model has no table: the classifier's stays at its zero init under a new head.
    lm = Transformer(ModelConfig(**SIZES), moe=MOE, seed=8)
    lm_path = write_export(tmp_path / "lm", config={}, state_dict=lm.state_dict())
    fresh = Transformer(ModelConfig(**CLS, ngram_buckets=101), moe=MOE, seed=9)
    load_initial_weights(fresh, lm_path, new_head=True)
    assert torch.equal(fresh.ngram_embeddings.weight, torch.zeros(101, 32))
    assert torch.equal(fresh.tok_embeddings.weight, lm.tok_embeddings.weight)
    with pytest.raises(ValueError, match=r"missing: ngram_embeddings\.weight, pool_query;"):
        load_initial_weights(fresh, lm_path)
    # A state dict round trip (what the native checkpoint stores) holds the table under its name.
    again = with_table(seed=10)
    again.load_state_dict(source.state_dict())
    assert torch.equal(again.ngram_embeddings.weight, source.ngram_embeddings.weight)


@pytest.mark.parametrize("fields, message", [
    ({"ngram_buckets": 64}, r"model\.ngram_buckets \(64\) must be 0 with model\.head 'lm'"),
    ({**CLS, "ngram_buckets": 1}, r"model\.ngram_buckets \(1\) must be 0 \(off\) or in \[2, 2147483647\)"),
    ({**CLS, "ngram_buckets": 2**31 - 1}, r"model\.ngram_buckets \(2147483647\) must be 0 \(off\) or in"),
    ({**CLS, "ngram_buckets": -1}, r"model\.ngram_buckets \(-1\) must be an int >= 0"),
    ({**CLS, "ngram_buckets": True}, r"model\.ngram_buckets \(True\) must be an int >= 0"),
    ({**CLS, "ngram_buckets": 64, "ngram_max_order": 1}, r"model\.ngram_max_order \(1\) must be an int >= 2"),
    ({**CLS, "ngram_max_order": 2}, r"model\.ngram_max_order \(2\) acts only with model\.ngram_buckets > 0"),
])
def test_model_refusals_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SIZES, **fields})


CLASSIFIER = ["model.head=classifier", "model.num_classes=4", "model.causal=false", "model.ngram_buckets=64"]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=2"], r"model\.ngram_buckets \(64\) must be 0 with parallel\.tp > 1"),
    (["parallel.pp=2", "model.num_layers=2"], r"model\.ngram_buckets \(64\) must be 0 with parallel\.pp \(2\) > 1"),
])
def test_parallel_refusals_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [*CLASSIFIER, "classify.tokenizer=bpe", *overrides])


def test_hugging_face_conversion_refuses_the_table():
    model = ModelConfig(**CLS, ngram_buckets=64, activation="swiglu")
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=24, activation="swiglu")
    assert backbone_problems(model, moe, family="Mixtral")[0].startswith("model.ngram_buckets (64) must be 0")
    with pytest.raises(ValueError, match=r"mixtral: model\.ngram_buckets \(64\) must be 0"):
        choose_family(model, moe)
