"""The attention and backbone fields of ``ModelConfig``: every bad value raises ValueError naming
the field, its value and the rule; the resolved values; fields of one attention kind rejected
under the other rather than ignored."""

import pytest

from moetrain.config import ModelConfig

MLA = {"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 10}

BAD = [
    # (kwargs, message regex: field (value) rule)
    ({"head_dim": 7}, r"model\.head_dim \(7\) must be even \(rotary\)"),
    ({"head_dim": 0}, r"model\.head_dim \(0\) must be None or an int >= 2"),
    ({"dim": 130, "num_heads": 4}, r"model\.dim \(130\) must be divisible by model\.num_heads \(4\)"),
    ({"qkv_bias": 1}, r"model\.qkv_bias \(1\) must be true or false"),
    ({"qk_norm": "layer"}, r"model\.qk_norm \('layer'\) must be one of 'none', 'head', 'full'"),
    ({"clip_qkv": 0.0}, r"model\.clip_qkv \(0\.0\) must be None or a finite number > 0"),
    ({"clip_qkv": True}, r"model\.clip_qkv \(True\) must be None or a finite number > 0"),
    ({"attention": "gqa"}, r"model\.attention \('gqa'\) must be one of 'mha', 'mla'"),
    ({"kv_lora_rank": 512}, r'model\.kv_lora_rank \(512\) acts only with model\.attention "mla"'),
    ({"q_lora_rank": 64}, r'model\.q_lora_rank \(64\) acts only with model\.attention "mla"'),
    ({**MLA, "qk_rope_head_dim": 5}, r"model\.qk_rope_head_dim \(5\) must be even \(rotary\)"),
    ({**MLA, "kv_lora_rank": 0}, r"model\.kv_lora_rank \(0\) must be an int >= 1"),
    ({**MLA, "q_lora_rank": 0}, r"model\.q_lora_rank \(0\) must be None or an int >= 1"),
    ({**MLA, "v_head_dim": 2.5}, r"model\.v_head_dim \(2\.5\) must be an int >= 1"),
    ({**MLA, "num_kv_heads": 2}, r'model\.num_kv_heads \(2\) must be None with model\.attention "mla"'),
    ({**MLA, "qk_norm": "head"}, r"model\.qk_norm \('head'\) must be 'none' with model\.attention \"mla\""),
    ({**MLA, "head_dim": 16}, r'model\.head_dim \(16\) must be None with model\.attention "mla"'),
    ({"rope_interleave": "yes"}, r"model\.rope_interleave \('yes'\) must be true or false"),
    ({"num_layers": 4, "dense_layers": (4,)}, (r"model\.dense_layers \(\(4,\)\) must be a list of block ids "
                                              r"in \[0, model\.num_layers \(4\)\)")),
    ({"dense_layers": (-1,)}, r"model\.dense_layers \(\(-1,\)\) must be a list of block ids"),
    ({"dense_layers": (1, 1)}, r"model\.dense_layers \(\(1, 1\)\) must not name a block twice"),
    ({"dense_layers": "1"}, r"model\.dense_layers \('1'\) must be a list of block ids"),
    ({"pooling": "max", "head": "classifier", "num_classes": 2}, r"model\.pooling \('max'\) must be one of"),
    ({"pooling": "mean"}, (r"model\.pooling \('mean'\) acts only with model\.head \"classifier\" "
                          r"\(model\.head is 'lm'\)")),
    ({"causal": False}, r'model\.causal \(False\) may be false only with model\.head "classifier"'),
    ({"causal": 0, "head": "classifier", "num_classes": 2}, r"model\.causal \(0\) must be true or false"),
    ({"document_separator": -1}, r"model\.document_separator \(-1\) must be None or an int >= 0"),
    ({"document_separator": 100, "vocab_size": 100}, (r"model\.document_separator \(100\) must be < "
                                                     r"model\.vocab_size \(100\)")),
    ({"document_separator": 3, "head": "classifier", "num_classes": 2},
     r'model\.document_separator \(3\) acts only with model\.head "lm"'),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_values_name_field_value_and_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_resolved_dims():
    assert ModelConfig(dim=64, num_heads=4).resolved_head_dim == 16
    explicit = ModelConfig(dim=64, num_heads=4, head_dim=24)  # dim need not be heads * head_dim
    assert explicit.head_dim == 24 and explicit.resolved_head_dim == 24 and explicit.rope_dim == 24
    assert ModelConfig(dim=66, num_heads=4, head_dim=16).resolved_head_dim == 16  # no divisibility rule
    mla = ModelConfig(dim=64, num_heads=4, **MLA)
    assert mla.resolved_head_dim == 14 and mla.rope_dim == 6 and mla.head_dim is None


def test_dense_layers_from_a_list_and_the_moe_placement():
    cfg = ModelConfig(num_layers=6, moe_every=2, moe_layer_offset=1, dense_layers=[3])
    assert cfg.dense_layers == (3,)
    assert cfg.moe_layer_ids == [1, 5]


def test_valid_classifier_and_document_fields():
    clf = ModelConfig(head="classifier", num_classes=3, pooling="mean", causal=False)
    assert (clf.pooling, clf.causal) == ("mean", False)
    lm = ModelConfig(vocab_size=100, document_separator=99)
    assert lm.with_vocab_size(50).document_separator == 99
    with pytest.raises(ValueError, match=r"model\.document_separator \(60\) must be < model\.vocab_size \(50\)"):
        ModelConfig(document_separator=60).with_vocab_size(50)
