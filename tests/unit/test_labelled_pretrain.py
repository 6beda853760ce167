"""Pretraining a language model on a labelled corpus, then classifying from it: the language model reads
the train split's texts only (never the validation or test examples), with the tokenizer the classifier
builds, and the classifier starts from its export with the same token ids (one process, tiny model)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.config.classify import ClassifyConfig
from moetrain.config.data import DataConfig
from moetrain.config.loader import load_config
from moetrain.data.cache import MANIFEST_FORMAT
from moetrain.data.classify_data import prepare_labelled, prepare_labelled_lm
from moetrain.data.registry import CORPORA
from moetrain.train.init_from import HEAD_NAMES

WORDS = ("grain wheat corn harvest", "oil crude barrel opec", "bank rate money yen")
HEADER = "Text\tCategory\nstring\td\nmeta\tclass\n"


def _r8_cache(cache: Path, *, num_train: int = 48, num_test: int = 12) -> Path:
    """A stand-in for the cached R8 corpus: the registry's manifest over two tiny Orange tables whose
    test texts all carry the word "testonly"."""
    texts = cache / "corpora" / "r8" / "texts"
    texts.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, num, tag in (("r8-train.tab", num_train, "trainonly"), ("r8-test.tab", num_test, "testonly")):
        rows = []
        for i in range(num):
            words = WORDS[i % 3].split()
            rows.append(f"{tag} {' '.join(rng.choice(words, size=int(rng.integers(3, 8))))} {i}\tc{i % 3}\n")
        (texts / name).write_text(HEADER + "".join(rows), encoding="utf-8")
    manifest = {"format": MANIFEST_FORMAT, "sha256": CORPORA["r8"].sha256,
                "files": [{"name": "r8-test.tab"}, {"name": "r8-train.tab"}]}
    (cache / "corpora" / "r8" / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return cache


def test_a_stream_left_without_its_sidecar_is_rebuilt(tmp_path):
    # write_token_file renames the .bin into place before it writes the sidecar: a run killed between
    # the two leaves a .bin that no later run may trust as it is.
    data = DataConfig(corpus="r8", seq_len=64, val_fraction=0.25, cache_dir=str(_r8_cache(tmp_path / "cache")))
    first = prepare_labelled_lm(data, ClassifyConfig(tokenizer="bytes"), download=False)
    expected = np.array(first.train_tokens)
    Path(str(first.token_file) + ".json").unlink()
    first.token_file.write_bytes(first.token_file.read_bytes()[:10])
    again = prepare_labelled_lm(data, ClassifyConfig(tokenizer="bytes"), download=False)
    assert again.token_file == first.token_file
    np.testing.assert_array_equal(np.asarray(again.train_tokens), expected)


def test_the_stream_is_the_train_split_in_the_classifiers_token_ids(tmp_path):
    cache = _r8_cache(tmp_path / "cache")
    data = DataConfig(corpus="r8", vocab_size=300, seq_len=64, val_fraction=0.25, cache_dir=str(cache),
                      document_mask=True)
    classify = ClassifyConfig(tokenizer="bpe")
    lm = prepare_labelled_lm(data, classify, download=False)
    labelled = prepare_labelled(data, classify, download=False)
    assert lm.tokenizer.key == labelled.tokenizer.key and lm.vocab_size == labelled.vocab_size
    assert lm.document_separator == lm.eos_id == 0
    for name, stream in (("train", lm.train_tokens), ("val", lm.val_tokens)):
        split = labelled.splits[name]
        # Each example's ids as the classifier encodes them (none is cut at 64), each ending in eos.
        want = np.concatenate([split.ids_NS[n, :split.lengths_N[n]] for n in range(len(split.lengths_N))])
        np.testing.assert_array_equal(np.asarray(stream), want)
    decoded = lm.tokenizer.decode(lm.train_tokens.tolist())
    assert decoded.count("trainonly") == len(labelled.splits["train"].lengths_N) == 36
    assert "testonly" not in decoded + lm.tokenizer.decode(lm.val_tokens.tolist())
    with pytest.warns(UserWarning, match=r"data.tokenizer \('bytes'\) is ignored .* classify.tokenizer \('bpe'\)"):
        again = prepare_labelled_lm(dataclasses.replace(data, tokenizer="bytes"), classify, download=False)
    np.testing.assert_array_equal(again.train_tokens, lm.train_tokens)  # the same tokenizer, from the cache


def _fit(args: list[str]):
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, args))
    try:
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.fit()
        return trainer, start
    finally:
        trainer.close()


def test_a_classifier_starts_from_a_language_model_pretrained_on_its_train_split(tmp_path):
    from moetrain.interop.export import export_model

    cache = _r8_cache(tmp_path / "cache")
    common = ["--model.dim=32", "--model.num_layers=2", "--model.num_heads=2", "--model.max_seq_len=16",
              "--moe.num_experts=4", "--moe.top_k=2", "--moe.expert_hidden_dim=32", "--moe.collapse_threshold=0.75",
              "--data.corpus=r8",
              "--data.vocab_size=300", "--data.seq_len=16", "--data.val_fraction=0.25", f"--data.cache_dir={cache}",
              "--train.global_batch_size=4", "--train.micro_batch_size=4", "--train.device=cpu",
              "--optim.warmup_steps=1", "--log.every=1", "--log.progress_bar=false", "--log.tensorboard=false"]
    lm, _ = _fit([*common, "--train.steps=3", "--train.eval_steps=1", "--data.document_mask=true",
                  f"--log.run_dir={tmp_path / 'lm'}", "--checkpoint.every=0"])
    export_model(tmp_path / "lm", tmp_path / "export")
    classifier, start = _fit([*common, "--train.steps=2", "--model.head=classifier", "--model.num_classes=3",
                              "--model.pooling=attention", f"--log.run_dir={tmp_path / 'cls'}",
                              f"--checkpoint.init_from={tmp_path / 'export'}", "--checkpoint.init_from_new_head=true"])
    assert lm.data.tokenizer.key == classifier.data.tokenizer.key
    pretrained = dict(lm.model.named_parameters())
    assert set(start) - set(pretrained) == {"pool_query"} and set(HEAD_NAMES) <= set(start)
    for name, tensor in start.items():
        if name not in HEAD_NAMES:
            assert torch.equal(tensor, pretrained[name].detach()), name
    assert start["output.weight"].shape == (3, 32) and pretrained["output.weight"].shape == (lm.data.vocab_size, 32)
