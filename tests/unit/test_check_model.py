"""The launcher's model check (``moetrain train --nproc N`` runs it once before starting the ranks)
accepts what one process accepts: a model whose vocabulary is set (an export's, an upcycled
model's) smaller than data.vocab_size, the BPE's target size, which a byte or pretrained tokenizer
does not reach. Before, it compared the two and refused the job only when launched."""

from __future__ import annotations

import pytest

from moetrain.cli.launch import check_model
from moetrain.config.loader import load_config


def test_a_set_model_vocabulary_is_not_compared_with_the_bpe_target():
    cfg = load_config("tiny", ["--model.vocab_size=256", "--data.vocab_size=4096", "--data.tokenizer=bytes"])
    check_model(cfg)  # raised "model.vocab_size (256) must be >= the tokenizer's vocabulary (4096)"
    with pytest.raises(ValueError, match="finetune.lora_targets"):  # the check still checks
        check_model(load_config("tiny", ["--model.vocab_size=256", "--data.tokenizer=bytes", "--finetune.lora_rank=4",
                                         "--finetune.lora_targets=[shared_experts]"]))
