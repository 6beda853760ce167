"""Rules that span config sections: each broken one names the field, its value and the rule."""

from __future__ import annotations

import pytest

from moetrain.config.loader import load_config


@pytest.mark.parametrize("overrides, message", [
    (["model.head=classifier", "model.num_classes=4", "data.document_mask=true", "data.tokenizer=bpe"],
     r"data\.document_mask \(True\) needs model\.head = \"lm\""),
    (["finetune.lora_rank=4", "moe.expert_lr_scale_max=2.0"],
     r"moe\.expert_lr_scale_max \(2\.0\) must be 1\.0 with LoRA on the routed experts"),
])
def test_cross_section_rules(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_a_tokenizer_json_brings_its_own_vocabulary(tmp_path):
    # data.vocab_size is the BPE target; a tokenizer.json's vocabulary is checked when the model is built.
    cfg = load_config(None, ["model.vocab_size=320", f"data.tokenizer={tmp_path / 'tokenizer.json'}"])
    assert cfg.model.vocab_size == 320
    with pytest.raises(ValueError, match=r"model\.vocab_size \(320\) must be >= the tokenizer vocabulary"):
        load_config(None, ["model.vocab_size=320"])
    # LoRA elsewhere than the experts leaves the per-expert learning rate acting.
    assert load_config(None, ["finetune.lora_rank=4", "finetune.lora_targets=[attention]",
                              "moe.expert_lr_scale_max=2.0"]).moe.expert_lr_scale_max == 2.0
