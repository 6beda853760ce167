"""A run carries its tokenizer: the trainer saves it beside config.yaml, ``moetrain export`` and
``convert --to-hf`` (for ``AutoTokenizer``) copy it, and ``moetrain generate`` reads it back with the
same ids, vocab_size, eos and decode, without the corpus or its cache (one process, tiny models)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import yaml

from moetrain.cli import main
from moetrain.data.documents import Documents
from moetrain.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    PretrainedTokenizer,
    load_saved_tokenizer,
    save_tokenizer,
    train_bpe,
)

WORDS = ["thou", "art", "the", "king", "and", "queen", "of", "night", "love", "sword", "ö", "naïve", "戦", "—"]
SAMPLE = f"thou art the king — naïve 戦 😀\n\t{EOS_TOKEN}and the queen  of night{EOS_TOKEN}"


def _corpus(path: Path, *, seed: int = 0, num_lines: int = 400) -> Path:
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                              for _ in range(num_lines)) + "\n", encoding="utf-8")
    return path


def _same(a, b) -> None:
    """``b`` is ``a`` read back: the same ids, vocabulary, end of text and decode."""
    ids = a.encode(SAMPLE)
    assert b.encode(SAMPLE) == ids and b.encode_batch([SAMPLE, "king"]) == a.encode_batch([SAMPLE, "king"])
    assert (b.vocab_size, b.eos_id) == (a.vocab_size, a.eos_id)
    assert b.decode(ids) == a.decode(ids) == SAMPLE


def test_a_trained_bpe_saved_and_read_back_is_the_same_tokenizer(tmp_path):
    bpe = train_bpe(Documents([_corpus(tmp_path / "c.txt")], label="c"), vocab_size=300)
    assert save_tokenizer(bpe, tmp_path / "run") == ["tokenizer.json", "tokenizer_config.json"]
    back = load_saved_tokenizer(tmp_path / "run")
    assert back is not None and back.eos_id == 0  # <|endoftext|>, which a BPE reserves
    _same(bpe, back)
    assert load_saved_tokenizer(tmp_path) is None


def test_a_pretrained_tokenizer_keeps_the_eos_of_the_files_beside_it(tmp_path):
    """Its eos named only by config.json (not copied: a run folder has its own config) is written into
    tokenizer_config.json; a stale generation_config.json naming another eos is removed."""
    hf = tmp_path / "hf"
    train_bpe(Documents([_corpus(tmp_path / "c.txt")], label="c"), vocab_size=300).save(hf / "tokenizer.json")
    (hf / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (hf / "special_tokens_map.json").write_text(json.dumps({"pad_token": EOS_TOKEN}))
    original = PretrainedTokenizer.from_file(hf / "tokenizer.json")
    assert original.eos_id == 5
    run = tmp_path / "run"
    run.mkdir()
    (run / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert sorted(save_tokenizer(original, run)) == ["special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert not (run / "generation_config.json").exists()
    back = load_saved_tokenizer(run)
    assert back is not None and back.key == original.key  # the same bytes: the same token cache
    _same(original, back)
    # A tokenizer_config.json that names the eos itself is copied as it is.
    (hf / "config.json").unlink()
    (hf / "tokenizer_config.json").write_bytes(b'{"eos_token": {"content": "<|endoftext|>"}, "x": 1}\r\n')
    save_tokenizer(PretrainedTokenizer.from_file(hf / "tokenizer.json"), run)
    assert (run / "tokenizer_config.json").read_bytes() == (hf / "tokenizer_config.json").read_bytes()
    assert load_saved_tokenizer(run).eos_id == 0
    assert save_tokenizer(ByteTokenizer(), run) == [] and not (run / "tokenizer.json").exists()


def _train(run_dir: Path, corpus: Path, cache: Path, tokenizer: str, *overrides: str):
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, [
        "--model.dim=32", "--model.num_layers=1", "--model.num_heads=2", "--model.max_seq_len=32",
        "--moe.num_experts=4", "--moe.top_k=2", "--moe.expert_hidden_dim=32", "--moe.collapse_threshold=0.75",
        "--data.corpus=path", f"--data.path={corpus}", f"--data.cache_dir={cache}", f"--data.tokenizer={tokenizer}",
        "--data.vocab_size=300", "--data.seq_len=32", "--data.val_fraction=0.1",
        "--train.steps=1", "--train.global_batch_size=2", "--train.micro_batch_size=2", "--train.eval_every=0",
        "--train.device=cpu", "--checkpoint.every=0", f"--log.run_dir={run_dir}", "--log.progress_bar=false",
        "--log.tensorboard=false", *overrides]))
    try:
        trainer.fit()
        return trainer.data.tokenizer
    finally:
        trainer.close()


def _generate(capsys, source: Path) -> str:
    capsys.readouterr()
    assert main(["generate", str(source), "--prompt", "thou art", "--max-new-tokens", "4", "--temperature", "0",
                 "--device", "cpu"]) == 0
    return capsys.readouterr().out


def test_generate_reads_the_runs_saved_bpe_without_the_corpus(tmp_path, capsys, monkeypatch):
    from moetrain.interop.export import export_model
    from moetrain.interop.generation import load_tokenizer

    run, cache = tmp_path / "run", tmp_path / "cache"
    trained = _train(run, _corpus(tmp_path / "corpus.txt"), cache, "bpe")
    assert trained.eos_id == 0 and (run / "tokenizer.json").is_file()
    checkpoint = next((run / "checkpoints").glob("step*"))
    export_model(checkpoint, tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    # `train --config EXPORT/config.yaml` starts a new run from the export; it used to resume the source run.
    exported = yaml.safe_load((tmp_path / "export" / "config.yaml").read_text())
    assert exported["log"]["run_dir"] == str((tmp_path / "export-run").resolve())
    assert exported["checkpoint"]["init_from"] == str((tmp_path / "export").resolve())
    shutil.rmtree(cache)
    (tmp_path / "corpus.txt").unlink()
    monkeypatch.setattr("moetrain.data.prepare.prepare_data", _refuse)
    config = yaml.safe_load((run / "config.yaml").read_text())
    for source in (run, checkpoint, tmp_path / "export"):
        _same(trained, load_tokenizer(config, None, source=str(source)))
    out = _generate(capsys, run)
    assert out.startswith("thou art") and "4 new tokens" in out


def test_a_bytes_run_saves_no_tokenizer_and_still_generates(tmp_path, capsys, monkeypatch):
    from moetrain.interop.generation import load_tokenizer

    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.json").write_text("{}")  # an earlier run's: it would be read as this one's
    assert isinstance(_train(run, _corpus(tmp_path / "corpus.txt"), tmp_path / "cache", "bytes"), ByteTokenizer)
    assert not (run / "tokenizer.json").exists()
    monkeypatch.setattr("moetrain.data.prepare.prepare_data", _refuse)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert isinstance(load_tokenizer(config, None, source=str(run)), ByteTokenizer)
    out = _generate(capsys, run)
    assert out.startswith("thou art") and "4 new tokens" in out


def _refuse(*args, **kwargs):
    raise AssertionError("prepare_data was called: the tokenizer needs no corpus")


def test_the_hugging_face_export_of_a_bpe_run_carries_its_tokenizer(tmp_path, capsys):
    """A run that trained its BPE on the corpus (no data.tokenizer file to copy) converts to a folder
    whose tokenizer AutoTokenizer loads with the run's ids and end of text, from the run folder or a
    checkpoint of it; a byte-tokenizer run has none to write, and the summary says so."""
    from transformers import AutoTokenizer

    run, corpus = tmp_path / "run", _corpus(tmp_path / "corpus.txt")
    mixtral = "--moe.activation=swiglu"  # what Hugging Face's MoE families hold
    trained = _train(run, corpus, tmp_path / "cache", "bpe", mixtral)
    for source in (run, next((run / "checkpoints").glob("step*"))):
        out = tmp_path / f"hf-{source.name}"
        capsys.readouterr()
        assert main(["convert", str(source), "--to-hf", str(out)]) == 0
        assert "tokenizer files: tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
        hf = AutoTokenizer.from_pretrained(out)
        assert hf(SAMPLE)["input_ids"] == trained.encode(SAMPLE)
        assert hf.eos_token_id == trained.eos_id == 0
        assert hf.decode(trained.encode(SAMPLE)) == SAMPLE
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == trained.eos_id

    _train(tmp_path / "bytes", corpus, tmp_path / "cache", "bytes", mixtral)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "bytes"), "--to-hf", str(tmp_path / "hf-bytes")]) == 0
    assert "no tokenizer files: the byte tokenizer" in capsys.readouterr().out
    assert not list((tmp_path / "hf-bytes").glob("tokenizer*"))
    assert json.loads((tmp_path / "hf-bytes" / "config.json").read_text())["eos_token_id"] is None
