"""``convert --from-hf`` carries the Hugging Face folder's tokenizer into the moetrain export: the
files byte for byte, read back by ``moetrain generate`` (no ``--tokenizer``, no corpus) with the
ids and end-of-text id the `tokenizers` library and the folder's JSON give; a folder without a
tokenizer.json (a sentencepiece tokenizer.model only) converts all the same and says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moetrain.cli import main
from moetrain.interop.generation import load_tokenizer
from moetrain.interop.hf import import_hf
from tests.helpers.hf_tiny_models import VOCAB, tiny_model

LINES = ["the king and the queen of night", "thou art the sword of love", "a naive king sings at night",
         "love and night and the queen"]
SAMPLE = "the queen sings of love, thou king"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Formatted as no JSON writer here would write it: a rewritten file shows.
TOKENIZER_CONFIG = (b'{"bos_token": "<s>",  "eos_token": {"content": "</s>"},\r\n'
                    b' "tokenizer_class": "LlamaTokenizerFast"}\n')


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Mixtral (eos_token_id 2 in config.json and generation_config.json) with a Llama-style
    BPE trained here: <unk> <s> </s> = ids 0 1 2, metaspace, <s> prepended by the post-processor."""
    folder = tmp_path_factory.mktemp("hf")
    tiny_model("mixtral").save_pretrained(folder)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=VOCAB - 6, special_tokens=["<unk>", "<s>", "</s>"],
                                                       show_progress=False))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_bytes(TOKENIZER_CONFIG)
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    assert (folder / "generation_config.json").is_file()
    return folder


def _copy(hf_dir: Path, to: Path, *, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(hf_dir, to)
    for name in drop:
        (to / name).unlink()
    return to


def _generate_tokenizer(export: Path):
    """The tokenizer ``moetrain generate EXPORT`` uses when given no --tokenizer."""
    return load_tokenizer(yaml.safe_load((export / "config.yaml").read_text()), None, source=str(export))


def test_the_export_carries_the_hf_tokenizer_byte_for_byte_and_generate_reads_it(hf_dir, tmp_path, capsys):
    export = tmp_path / "mt"
    assert main(["convert", "--from-hf", str(hf_dir), "--to", str(export)]) == 0
    assert f"tokenizer files: {', '.join(FILES)}" in capsys.readouterr().out
    for name in FILES:
        assert (export / name).read_bytes() == (hf_dir / name).read_bytes(), name
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    eos_text = json.loads(TOKENIZER_CONFIG)["eos_token"]["content"]
    tok = _generate_tokenizer(export)
    want = reference.encode(SAMPLE, add_special_tokens=False).ids
    assert tok.encode(SAMPLE) == want and len(want) > 3
    assert tok.eos_id == reference.token_to_id(eos_text) == json.loads((hf_dir / "config.json").read_text())[
        "eos_token_id"] == 2
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True) <= VOCAB

    assert main(["generate", str(export), "--prompt", "the king", "--max-new-tokens", "3", "--temperature", "0",
                 "--ignore-eos", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(reference.decode(reference.encode("the king", add_special_tokens=False).ids))
    assert "3 new tokens" in out
    # Back to Hugging Face, the same files again (the export's tokenizer is the one it carries).
    assert main(["convert", str(export), "--to-hf", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()


def test_an_eos_named_only_by_config_json_is_kept(hf_dir, tmp_path):
    """The export has config.yaml, not config.json: the eos config.json names must survive anyway."""
    hf = _copy(hf_dir, tmp_path / "hf", drop=("tokenizer_config.json", "generation_config.json"))
    report = import_hf(hf, tmp_path / "mt")
    assert "tokenizer.json" in report.tokenizer_files and not report.no_tokenizer
    assert (tmp_path / "mt" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    eos = json.loads((hf / "config.json").read_text())["eos_token_id"]
    tok = _generate_tokenizer(tmp_path / "mt")
    assert tok.eos_id == eos and Tokenizer.from_file(str(hf / "tokenizer.json")).id_to_token(eos) == "</s>"


def test_a_folder_without_tokenizer_json_converts_and_says_what_is_missing(hf_dir, tmp_path, capsys):
    hf = _copy(hf_dir, tmp_path / "hf", drop=("tokenizer.json",))
    (hf / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece")
    export = tmp_path / "mt"
    export.mkdir()
    (export / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())  # an earlier one's
    assert main(["convert", "--from-hf", str(hf), "--to", str(export)]) == 0
    missing = [line for line in capsys.readouterr().out.splitlines() if "tokenizer" in line]
    assert len(missing) == 1 and "no tokenizer files" in missing[0] and "has no tokenizer.json" in missing[0]
    assert "tokenizer.model" in missing[0]
    assert not (export / "tokenizer.json").exists() and (export / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="--tokenizer"):
        _generate_tokenizer(export)

    # A tokenizer the loader refuses (its files disagree on the eos) stays behind too, with the reason.
    hf = _copy(hf_dir, tmp_path / "ambiguous")
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    report = import_hf(hf, tmp_path / "mt2")
    assert report.tokenizer_files == [] and "ambiguous" in report.no_tokenizer
    assert not (tmp_path / "mt2" / "tokenizer.json").exists()
